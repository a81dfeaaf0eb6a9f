// FLUX.2 [klein]: tokenise, encode, sample, decode, in the order and precision of diffusers'
// Flux2KleinPipeline (text-to-image, editing with references, guidance for the -base models),
// Flux2KleinInpaintPipeline (inpainting) and Flux2KleinKVPipeline (the reference K/V cache). The
// stages are written once (encode_text, encode_references, prologue, step, decode); generate()
// runs them on weights, count() walks the same functions in counting mode.
#include <algorithm>
#include <cmath>
#include <optional>
#include <random>

#include "core/error.h"
#include "io/image.h"
#include "io/resize.h"
#include "models/flux2/klein.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "models/flux2/vae_encoder.h"
#include "ops/backend.h"
#include "pipeline/registry.h"
#include "pipeline/stage.h"
#include "sampling/flow_match.h"
#include "sampling/noise.h"
#include "sampling/torch_rng.h"
#include "text/bpe_tokenizer.h"
#include "text/klein_prompt.h"
#include "text/utf8.h"

namespace apus {

namespace {

using flux2::kMaxSequence;
using flux2::kTextTaps;

// The stages of one request, as the cost model and -v name them.
constexpr const char* kTextStage = "text_encoder";
constexpr const char* kPrologueStage = "dit_prologue";
constexpr const char* kStepStage = "dit_step";
constexpr const char* kDecodeStage = "vae_decode";
constexpr const char* kReferenceStage = "vae_encode";

// A reference image as Flux2ImageProcessor leaves it (see KleinModel::resolved for the resize of
// references over 1024x1024 pixels): the sides floored to multiples of 16 by a centre crop. An
// image to inpaint is resized to that size instead, and then taken whole.
struct Crop {
  int64_t left, top, width, height;
  int64_t tokens() const { return (width / 16) * (height / 16); }
};

void check_pixels(const Rgb8Image& image, const std::string& what) {
  const int64_t iw = image.width, ih = image.height;
  APUS_CHECK(iw > 0 && ih > 0 && int64_t(image.rgb.size()) == iw * ih * 3, what, ": ", iw, "x", ih, " with ",
             image.rgb.size(), " bytes; expected width x height x 3");
}

// The pipeline's check_image_input, on the image as given.
void check_reference(const Rgb8Image& image, size_t index) {
  const std::string what = "reference image " + std::to_string(index + 1);
  check_pixels(image, what);
  const int64_t iw = image.width, ih = image.height;
  APUS_CHECK(iw >= 64 && ih >= 64, what, " is ", iw, "x", ih, ": both sides must be at least 64 pixels");
  APUS_CHECK(std::max(iw, ih) <= 8 * std::min(iw, ih), what, " is ", iw, "x", ih,
             ": the aspect ratio must be at most 8:1");
}

// Flux2ImageProcessor._resize_to_target_area: over 1024x1024 pixels, the sides scaled to that
// area (truncated), resampled with PIL's Lanczos filter.
Rgb8Image within_target_area(Rgb8Image image) {
  constexpr double kArea = 1024.0 * 1024.0;
  if (int64_t(image.width) * image.height <= int64_t(kArea)) return image;
  const double scale = std::sqrt(kArea / (double(image.width) * double(image.height)));
  return resize_lanczos(image, int(image.width * scale), int(image.height * scale));
}

Crop crop_of(const Rgb8Image& image) {
  const int64_t iw = image.width, ih = image.height;
  const int64_t w = iw / 16 * 16, h = ih / 16 * 16;
  return {(iw - w) / 2, (ih - h) / 2, w, h};
}

// What a batch of requests carries from stage to stage (shape-only tensors in counting mode),
// sample after sample along the rows.
struct Work {
  int64_t batch = 1;
  // Guided, the transformer runs 2 x batch samples: the prompts', then the negative prompts'.
  bool guided = false;
  int64_t samples = 1;
  float cfg = 1;
  int64_t h = 0, w = 0;  // latent grid
  std::vector<int32_t> ids;  // samples x kMaxSequence
  std::vector<int64_t> mask;
  // Reference images: their crops, their pixels (shared by the batch), and their packed tokens
  // [ref_tokens, packed_channels], appended to every sample's image tokens.
  std::vector<Crop> crops;
  std::vector<const Rgb8Image*> sources;
  int64_t ref_tokens = 0;
  Tensor refs;
  // Inpainting: the image is the first reference (its tokens the first h * w rows of refs); the
  // sampler starts at first_step from the image noised with `noise`, and after each step keeps
  // the image (noised to the next sigma) in proportion 1 - inpaint_mask, per token.
  bool inpainting = false;
  int first_step = 0;
  // Flux2KleinKVPipeline with references: their keys and values, computed once in the prologue,
  // stand in for their tokens at every step.
  bool reference_cache = false;
  std::optional<flux2::ReferenceKv> reference_kv;
  Tensor noise, inpaint_mask;  // [batch * h * w, C] as latents; f32 [batch * h * w]
  FlowSchedule schedule;
  Tensor prompt_embeds, latents, velocity, image;
  std::optional<flux2::TransformerPrologue> prologue;
};

class KleinModel final : public ImageModel {
 public:
  KleinModel(const ModelDir& dir, Weights weights);
  std::vector<ImageResult> generate_batch(const std::vector<ImageRequest>& requests,
                                          const Progress& progress) const override;
  PipelineCost count(const ImageRequest& request, int batch) const override;
  const std::string& label() const override { return label_; }
  const std::string& sampler() const override { return sampler_; }
  // The KV pipeline's own default is 4 steps and it has no guidance.
  int default_steps() const override { return takes_guidance() ? flux2::kBaseSteps : flux2::kDistilledSteps; }
  float default_cfg() const override { return takes_guidance() ? flux2::kBaseGuidance : 1.0f; }
  bool takes_guidance() const override { return !distilled_ && !reference_cache_; }

