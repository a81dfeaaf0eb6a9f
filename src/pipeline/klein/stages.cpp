// klein's stages (encode_text, encode_references, prologue, step, decode) and the table of them
// that count() walks in counting mode and generate() runs on weights (pipeline/driver.h).
#include <algorithm>
#include <optional>
#include <vector>

#include "core/error.h"
#include "io/hf_cache.h"
#include "ops/backend.h"
#include "pipeline/klein/klein_model.h"
#include "sampling/noise.h"
#include "sampling/torch_rng.h"
#include "text/klein_prompt.h"
#include "text/utf8.h"

namespace apus {

namespace {

using flux2::kMaxSequence;
using flux2::kTextTaps;

constexpr const char* kDecodeStage = "vae_decode";
constexpr const char* kReferenceStage = "vae_encode";

}  // namespace

KleinModel::KleinModel(const ModelDir& dir, Weights weights, const ProcessGroup* tensor_ranks)
    : dir_(dir),
      configs_(dir.without_weights()),
      weights_(weights),
      tensor_ranks_(tensor_ranks),
      label_(dir.label().empty() ? model_label(dir.root()) : dir.label()) {
  const flux2::KleinIndex index = flux2::check_klein_index(dir_);
  distilled_ = index.distilled;
  reference_cache_ = index.reference_cache;
  // Everything a directory can get wrong in its configs is found here, before any request.
  const auto text_cfg = flux2::TextEncoderConfig::read(dir_.config("text_encoder"));
  // The transformer counted once: its config, and its weights' shapes for adapters to fit.
  const flux2::Transformer counted =
      flux2::Transformer::load(configs_.config("transformer"), configs_.weights("transformer"));
  dit_cfg_ = counted.config();
  dit_weights_ = counted.weight_shapes();
  const flux2::VaeConfig vae_cfg = flux2::VaeConfig::read(dir_.config("vae"));
  check_configs_agree(text_cfg, vae_cfg);
  scheduler_cfg_ = dir_.config("scheduler", "scheduler_config.json");
  if (weights_ == Weights::none) return;
  // The tokenizer folder's tokenizer.json, or a file given for it (a GGUF carrying one): named
  // here, not left to BpeTokenizer::load, so the vocabulary check below names the file itself.
  const std::string tokenizer = dir_.part("tokenizer");
  const std::string tokenizer_file = is_directory(tokenizer) ? tokenizer + "/tokenizer.json" : tokenizer;
  tokenizer_.emplace(BpeTokenizer::load(tokenizer_file));
  APUS_CHECK(tokenizer_->max_id() < text_cfg.vocab, tokenizer_file, ": token id ", tokenizer_->max_id(),
             " has no row in the text encoder's ", text_cfg.vocab,
             "-entry embedding (text_encoder/config.json vocab_size)");
  if (weights_ == Weights::resident) {
    text_.emplace(
        flux2::TextEncoder::load(dir_.config("text_encoder"), dir_.weights("text_encoder"), kTextTaps, tensor_ranks_));
    dit_.emplace(flux2::Transformer::load(dir_.config("transformer"), dir_.weights("transformer"), tensor_ranks_));
    vae_.emplace(flux2::VaeDecoder::load(dir_.config("vae"), dir_.weights("vae")));
    vae_encoder_.emplace(flux2::VaeEncoder::load(dir_.config("vae"), dir_.weights("vae")));
    text_->make_resident();
    dit_->make_resident();
    vae_->make_resident();
    vae_encoder_->make_resident();
  }
}

// The three models' configs describe one pipeline: the text encoder's taps feed the transformer's
// context embedding, the VAE's packed latents are the transformer's tokens. A disagreement is
// named by both files and keys here, not found later as a shape error blamed on one stage.
void KleinModel::check_configs_agree(const flux2::TextEncoderConfig& text, const flux2::VaeConfig& vae) const {
  const std::string root = dir_.root() + "/";
  const int64_t prompt_features = int64_t(kTextTaps.size()) * text.hidden;
  APUS_CHECK(prompt_features == dit_cfg_.joint_dim, root, "text_encoder/config.json hidden_size ", text.hidden,
             " gives ", kTextTaps.size(), " taps x ", text.hidden, " = ", prompt_features, " prompt features, but ",
             root, "transformer/config.json joint_attention_dim is ", dit_cfg_.joint_dim);
  for (const auto& [key, channels] :
       {std::pair{"in_channels", dit_cfg_.in_channels}, std::pair{"out_channels", dit_cfg_.out_channels}})
    APUS_CHECK(channels == vae.packed_channels(), root, "transformer/config.json ", key, " is ", channels, ", but ",
               root, "vae/config.json latent_channels ", vae.latent_channels, " packed ", vae.patch, "x", vae.patch,
               " gives ", vae.packed_channels(), " features a token");
}

void KleinModel::noised_image(Context& c, const Work& w, float sigma, Tensor& out) const {
  ArenaScope arena(*c.arena);
  const Tensor weight = ops::host_filled(c, {1}, DType::f32, [&](Tensor& t) { t.ptr<float>()[0] = sigma; });
  const int64_t l = w.h * w.w;
  const Tensor image = w.refs.rows(0, l);
  for (int64_t b = 0; b < w.batch; ++b) {
    Tensor to = out.rows(b * l, (b + 1) * l);
    ops::blend(c, image, w.noise.rows(b * l, (b + 1) * l), weight, to);
  }
}

void KleinModel::encode_references(Context& c, const flux2::VaeEncoder& encoder, Work& w) const {
  w.refs = ops::empty(c, {w.ref_tokens, encoder.config().packed_channels()}, c.act);
  int64_t at = 0;
  for (size_t k = 0; k < w.crops.size(); ++k) {
    const Crop& crop = w.crops[k];
    ArenaScope arena(*c.arena);
    // The image processor's scaling in fp32, u8 / 255 * 2 - 1, then the VAE's dtype.
    const Tensor pixels = ops::host_filled(c, {1, 3, crop.height, crop.width}, DType::f32, [&](Tensor& t) {
      const Rgb8Image& src = *w.sources[k];
      const int64_t plane = crop.height * crop.width;
      float* to = t.ptr<float>();
      for (int64_t y = 0; y < crop.height; ++y)
        for (int64_t x = 0; x < crop.width; ++x)
          for (int64_t ch = 0; ch < 3; ++ch) {
            const uint8_t v = src.rgb[size_t(((crop.top + y) * src.width + crop.left + x) * 3 + ch)];
            to[ch * plane + y * crop.width + x] = float(v) / 255.0f * 2.0f - 1.0f;
          }
    });
    Tensor image = Tensor::in(*c.arena, pixels.shape, c.act);
    ops::copy(c, pixels, image);
    Tensor tokens = w.refs.rows(at, at + crop.tokens());
    encoder.encode(c, image, tokens);
    at += crop.tokens();
  }
}

void KleinModel::encode_text(Context& c, const flux2::TextEncoder& encoder, Work& w) const {
  // Split, every rank holds the same prompts: the linears' features split over the ranks.
  w.prompt_embeds = encoder.encode(c, w.ids, w.mask, w.samples, ranks_sharing_inputs(w.parallel));
}

void KleinModel::prologue(Context& c, const flux2::Transformer& dit, Work& w) const {
  const AdapterScope adapted(c, w.adapters.get());
  const int64_t l = w.h * w.w;
  const Tensor txt_ids = c.count_only ? Tensor::shape_only({kMaxSequence, 4}, DType::i64)
                                      : ops::to_context(c, flux2::text_position_ids(kMaxSequence));
  std::vector<std::pair<int64_t, int64_t>> grids;
  for (const Crop& crop : w.crops)
    grids.emplace_back(crop.height / flux2::kTokenPixels, crop.width / flux2::kTokenPixels);
  // With the reference cache the references leave the sequence: they run once, here.
  const int64_t seq_refs = w.reference_cache ? 0 : w.ref_tokens;
  if (w.reference_cache) {
    const Tensor ref_ids = c.count_only ? Tensor::shape_only({w.ref_tokens, 4}, DType::i64)
                                        : ops::to_context(c, flux2::image_and_reference_position_ids(0, 0, grids));
    w.reference_kv = dit.reference_kv(c, w.refs, ref_ids);
    grids.clear();
  }
  const Tensor img_ids = c.count_only ? Tensor::shape_only({l + seq_refs, 4}, DType::i64)
                                      : ops::to_context(c, flux2::image_and_reference_position_ids(w.h, w.w, grids));
  w.prologue = dit.prologue(c, w.prompt_embeds, txt_ids, img_ids);
  if (w.parallel.strategy == Parallel::ulysses)
    w.prologue = w.prologue->rank_share(c, SequenceSplit{w.parallel.group, {kMaxSequence, l + seq_refs}});
  w.velocity = ops::empty(c, {w.samples * (l + seq_refs), dit.config().out_channels}, c.act);
  if (w.inpainting) {
    CostScope scope(c, "sampler");
    w.inpaint_mask = ops::to_context(c, w.inpaint_mask);
    // The drawn noise stays for re-noising the image at every step.
    w.noise = w.latents;
    w.latents = ops::empty(c, w.noise.shape, w.noise.dtype);
    noised_image(c, w, w.schedule.sigmas[size_t(w.first_step)], w.latents);
  }
}

void KleinModel::step(Context& c, const flux2::Transformer& dit, Work& w, int i) const {
  ++w.steps_run;
  const size_t s = size_t(i);
  ArenaScope arena(*c.arena);
  const int64_t refs = w.reference_cache ? 0 : w.ref_tokens;  // reference tokens in the sequence
  const int64_t rows = w.latents.shape[0], l = w.h * w.w, seq = l + refs;
  Tensor x = w.latents, velocity = w.velocity;
  if (w.guided || refs > 0) {
    // Every sample's sequence: its latents, then the reference tokens; guided, both branches see
    // the same latents, as one batch.
    x = Tensor::in(*c.arena, {w.samples * seq, w.latents.shape[1]}, w.latents.dtype);
    for (int64_t sample = 0; sample < w.samples; ++sample) {
      const int64_t b = sample % w.batch;
      Tensor image = x.rows(sample * seq, sample * seq + l);
      ops::copy(c, w.latents.rows(b * l, (b + 1) * l), image);
      if (refs == 0) continue;
      Tensor tail = x.rows(sample * seq + l, (sample + 1) * seq);
      ops::copy(c, w.refs, tail);
    }
  }
  {
    const AdapterScope adapted(c, w.adapters.get());
    split_forward(c, w.parallel, w.samples, x, w.velocity,
                  [&](int64_t first, int64_t count, const Tensor& mine, Tensor& out) {
                    dit.forward(c, w.prologue->samples(first, count), mine, w.schedule.timesteps[s], out,
                                w.reference_kv ? &*w.reference_kv : nullptr);
                  });
  }
  if (w.adapters && i == w.first_step) {
    // The prologue and one step run every linear: an adapter left unapplied was lost on the way.
    const std::vector<std::string> missing = w.adapters->unapplied();
    APUS_CHECK(missing.empty(), label_, ": the LoRA for '", missing.empty() ? "" : missing.front(),
               "' was never applied (its weight does not reach a linear as loaded)");
  }
  CostScope scope(c, "sampler");
  if (refs > 0) {
    // The image tokens' velocities, sample by sample (the pipeline's noise_pred[:, :L]).
    velocity = Tensor::in(*c.arena, {w.samples * l, w.velocity.shape[1]}, w.velocity.dtype);
    for (int64_t sample = 0; sample < w.samples; ++sample) {
      Tensor to = velocity.rows(sample * l, (sample + 1) * l);
      ops::copy(c, w.velocity.rows(sample * seq, sample * seq + l), to);
    }
  }
  Tensor conditional = velocity.rows(0, rows);
  if (w.guided) {
    Tensor uncond = velocity.rows(rows, 2 * rows);
    classifier_free_guidance(c, conditional, uncond, w.cfg);
    conditional = uncond;
  }
  euler_step(c, w.latents, conditional, w.schedule.sigmas[s], w.schedule.sigmas[s + 1]);
  if (w.inpainting) {
    // Outside the mask the image, noised to the next sigma; after the last step (sigma 0) that is
    // the image itself, as the pipeline takes it unnoised.
    Tensor image = Tensor::in(*c.arena, w.latents.shape, w.latents.dtype);
    noised_image(c, w, w.schedule.sigmas[s + 1], image);
    ops::blend(c, image, w.latents, w.inpaint_mask, w.latents);
  }
  if (!w.previews.empty() && !c.count_only) send_previews(c, w, conditional, i);
}

void KleinModel::send_previews(Context& c, const Work& w, const Tensor& velocity, int i) const {
  std::call_once(preview_fitted_, [&] { preview_.emplace(flux2::LatentPreview::fit(*vae_, device())); });
  const std::vector<float> x = to_f32_vector(ops::to_host(c, w.latents)), v = to_f32_vector(ops::to_host(c, velocity));
  // The flow's estimate of the clean latents: x_next - sigma_next * velocity.
  const float sigma = w.schedule.sigmas[size_t(i) + 1];
  const int64_t l = w.h * w.w, ch = w.latents.shape[1];
  std::vector<float> estimate(size_t(l * ch));
  for (size_t b = 0; b < w.previews.size(); ++b) {
    if (!w.previews[b]) continue;
    for (size_t k = 0; k < estimate.size(); ++k)
      estimate[k] = x[size_t(int64_t(b) * l * ch) + k] - sigma * v[size_t(int64_t(b) * l * ch) + k];
    Preview p;
    p.step = i - w.first_step + 1;
    p.steps = w.steps - w.first_step;
    p.image = preview_->image(estimate.data(), w.h, w.w);
    w.previews[b](p);
  }
}

void KleinModel::decode(Context& c, const flux2::VaeDecoder& vae, Work& w) const {
  const int64_t s = flux2::kTokenPixels;
  w.image = ops::empty(c, {w.batch, vae.config().out_channels, w.h * s, w.w * s}, c.act);
  // Split, every rank holds the same latents: the VAE's convolutions split over the ranks too.
  vae.decode(c, w.latents, w.h, w.w, w.image, ranks_sharing_inputs(w.parallel));
}

void KleinModel::count_inputs(Work& w, int batch) const {
  w.ids.assign(size_t(w.samples * kMaxSequence), 0);
  w.mask.assign(size_t(w.samples * kMaxSequence), 1);
  w.latents = Tensor::shape_only({batch * w.h * w.w, dit_cfg_.in_channels}, DType::bf16);
  w.refs = Tensor::shape_only({w.ref_tokens, dit_cfg_.in_channels}, DType::bf16);
}

void KleinModel::tokenize(Work& w, const std::vector<ImageRequest>& requests, std::vector<ImageResult>&,
                          const Progress&) const {
  auto add = [&](const std::string& text, const char* what) {
    // Checked before the chat template wraps it, so an offset counts the user's own bytes.
    require_utf8(text, std::string("the ") + what);
    const int n_tokens = klein_prompt_length(*tokenizer_, text);
    APUS_CHECK(n_tokens <= kMaxSequence, "the ", what, " is ", n_tokens, " tokens with the chat template, over the ",
               kMaxSequence, " the text encoder takes");
    std::vector<int32_t> mask32;
    const std::vector<int32_t> ids = encode_klein_prompt(*tokenizer_, text, kMaxSequence, &mask32);
    w.ids.insert(w.ids.end(), ids.begin(), ids.end());
    w.mask.insert(w.mask.end(), mask32.begin(), mask32.end());
  };
  for (const ImageRequest& o : requests) {
    APUS_CHECK(!o.prompt.empty(), "the prompt is empty");
    add(o.prompt, "prompt");
  }
  if (w.guided)
    for (const ImageRequest& o : requests) add(o.negative_prompt.value_or(""), "negative prompt");
}

void KleinModel::initial_noise(Context& c, Work& w, const std::vector<ImageRequest>& requests,
                               std::vector<ImageResult>& results) const {
  const int64_t channels = dit_cfg_.in_channels, l = w.h * w.w;
  const DType act = c.act;
  w.latents = ops::empty(c, {w.batch * l, channels}, act);
  w.previews = preview_sinks(requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    Tensor nchw;
    if (!requests[i].noise_file.empty()) {
      nchw = read_noise(requests[i].noise_file, {1, channels, w.h, w.w}, act);
    } else {
      // The official pipeline draws the latents in the model dtype with torch's CPU generator.
      nchw = Tensor::heap({1, channels, w.h, w.w}, act);
      // A batch drawn from one generator is one torch.randn of the whole batch (torch's normals
      // come in blocks of 16, so its parts are not separate draws): output noise_index's part of
      // that draw.
      const int64_t n = nchw.numel(), before = requests[i].noise_index * n;
      TorchGenerator gen(results[i].seed);
      if (act == DType::bf16) {
        std::vector<uint16_t> draw(size_t(before + n));
        gen.randn_bf16(draw.data(), before + n);
        std::copy(draw.begin() + before, draw.end(), nchw.ptr<uint16_t>());
      } else {
        std::vector<float> draw(size_t(before + n));
        gen.randn(draw.data(), before + n);
        std::copy(draw.begin() + before, draw.end(), nchw.ptr<float>());
      }
    }
    // Channel planes to tokens (token = row * w + col).
    Tensor rows = w.latents.rows(int64_t(i) * l, int64_t(i + 1) * l);
    ops::transpose(c, ops::to_context(c, nchw).reshape({channels, l}), rows);
  }
}

std::vector<std::unique_ptr<Part<KleinModel::Work>>> KleinModel::make_parts() const {
  using Text = flux2::TextEncoder;
  using Encoder = flux2::VaeEncoder;
  using Dit = flux2::Transformer;
  using Vae = flux2::VaeDecoder;
  std::vector<std::unique_ptr<Part<Work>>> parts;
  parts.push_back(model_part<Work, Text>(
      {"text encoder load",
       [this](Weights wt, DType) {
         return Text::load(source(wt).config("text_encoder"), source(wt).weights("text_encoder"), kTextTaps,
                           tensor_ranks_);
       },
       &text_,
       {{kTextStage, "text encoder", [this](Context& c, const Text& m, Work& w, int) { encode_text(c, m, w); },
         &Work::prompt_embeds, "the text encoder"}}}));
  parts.push_back(model_part<Work, Encoder>(
      {"vae encoder load",
       [this](Weights wt, DType) { return Encoder::load(source(wt).config("vae"), source(wt).weights("vae")); },
       &vae_encoder_,
       {{kReferenceStage,
         "vae encode",
         [this](Context& c, const Encoder& m, Work& w, int) { encode_references(c, m, w); },
         &Work::refs,
         "the VAE encoder",
         {},
         /*replicated=*/true}},
       [](const Work& w) { return w.ref_tokens > 0; }}));
  parts.push_back(model_part<Work, Dit>(
      {"transformer load",
       [this](Weights wt, DType) {
         return Dit::load(source(wt).config("transformer"), source(wt).weights("transformer"), tensor_ranks_);
       },
       &dit_,
       {{kPrologueStage, "transformer prologue", [this](Context& c, const Dit& m, Work& w, int) { prologue(c, m, w); }},
        {kStepStage, "", [this](Context& c, const Dit& m, Work& w, int i) { step(c, m, w, i); }, &Work::latents, "",
         [](const Work& w) {
           return StepRange{w.first_step, w.steps, &w.schedule.sigmas};
         }}}}));
  parts.push_back(model_part<Work, Vae>(
      {"vae load",
       [this](Weights wt, DType) { return Vae::load(source(wt).config("vae"), source(wt).weights("vae")); },
       &vae_,
       {{kDecodeStage,
         "vae decode",
         [this](Context& c, const Vae& m, Work& w, int) { decode(c, m, w); },
         &Work::image,
         "the VAE decoder",
         {},
         /*replicated=*/true}}}));
  return parts;
}

void KleinModel::finish(Context& c, Work& w, const std::vector<ImageRequest>& requests,
                        std::vector<ImageResult>& results) const {
  const ImageRequest& r = requests.front();
  const int64_t batch = w.batch, plane = w.image.numel() / batch;
  for (int64_t i = 0; i < batch; ++i) {
    const Tensor image = w.image.reshape({batch, plane})
                             .rows(i, i + 1)
                             .reshape({1, w.image.shape[1], w.image.shape[2], w.image.shape[3]});
    Tensor rgb = ops::empty(c, {*r.height, *r.width, 3}, DType::u8);
    ops::image_to_rgb8(c, image, rgb);
    const Tensor bytes = ops::to_host(c, rgb);
    ImageResult& res = results[size_t(i)];
    res.rgb.assign(bytes.ptr<uint8_t>(), bytes.ptr<uint8_t>() + bytes.numel());
    res.steps = w.steps;
    res.steps_run = w.steps_run;
    res.cfg = w.guided ? *r.cfg : 1.0f;
    res.width = *r.width;
    res.height = *r.height;
  }
}

std::unique_ptr<ImageModel> open_klein(const ModelDir& dir, Weights weights, const ProcessGroup* tensor_ranks) {
  return std::make_unique<KleinModel>(dir, weights, tensor_ranks);
}

}  // namespace apus
