// Prompt to pixels for FLUX.2 [klein]: tokenise, encode, sample, decode, in the order and
// precision of diffusers' Flux2KleinPipeline.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>

#include <unistd.h>

#include "apus/apus.h"
#include "core/error.h"
#include "cost/roofline.h"
#include "io/model_dir.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "sampling/flow_match.h"
#include "sampling/torch_rng.h"
#include "text/klein_prompt.h"

namespace apus {

namespace {

constexpr int kMaxSequence = 512;                   // the pipeline's max_sequence_length
const std::vector<int> kTextTaps = {9, 18, 27};      // the pipeline's text_encoder_out_layers
constexpr int kMaxSide = 4096;

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
    const SafetensorsFile f = SafetensorsFile::open(o.noise_file);
    const Tensor& n = f.get("noise");
    APUS_CHECK(n.shape == Shape({1, channels, h, w}), o.noise_file, ": tensor 'noise' has shape ",
               shape_str(n.shape), ", expected ", shape_str({1, channels, h, w}));
    nchw = to_dtype(n, act);
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

// Refuses a request whose largest stage would not fit in this machine's memory (weights it reads
// plus twice its counted activations, for the backend's own scratch) instead of letting the
// kernel's OOM killer end the process halfway.
void check_memory(const ImageOptions& o) {
  const PipelineCost cost = count_klein(o.model_dir, o.width, o.height, o.steps);
  const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  for (const StageCost& s : cost.stages) {
    const double need = s.per_call.weight_bytes + 2 * s.activation_bytes;
    APUS_CHECK(need <= ram, o.width, "x", o.height, " needs about ", int(need / 1e9 + 0.5),
               " GB in its ", s.name, " stage, more than this machine's ", int(ram / 1e9), " GB");
  }
}

}  // namespace

uint64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

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
  }
  clock.stop("text encoder");

  {
    // The transformer is unmapped before the decoder runs, like the text encoder before it.
    const auto dit = flux2::Transformer::load(dir);
    dit.make_resident();
    std::vector<int64_t> txt_ids, img_ids;
    for (int64_t i = 0; i < kMaxSequence; ++i) txt_ids.insert(txt_ids.end(), {0, 0, 0, i});
    for (int64_t r = 0; r < h; ++r)
      for (int64_t c = 0; c < w; ++c) img_ids.insert(img_ids.end(), {0, r, c, 0});
    const auto prologue = dit.prologue(ctx, prompt_embeds, txt_ids, img_ids);
    Tensor velocity = Tensor::heap({l, dit.config().out_channels}, ctx.act);
    clock.stop("transformer load");
    for (int i = 0; i < o.steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      dit.forward(ctx, prologue, latents, sched.timesteps[size_t(i)], velocity);
      euler_step(ctx, latents, velocity, sched.sigmas[size_t(i)], sched.sigmas[size_t(i) + 1]);
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
  flux2::image_to_rgb8(image, result.rgb);
  clock.stop("vae decode");
  return result;
}

}  // namespace apus