 private:
  // The request with the model's defaults in place of its absent settings (width, height, steps
  // and cfg all present afterwards), each checked against ImageLimits and the model.
  ImageRequest resolved(const ImageRequest& r) const;
  void resolve_inpainting(ImageRequest& r) const;
  void encode_text(Context& c, const flux2::TextEncoder& encoder, Work& w) const;
  void encode_references(Context& c, const flux2::VaeEncoder& encoder, Work& w) const;
  void prologue(Context& c, const flux2::Transformer& dit, Work& w) const;
  void step(Context& c, const flux2::Transformer& dit, Work& w, int i) const;
  void decode(Context& c, const flux2::VaeDecoder& vae, Work& w) const;
  // Each sample's image latents noised to `sigma` into `out` (the scheduler's scale_noise).
  void noised_image(Context& c, const Work& w, float sigma, Tensor& out) const;

  Work plan(const ImageRequest& r, int64_t batch) const;  // grid and schedule
  // Each request's initial noise [1, C, h, w] packed to tokens into its rows of w.latents.
  void initial_noise(Context& c, const std::vector<ImageRequest>& requests,
                     const std::vector<uint64_t>& seeds, Work& w) const;

  ModelDir dir_;
  ModelDir configs_;  // the same directory without weights: what counting loads
  Weights weights_;
  bool distilled_ = true;
  bool reference_cache_ = false;  // Flux2KleinKVPipeline
  std::string label_, sampler_ = "Euler (flow match)";
  std::optional<BpeTokenizer> tokenizer_;
  flux2::TransformerConfig dit_cfg_;
  Config scheduler_cfg_;
  std::optional<flux2::TextEncoder> text_;
  std::optional<flux2::Transformer> dit_;
  std::optional<flux2::VaeDecoder> vae_;
  std::optional<flux2::VaeEncoder> vae_encoder_;
};

KleinModel::KleinModel(const ModelDir& dir, Weights weights)
    : dir_(dir),
      configs_(ModelDir::open(dir.root(), false)),
      weights_(weights),
      label_(model_label(dir.root())) {
  const flux2::KleinIndex index = flux2::check_klein_index(dir_);
  distilled_ = index.distilled;
  reference_cache_ = index.reference_cache;
  // Everything a directory can get wrong in its configs is found here, before any request.
  const auto text_cfg = flux2::TextEncoderConfig::read(dir_.config("text_encoder"));
  dit_cfg_ = flux2::TransformerConfig::read(dir_.config("transformer"));
  flux2::VaeConfig::read(dir_.config("vae"));
  scheduler_cfg_ = dir_.config("scheduler", "scheduler_config.json");
  if (weights_ == Weights::none) return;
  tokenizer_.emplace(BpeTokenizer::load(dir_.component("tokenizer") + "/tokenizer.json"));
  APUS_CHECK(tokenizer_->max_id() < text_cfg.vocab, dir_.component("tokenizer"),
             "/tokenizer.json: token id ", tokenizer_->max_id(), " has no row in the text encoder's ",
             text_cfg.vocab, "-entry embedding (text_encoder/config.json vocab_size)");
  if (weights_ == Weights::resident) {
    text_.emplace(flux2::TextEncoder::load(dir_, kTextTaps));
    dit_.emplace(flux2::Transformer::load(dir_));
    vae_.emplace(flux2::VaeDecoder::load(dir_));
    vae_encoder_.emplace(flux2::VaeEncoder::load(dir_));
    text_->make_resident();
    dit_->make_resident();
    vae_->make_resident();
    vae_encoder_->make_resident();
  }
}

// Flux2KleinInpaintPipeline's preprocessing, without the check_image_input of references the
// editing pipeline makes: the image scaled within 1024x1024 pixels and resized to its sides
// floored to multiples of 16, which the output takes; the mask resized to that.
void KleinModel::resolve_inpainting(ImageRequest& r) const {
  Inpainting& in = *r.inpaint;
  check_pixels(in.image, "the image to inpaint");
  check_pixels(in.mask, "the inpainting mask");
  APUS_CHECK_FIELD(in.strength >= 0 && in.strength <= 1, "strength", "strength ", in.strength, " outside [0, 1]");
  APUS_CHECK(r.references.size() <= 1, "inpainting takes one reference image (the pipeline's image_reference), not ",
             r.references.size());
  Rgb8Image image = within_target_area(std::move(in.image));
  const int w = image.width / 16 * 16, h = image.height / 16 * 16;
  APUS_CHECK(w >= 16 && h >= 16, "the image to inpaint is ", image.width, "x", image.height,
             ": both sides must be at least 16 pixels");
  APUS_CHECK(r.width.value_or(w) == w && r.height.value_or(h) == h, "inpainting renders at the image's size, ", w,
             "x", h, ", not the ", r.width.value_or(w), "x", r.height.value_or(h), " asked");
  r.width = w;
  r.height = h;
  if (image.width != w || image.height != h) image = resize_lanczos(image, w, h);
  in.image = std::move(image);
  if (in.mask.width != w || in.mask.height != h) in.mask = resize_lanczos(in.mask, w, h);
  for (Rgb8Image& reference : r.references) {
    check_pixels(reference, "the reference image");
    reference = within_target_area(std::move(reference));
    APUS_CHECK(reference.width >= 16 && reference.height >= 16, "the reference image is ", reference.width, "x",
               reference.height, ": both sides must be at least 16 pixels");
  }
}

ImageRequest KleinModel::resolved(const ImageRequest& request) const {
  ImageRequest r = request;
  APUS_CHECK(!reference_cache_ || !r.inpaint, label_, " is a Flux2KleinKVPipeline model (model_index.json), which ",
             "has no inpainting (Flux2KleinInpaintPipeline's)");
  if (r.inpaint) {
    resolve_inpainting(r);
  } else {
    for (size_t k = 0; k < r.references.size(); ++k) {
      check_reference(r.references[k], k);
      r.references[k] = within_target_area(std::move(r.references[k]));
    }
  }
  // The pipeline's output size: as asked, else the first reference's (cropped), else 1024. Only
  // an absent setting takes a default; a given one (0 included) is checked as given.
  const std::optional<Crop> first = r.references.empty() ? std::nullopt : std::optional<Crop>(crop_of(r.references[0]));
  if (!r.width) r.width = first ? int(first->width) : 1024;
  if (!r.height) r.height = first ? int(first->height) : 1024;
  if (!r.steps) r.steps = default_steps();
  if (!r.cfg) r.cfg = r.inpaint && takes_guidance() ? flux2::kInpaintGuidance : default_cfg();
  APUS_CHECK_FIELD(std::isfinite(*r.cfg) && *r.cfg > 0 && *r.cfg <= 100, "cfg", "cfg ", *r.cfg, " outside (0, 100]");
  // The official pipelines warn and ignore guidance on a distilled model (the KV pipeline has
  // none at all); a request for it is refused instead of rendered differently than asked.
  const char* why_not = reference_cache_
                            ? " is a Flux2KleinKVPipeline model (model_index.json), which runs without guidance: "
                            : " is step-distilled (model_index.json is_distilled: true) and runs without guidance: ";
  APUS_CHECK_FIELD(takes_guidance() || (*r.cfg <= 1 && !r.negative_prompt),
                   r.negative_prompt ? "negative_prompt" : "cfg", label_, why_not,
                   r.negative_prompt ? "a negative prompt" : detail::concat("cfg ", *r.cfg),
                   " is for the -base models");
  using L = ImageLimits;
  for (const auto& [name, side] : {std::pair{"width", *r.width}, std::pair{"height", *r.height}})
    APUS_CHECK_FIELD(side >= L::min_side && side <= L::max_side, name, name, " ", side, " outside ", L::min_side, "..",
                     L::max_side);
  APUS_CHECK_FIELD(*r.width % 16 == 0 && *r.height % 16 == 0, *r.width % 16 ? "width" : "height", "width ", *r.width,
                   " and height ", *r.height, " must be multiples of 16");
  APUS_CHECK_FIELD(*r.steps >= 1 && *r.steps <= L::max_steps, "steps", "steps ", *r.steps, " outside 1..",
                   L::max_steps);
  return r;
}

Work KleinModel::plan(const ImageRequest& r, int64_t batch) const {
  const int width = *r.width, height = *r.height, steps = *r.steps;  // resolved: all present and checked
  check_batch(batch, ImageLimits::max_batch);
  Work w;
  w.batch = batch;
  w.guided = *r.cfg > 1;
  w.samples = w.guided ? 2 * batch : batch;
  w.cfg = *r.cfg;
  w.h = height / 16;
  w.w = width / 16;
  w.schedule = flow_match_schedule(scheduler_cfg_, steps, flux2_empirical_mu(w.h * w.w, steps));
  if (r.inpaint) {
    w.inpainting = true;
    w.first_step = flux2::inpaint_first_step(steps, r.inpaint->strength);
    APUS_CHECK_FIELD(w.first_step < steps, "strength", "strength ", r.inpaint->strength, " of ", steps,
                     " steps runs no step (the pipeline refuses it too): raise the strength or the steps");
    w.sources.push_back(&r.inpaint->image);
    w.crops.push_back({0, 0, width, height});
    const int64_t l = w.h * w.w;
    w.inpaint_mask = Tensor::heap({batch * l}, DType::f32);
    const std::vector<float> mask = flux2::inpaint_mask(r.inpaint->mask, width, height);
    for (int64_t b = 0; b < batch; ++b) std::copy(mask.begin(), mask.end(), w.inpaint_mask.ptr<float>() + b * l);
  }
  for (const Rgb8Image& reference : r.references) {
    w.sources.push_back(&reference);
    w.crops.push_back(crop_of(reference));
  }
  for (const Crop& crop : w.crops) w.ref_tokens += crop.tokens();
  w.reference_cache = reference_cache_ && w.ref_tokens > 0;
  return w;
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
  w.prompt_embeds = encoder.encode(c, w.ids, w.mask, w.samples);
}

void KleinModel::prologue(Context& c, const flux2::Transformer& dit, Work& w) const {
  const int64_t l = w.h * w.w;
  const Tensor txt_ids = c.count_only ? Tensor::shape_only({kMaxSequence, 4}, DType::i64)
                                      : ops::to_context(c, flux2::text_position_ids(kMaxSequence));
  std::vector<std::pair<int64_t, int64_t>> grids;
  for (const Crop& crop : w.crops) grids.emplace_back(crop.height / 16, crop.width / 16);
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
  dit.forward(c, *w.prologue, x, w.schedule.timesteps[s], w.velocity,
              w.reference_kv ? &*w.reference_kv : nullptr);
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
}

void KleinModel::decode(Context& c, const flux2::VaeDecoder& vae, Work& w) const {
  const int64_t s = 16;  // pixels per latent token side: the VAE's 8x and the 2x2 patches
  w.image = ops::empty(c, {w.batch, vae.config().out_channels, w.h * s, w.w * s}, c.act);
  vae.decode(c, w.latents, w.h, w.w, w.image);
}

PipelineCost KleinModel::count(const ImageRequest& request, int batch) const {
  const ImageRequest r = resolved(request);
  Work w = plan(r, batch);
  PipelineCost p;
  p.model = label_;
  p.width = *r.width;
  p.height = *r.height;
  p.steps = *r.steps - w.first_step;
  p.references = int(r.references.size());
  p.cfg = w.guided ? *r.cfg : 1.0;
  w.ids.assign(size_t(w.samples * kMaxSequence), 0);
  w.mask.assign(size_t(w.samples * kMaxSequence), 1);
  w.latents = Tensor::shape_only({batch * w.h * w.w, dit_cfg_.in_channels}, DType::bf16);

  const auto text = flux2::TextEncoder::load(configs_, kTextTaps);
  const auto dit = flux2::Transformer::load(configs_);
  const auto vae = flux2::VaeDecoder::load(configs_);
  w.refs = Tensor::shape_only({w.ref_tokens, dit_cfg_.in_channels}, DType::bf16);
  StageCost text_stage = count_stage(kTextStage, 1, [&](Context& c) { encode_text(c, text, w); });
  StageCost prologue_stage = count_stage(kPrologueStage, 1, [&](Context& c) { prologue(c, dit, w); });
  StageCost step_stage =
      count_stage(kStepStage, *r.steps - w.first_step, [&](Context& c) { step(c, dit, w, w.first_step); });
  StageCost decode_stage = count_stage(kDecodeStage, 1, [&](Context& c) { decode(c, vae, w); });

  decode_stage.replicated = true;
  p.parameters = double(text.parameter_count() + dit.parameter_count() + vae.parameter_count());
  p.stages = {text_stage};
  if (w.ref_tokens > 0) {
    const auto encoder = flux2::VaeEncoder::load(configs_);
    p.stages.push_back(count_stage(kReferenceStage, 1, [&](Context& c) { encode_references(c, encoder, w); }));
    p.stages.back().replicated = true;
    p.parameters += double(encoder.parameter_count());
  }
  p.stages.insert(p.stages.end(), {prologue_stage, step_stage, decode_stage});
  return p;
}

void KleinModel::initial_noise(Context& c, const std::vector<ImageRequest>& requests,
                               const std::vector<uint64_t>& seeds, Work& w) const {
  const int64_t channels = dit_cfg_.in_channels, l = w.h * w.w;
  const DType act = c.act;
  w.latents = ops::empty(c, {w.batch * l, channels}, act);
  for (size_t i = 0; i < requests.size(); ++i) {
    Tensor nchw;
    if (!requests[i].noise_file.empty()) {
      nchw = read_noise(requests[i].noise_file, {1, channels, w.h, w.w}, act);
    } else {
      // The official pipeline draws the latents in the model dtype with torch's CPU generator.
      nchw = Tensor::heap({1, channels, w.h, w.w}, act);
      TorchGenerator gen(seeds[i]);
      if (act == DType::bf16) gen.randn_bf16(nchw.ptr<uint16_t>(), nchw.numel());
      else gen.randn(nchw.ptr<float>(), nchw.numel());
    }
    // Channel planes to tokens (token = row * w + col).
    Tensor rows = w.latents.rows(int64_t(i) * l, int64_t(i + 1) * l);
    ops::transpose(c, ops::to_context(c, nchw).reshape({channels, l}), rows);
  }
}

std::vector<ImageResult> KleinModel::generate_batch(const std::vector<ImageRequest>& requests,
                                                    const Progress& progress) const {
  APUS_CHECK(weights_ != Weights::none, dir_.root(), ": opened for counting only");
  APUS_CHECK(!requests.empty(), "no request to render");
  std::vector<ImageRequest> resolved_requests;
  for (const ImageRequest& o : requests) resolved_requests.push_back(resolved(o));
  const ImageRequest& r = resolved_requests.front();
  for (const ImageRequest& o : resolved_requests)
    APUS_CHECK(o.width == r.width && o.height == r.height && o.steps == r.steps && o.cfg == r.cfg && o.fp32 == r.fp32 &&
                   o.references.size() == r.references.size() &&
                   std::equal(o.references.begin(), o.references.end(), r.references.begin(),
                              [](const Rgb8Image& a, const Rgb8Image& b) {
                                return a.width == b.width && a.height == b.height && a.rgb == b.rgb;
                              }) &&
                   bool(o.inpaint) == bool(r.inpaint) &&
                   (!r.inpaint || (o.inpaint->strength == r.inpaint->strength &&
                                   o.inpaint->image.rgb == r.inpaint->image.rgb &&
                                   o.inpaint->mask.rgb == r.inpaint->mask.rgb)),
               "a batch shares width, height, steps, guidance, precision, reference images and inpainting: ", *o.width, "x",
               *o.height, ", ", *o.steps, " steps, cfg ", *o.cfg, " differs from ", *r.width, "x", *r.height, ", ",
               *r.steps, " steps, cfg ", *r.cfg);
  const int width = *r.width, height = *r.height, steps = *r.steps;
  const int64_t batch = int64_t(requests.size());
  check_memory(count(r, int(batch)), weights_ == Weights::resident,
               std::to_string(width) + "x" + std::to_string(height) +
                   (batch > 1 ? " x" + std::to_string(batch) : ""),
               dir_.device());
  auto say = [&](const std::string& s) { if (progress) progress(s); };
  std::vector<ImageResult> results(requests.size());
  std::vector<uint64_t> seeds;
  for (const ImageRequest& o : requests) seeds.push_back(o.seed ? *o.seed : std::random_device{}());
  std::vector<StageTime> stages;
  const std::unique_ptr<Trace> trace = trace_if_asked(requests);
  StageClock clock(stages, trace.get());
  // On a device (the directory opened on its backend) activations live in its memory.
  Backend* device = dir_.device();
  Arena arena(size_t(64) << 20, false, device ? static_cast<Allocator&>(*device) : host_allocator());
  Context ctx{&arena, r.fp32 ? DType::f32 : DType::bf16};
  ctx.backend = device;
  ctx.trace = trace.get();

  // Everything that can reject the request (prompt, schedule, noise file) comes before any weight
  // loads.
  Work w = plan(r, batch);
  auto tokenize = [&](const std::string& text, const char* what) {
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
    tokenize(o.prompt, "prompt");
  }
  if (w.guided)
    for (const ImageRequest& o : requests) tokenize(o.negative_prompt.value_or(""), "negative prompt");
  clock.stop("tokenize");
  initial_noise(ctx, requests, seeds, w);
  for (const uint64_t seed : seeds) say("seed " + std::to_string(seed));

  with_model(text_, [&] { return flux2::TextEncoder::load(dir_, kTextTaps); },
             [&](const flux2::TextEncoder& encoder) {
               clock.stop("text encoder load");
               run_stage(ctx, kTextStage, [&] { encode_text(ctx, encoder, w); });
               require_finite(ctx, w.prompt_embeds, "the text encoder");
               clock.stop("text encoder", kTextStage);
             });
  if (w.ref_tokens > 0)
    with_model(vae_encoder_, [&] { return flux2::VaeEncoder::load(dir_); },
               [&](const flux2::VaeEncoder& encoder) {
                 clock.stop("vae encoder load");
                 run_stage(ctx, kReferenceStage, [&] { encode_references(ctx, encoder, w); });
                 require_finite(ctx, w.refs, "the VAE encoder");
                 clock.stop("vae encode", kReferenceStage);
               });
  with_model(dit_, [&] { return flux2::Transformer::load(dir_); },
             [&](const flux2::Transformer& dit) {
               clock.stop("transformer load");
               run_stage(ctx, kPrologueStage, [&] { prologue(ctx, dit, w); });
               clock.stop("transformer prologue", kPrologueStage);
               for (int i = w.first_step; i < steps; ++i)
                 timed_step(ctx, clock, say, i - w.first_step, steps - w.first_step, w.schedule.sigmas[size_t(i)], w.latents,
                            kStepStage, [&] { run_stage(ctx, kStepStage, [&] { step(ctx, dit, w, i); }); });
             });
  with_model(vae_, [&] { return flux2::VaeDecoder::load(dir_); },
             [&](const flux2::VaeDecoder& vae) {
               clock.stop("vae load");
               run_stage(ctx, kDecodeStage, [&] { decode(ctx, vae, w); });
               require_finite(ctx, w.image, "the VAE decoder");
               const int64_t plane = w.image.numel() / batch;
               for (int64_t i = 0; i < batch; ++i) {
                 const Tensor image = w.image.reshape({batch, plane}).rows(i, i + 1).reshape(
                     {1, w.image.shape[1], w.image.shape[2], w.image.shape[3]});
                 Tensor rgb = ops::empty(ctx, {height, width, 3}, DType::u8);
                 ops::image_to_rgb8(ctx, image, rgb);
                 const Tensor bytes = ops::to_host(ctx, rgb);
                 results[size_t(i)].rgb.assign(bytes.ptr<uint8_t>(), bytes.ptr<uint8_t>() + bytes.numel());
               }
               clock.stop("vae decode", kDecodeStage);
             });
  const std::string timeline = trace ? trace->json() : "";
  for (size_t i = 0; i < results.size(); ++i) {
    results[i].steps = steps;
    results[i].steps_run = steps - w.first_step;
    results[i].cfg = w.guided ? *r.cfg : 1.0f;
    results[i].width = width;
    results[i].height = height;
    results[i].seed = seeds[i];
    results[i].stages = stages;
    if (requests[i].trace) results[i].trace = timeline;
  }
  return results;
}

}  // namespace

std::unique_ptr<ImageModel> open_klein(const ModelDir& dir, Weights weights) {
  return std::make_unique<KleinModel>(dir, weights);
}

std::vector<float> flux2::inpaint_mask(const Rgb8Image& mask, int width, int height) {
  APUS_CHECK(width % 16 == 0 && height % 16 == 0 && width > 0 && height > 0, "inpainting mask for ", width, "x",
             height, ": expected positive multiples of 16");
  const Rgb8Image sized = mask.width == width && mask.height == height ? mask : resize_lanczos(mask, width, height);
  const std::vector<uint8_t> grey = luminance(sized);
  const int gh = height / 16, gw = width / 16;
  // torch's bilinear interpolation, align_corners false, in float: source = scale (i + 0.5) - 0.5,
  // clamped at 0, between the taps i0 and i0 + 1 (the last row or column repeating).
  struct Tap {
    int i0, i1;
    float l0, l1;
  };
  auto tap = [](int in, int out, int i) {
    const float scale = float(in) / float(out);
    const float src = std::max(scale * (float(i) + 0.5f) - 0.5f, 0.0f);
    const int i0 = int(src);
    const float l1 = src - float(i0);
    return Tap{i0, i0 + (i0 < in - 1 ? 1 : 0), 1.0f - l1, l1};
  };
  auto bit = [&](int y, int x) { return grey[size_t(y) * size_t(width) + size_t(x)] >= 128 ? 1.0f : 0.0f; };
  std::vector<float> weights;
  for (int gy = 0; gy < gh; ++gy) {
    const Tap ty = tap(height, gh, gy);
    for (int gx = 0; gx < gw; ++gx) {
      const Tap tx = tap(width, gw, gx);
      weights.push_back(ty.l0 * (tx.l0 * bit(ty.i0, tx.i0) + tx.l1 * bit(ty.i0, tx.i1)) +
                        ty.l1 * (tx.l0 * bit(ty.i1, tx.i0) + tx.l1 * bit(ty.i1, tx.i1)));
    }
  }
  return weights;
}

int flux2::inpaint_first_step(int steps, double strength) {
  const double run = std::min(double(steps) * strength, double(steps));
  return int(std::max(double(steps) - run, 0.0));
}

Tensor flux2::text_position_ids(int64_t tokens) {
  Tensor ids = Tensor::heap({tokens, 4}, DType::i64);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t a = 0; a < 4; ++a) ids.ptr<int64_t>()[4 * i + a] = a == 3 ? i : 0;
  return ids;
}

