// Prompt to pixels for FLUX.2 [klein]: tokenise, encode, sample, decode, in the order and
// precision of diffusers' Flux2KleinPipeline.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "apus/apus.h"
#include "core/error.h"
#include "cost/roofline.h"
#include "core/memory.h"
#include "io/model_dir.h"
#include "models/flux2/klein.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "sampling/flow_match.h"
#include "sampling/noise.h"
#include "sampling/torch_rng.h"
#include "text/klein_prompt.h"

namespace apus {

namespace {

using flux2::kMaxSequence;
using flux2::kTextTaps;
constexpr int kMaxSide = 4096;
// Address space each pool thread takes beyond the counted stage: its malloc arena (glibc reserves
// 64 MiB per thread), its stack and oneDNN's per-thread scratch and kernels.
constexpr double kThreadAddressAllowance = 128.0 * (1 << 20);

class StageClock {
 public:
  explicit StageClock(std::vector<StageTime>& out) : out_(out) {}
  void stop(const std::string& name) {
    const auto now = std::chrono::steady_clock::now();
    out_.push_back({name, std::chrono::duration<double>(now - start_).count()});
    start_ = now;
  }
 private:
  std::vector<StageTime>& out_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

void check_options(const ImageOptions& o) {
  APUS_CHECK(o.width % 16 == 0 && o.height % 16 == 0, "width ", o.width, " and height ", o.height,
             " must be multiples of 16");
  APUS_CHECK(o.width >= 16 && o.height >= 16 && o.width <= kMaxSide && o.height <= kMaxSide,
             "width ", o.width, " x height ", o.height, " outside 16..", kMaxSide);
  APUS_CHECK(o.steps >= 1 && o.steps <= 200, "steps ", o.steps, " outside 1..200");
  APUS_CHECK(!o.prompt.empty(), "the prompt is empty");
}

// Initial noise [1, C, h, w] packed to tokens [h*w, C] (token = row * w + col).
Tensor initial_noise(const ImageOptions& o, uint64_t seed, int64_t channels, int64_t h, int64_t w,
                     DType act) {
  Tensor nchw;
  if (!o.noise_file.empty()) {
    nchw = read_noise(o.noise_file, {1, channels, h, w}, act);
  } else {
    // The official pipeline draws the latents in the model dtype with torch's CPU generator.
    nchw = Tensor::heap({1, channels, h, w}, act);
    TorchGenerator gen(seed);
    if (act == DType::bf16) gen.randn_bf16(nchw.ptr<uint16_t>(), nchw.numel());
    else gen.randn(nchw.ptr<float>(), nchw.numel());
  }
  Tensor packed = Tensor::heap({h * w, channels}, act);
  const size_t es = dtype_size(act);
  for (int64_t c = 0; c < channels; ++c)
    for (int64_t p = 0; p < h * w; ++p)
      std::memcpy(static_cast<char*>(packed.data) + size_t(p * channels + c) * es,
                  static_cast<const char*>(nchw.data) + size_t(c * h * w + p) * es, es);
  return packed;
}

// Refuses a request whose largest stage would not fit in the memory this process may use
// (weights it reads plus twice its counted activations, for the backend's own scratch) instead of
// letting the OOM killer or an allocation failure end it halfway.
void check_memory(const ImageOptions& o) {
  const PipelineCost cost = count_klein(o.model_dir, o.width, o.height, o.steps);
  const MemoryBudget budget = memory_budget();
  for (const StageCost& s : cost.stages) {
    const double need = s.per_call.weight_bytes + 2 * s.activation_bytes;
    APUS_CHECK(need <= budget.resident_bytes, o.width, "x", o.height, " needs about ",
               int(need / 1e9 + 0.5), " GB in its ", s.name, " stage, more than the ",
               int(budget.resident_bytes / 1e9), " GB of ", budget.resident_source);
    // Weights are mapped and scratch is reserved per thread, so the address space must hold the
    // stage plus the thread pool's allowance.
    const double address_need = need + kThreadAddressAllowance * double(omp_get_max_threads());
    APUS_CHECK(address_need <= budget.address_bytes, o.width, "x", o.height, " needs about ",
               int(address_need / 1e6 + 0.5), " MB of address space in its ", s.name,
               " stage, more than the ", int(std::max(budget.address_bytes, 0.0) / 1e6),
               " MB the address-space limit (ulimit -v) leaves");
  }
}

// Stops the request when a stage's output holds NaN or Inf: an image from it would be black or
// garbage, and its cast to bytes undefined.
void require_finite(Context& c, const Tensor& t, const std::string& stage) {
  APUS_CHECK(ops::all_finite(c, t), stage, " produced NaN or Inf (from a non-finite weight, ",
             "noise value or setting upstream)");
}

}  // namespace

ImageResult generate_image(const ImageOptions& o, const std::function<void(const std::string&)>& progress) {
  check_options(o);
  auto say = [&](const std::string& s) { if (progress) progress(s); };
  ImageResult result;
  result.width = o.width;
  result.height = o.height;
  result.seed = o.seed ? *o.seed : std::random_device{}();
  StageClock clock(result.stages);

  Arena arena;
  Context ctx{&arena, o.fp32 ? DType::f32 : DType::bf16};
  const ModelDir dir = ModelDir::open(o.model_dir);
  flux2::check_klein_index(dir);
  check_memory(o);
  // Everything that can reject the request (prompt, configs, schedule, noise file) comes before
  // any weight loads.
  const BpeTokenizer tokenizer = BpeTokenizer::load(dir.component("tokenizer") + "/tokenizer.json");
  const int n_tokens = klein_prompt_length(tokenizer, o.prompt);
  APUS_CHECK(n_tokens <= kMaxSequence, "the prompt is ", n_tokens, " tokens with the chat template, over the ",
             kMaxSequence, " the text encoder takes");
  std::vector<int32_t> mask32;
  const std::vector<int32_t> ids = encode_klein_prompt(tokenizer, o.prompt, kMaxSequence, &mask32);
  const std::vector<int64_t> mask(mask32.begin(), mask32.end());
  clock.stop("tokenize");
  const auto text_cfg = flux2::TextEncoderConfig::read(dir.config("text_encoder"));
  APUS_CHECK(tokenizer.max_id() < text_cfg.vocab, dir.component("tokenizer"),
             "/tokenizer.json: token id ", tokenizer.max_id(), " has no row in the text encoder's ",
             text_cfg.vocab, "-entry embedding (text_encoder/config.json vocab_size)");
  const auto dit_cfg = flux2::TransformerConfig::read(dir.config("transformer"));
  const int64_t h = o.height / 16, w = o.width / 16, l = h * w;
  const FlowSchedule sched = flow_match_schedule(dir.config("scheduler", "scheduler_config.json"),
                                                 o.steps, flux2_empirical_mu(l, o.steps));
  Tensor latents = initial_noise(o, result.seed, dit_cfg.in_channels, h, w, ctx.act);
  say("seed " + std::to_string(result.seed));

  Tensor prompt_embeds;
  {
    // The encoder's weights are unmapped when it leaves scope, before the transformer loads.
    const auto encoder = flux2::TextEncoder::load(dir, kTextTaps);
    encoder.make_resident();
    clock.stop("text encoder load");
    prompt_embeds = encoder.encode(ctx, ids, mask);
    require_finite(ctx, prompt_embeds, "the text encoder");
  }
  clock.stop("text encoder");

  {
    // The transformer is unmapped before the decoder runs, like the text encoder before it.
    const auto dit = flux2::Transformer::load(dir);
    dit.make_resident();
    const auto prologue = dit.prologue(ctx, prompt_embeds, flux2::text_position_ids(kMaxSequence),
                                       flux2::image_position_ids(h, w));
    Tensor velocity = Tensor::heap({l, dit.config().out_channels}, ctx.act);
    clock.stop("transformer load");
    for (int i = 0; i < o.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      dit.forward(ctx, prologue, latents, sched.timesteps[size_t(i)], velocity);
      euler_step(ctx, latents, velocity, sched.sigmas[size_t(i)], sched.sigmas[size_t(i) + 1]);
      require_finite(ctx, latents, "transformer step " + std::to_string(i + 1) + "/" +
                                       std::to_string(o.steps));
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char line[96];
      std::snprintf(line, sizeof line, "step %d/%d  sigma %.4f  %.2f s", i + 1, o.steps,
                    double(sched.sigmas[size_t(i)]), s);
      say(line);
      clock.stop("transformer step " + std::to_string(i + 1));
    }
  }

  const auto vae = flux2::VaeDecoder::load(dir);
  vae.make_resident();
  clock.stop("vae load");
  Tensor image = Tensor::heap({1, 3, o.height, o.width}, ctx.act);
  vae.decode(ctx, latents, h, w, image);
  require_finite(ctx, image, "the VAE decoder");
  flux2::image_to_rgb8(image, result.rgb);
  clock.stop("vae decode");
  return result;
}

Tensor flux2::text_position_ids(int64_t tokens) {
  Tensor ids = Tensor::heap({tokens, 4}, DType::i64);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t a = 0; a < 4; ++a) ids.ptr<int64_t>()[4 * i + a] = a == 3 ? i : 0;
  return ids;
}

Tensor flux2::image_position_ids(int64_t h, int64_t w) {
  Tensor ids = Tensor::heap({h * w, 4}, DType::i64);
  int64_t* p = ids.ptr<int64_t>();
  for (int64_t r = 0; r < h; ++r)
    for (int64_t c = 0; c < w; ++c, p += 4) {
      p[0] = 0;
      p[1] = r;
      p[2] = c;
      p[3] = 0;
    }
  return ids;
}

void flux2::check_klein_index(const ModelDir& dir) {
  const std::string index = dir.root() + "/model_index.json";
  APUS_CHECK(dir.pipeline_class() == "Flux2KleinPipeline", index, ": _class_name '",
             dir.pipeline_class(), "' is not supported (this build runs Flux2KleinPipeline)");
  const std::pair<const char*, std::vector<std::string>> components[] = {
      {"transformer", {"Flux2Transformer2DModel"}},
      {"vae", {"AutoencoderKLFlux2"}},
      {"text_encoder", {"Qwen3ForCausalLM", "Qwen3Model"}},
      {"tokenizer", {"Qwen2TokenizerFast", "Qwen2Tokenizer"}},
      {"scheduler", {"FlowMatchEulerDiscreteScheduler"}}};
  for (const auto& [name, classes] : components) {
    const std::string cls = dir.component_class(name);
    APUS_CHECK(std::find(classes.begin(), classes.end(), cls) != classes.end(), index, ": ", name,
               " class '", cls, "' is not supported (expected ", classes[0], ")");
  }
  const Json& distilled = dir.index().contains("is_distilled") ? dir.index()["is_distilled"] : Json();
  // The pipeline's default is false: a base model, sampled with classifier-free guidance.
  APUS_CHECK(distilled.is_boolean() && distilled.get<bool>(), index, ": is_distilled is ",
             distilled.dump(), "; only the guidance-distilled klein models (true) are supported yet");
}

}  // namespace apus