Tensor flux2::image_position_ids(int64_t h, int64_t w) { return image_and_reference_position_ids(h, w, {}); }

Tensor flux2::image_and_reference_position_ids(int64_t h, int64_t w,
                                               const std::vector<std::pair<int64_t, int64_t>>& references) {
  int64_t n = h * w;
  for (const auto& [rows, cols] : references) n += rows * cols;
  Tensor ids = Tensor::heap({n, 4}, DType::i64);
  int64_t* p = ids.ptr<int64_t>();
  auto grid = [&](int64_t t, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c, p += 4) {
        p[0] = t;
        p[1] = r;
        p[2] = c;
        p[3] = 0;
      }
  };
  grid(0, h, w);
  for (size_t k = 0; k < references.size(); ++k) grid(10 + 10 * int64_t(k), references[k].first, references[k].second);
  return ids;
}

flux2::KleinIndex flux2::check_klein_index(const ModelDir& dir) {
  const std::string index = dir.root() + "/model_index.json";
  KleinIndex k;
  k.reference_cache = dir.pipeline_class() == "Flux2KleinKVPipeline";
  APUS_CHECK(k.reference_cache || dir.pipeline_class() == "Flux2KleinPipeline", index, ": _class_name '",
             dir.pipeline_class(), "' is not supported (this build runs Flux2KleinPipeline and Flux2KleinKVPipeline)");
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
  // Absent, the pipeline's default holds.
  k.distilled = k.reference_cache;
  if (!dir.index().contains("is_distilled")) return k;
  const Json& distilled = dir.index()["is_distilled"];
  APUS_CHECK(distilled.is_boolean(), index, ": is_distilled is ", distilled.dump(), ", expected true or false");
  k.distilled = distilled.get<bool>();
  return k;
}

}  // namespace apus
