// Stable Audio 3 text-to-audio: tokenise, encode, condition, sample, decode, in the order and
// precision of the official generate(): the canvas with 6 s of headroom, its padding, the log-SNR
// schedule, ping-pong (the distilled models) or Euler (the -base ones) with the official guidance
// when cfg is not 1, torch's CPU generator drawing every noise in the official order, the SAME
// decode (chunked, with its inference noise, as the config says), clamp and truncation. The
// stages are written once; generate() runs them on weights, count() walks them in counting mode.
//
// Precision: the official CPU run is fp32 throughout. bf16 runs the text encoder, DiT and decoder
// in bf16 and keeps what the official sampler holds (latents, noise, the update) in fp32, so a
// seed draws the same noise in both.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>

#include "core/error.h"
#include "models/sa3/dit.h"
#include "models/sa3/duration_embedder.h"
#include "models/sa3/model_config.h"
#include "models/sa3/same_decoder.h"
#include "models/sa3/same_encoder.h"
#include "models/sa3/t5gemma_encoder.h"
#include "ops/backend.h"
#include "pipeline/registry.h"
#include "pipeline/stage.h"
#include "sampling/logsnr.h"
#include "sampling/torch_rng.h"
#include "text/sentencepiece_tokenizer.h"
#include "text/utf8.h"

namespace apus {

namespace {

constexpr double kHeadroomSeconds = 6.0;  // generate()'s duration_padding_sec
constexpr int64_t kGenerateSampleSize = 5292032;  // generate()'s sample_size default

// The published configs' sample_size, for diffusers folders (which do not carry it): medium (the
// differential DiT) 16777216 samples (380 s), the small models 5324800 (120.7 s).
constexpr int64_t kMediumSampleSize = 16777216, kSmallSampleSize = 5324800;

// How a directory holds the pipeline: diffusers' StableAudio3Pipeline folders, or the official
// single checkpoint (model_config.json, model.safetensors, the T5Gemma folder beside them).
struct Layout {
  bool official = false;
  std::string root;
  sa3::DitConfig dit;
  sa3::SameConfig same;     // the decoder
  sa3::SameConfig encoder;  // the encoder: audio-to-audio and inpainting
  sa3::DurationConfig duration;
  std::string text_dir, tokenizer_dir;
  int max_tokens = 256;          // the T5Gemma conditioner's max_length
  std::string max_tokens_key = "the pipeline's prompt length";  // where max_tokens comes from
  int64_t sample_size = 0;       // the longest canvas, in samples
  int64_t encoder_chunk = 32;    // the SAME encoder's chunk_size: canvases align to it
  bool euler = false;            // rectified_flow (-base): Euler; rf_denoiser: ping-pong
  bool chunked_decode = false;   // the official pretransform's `chunked`
  float mask_noise = 0;          // the decoder's inference noise (official configs only)
  float encoder_mask_noise = 0;  // the encoder's (refused: the published encoders draw none)
  bool bottleneck_noise = false;
};

constexpr const char* kTextStage = "text_encoder";
constexpr const char* kEncodeStage = "same_encode";
constexpr const char* kPrologueStage = "dit_prologue";
constexpr const char* kStepStage = "dit_step";
constexpr const char* kDecodeStage = "same_decode";

// The latent canvas of a request, as the official _adapt_sample_size and padding mask size it.
struct Canvas {
  int64_t frames = 0;  // latents sampled: (d + 6) s rounded up to whole latents, then to the
                       // encoder's chunk alignment, capped (generate()'s or the config's cap)
  int64_t valid = 0;   // latents the padding mask keeps: ceil(d) + 6 s of headroom, capped
  int64_t samples = 0; // int(d * rate): the output's length
};

struct Work {
  int64_t batch = 1;
  int tokens = 256;
  bool guided = false;    // classifier-free guidance: the DiT runs the batch twice
  bool negative = false;  // ... the second half from negative prompts (ids and text hold 2B)
  float cfg = 1, apg = 1;
  Canvas canvas;
  std::vector<int32_t> ids;
  std::vector<int64_t> mask;
  std::vector<float> seconds;
  std::vector<float> sigmas;
  std::vector<TorchGenerator> generators;  // one per sample, as each request alone would draw
  Tensor text, duration, latents, noise, velocity, guided_velocity, audio;
  // Audio-to-audio and inpainting: each sample's clip [B, C, frames x 4096] (fp32) and its
  // latents; inpainting's per-latent mask (1: kept from the clip).
  bool init = false, inpaint = false;
  double init_level = 1;
  Tensor clips, clip_latents;
  std::vector<float> keep;
  std::optional<sa3::DitPrologue> prologue;
};

class Sa3Model final : public AudioModel {
 public:
  // device: the backend the models' weights and each request's activations live on; null: the CPU.
  Sa3Model(Layout layout, Weights weights, Backend* device);
  std::vector<AudioResult> generate_batch(const std::vector<AudioRequest>& requests,
                                          const Progress& progress) const override;
  PipelineCost count(const AudioRequest& request, int batch) const override;
  double max_seconds() const override {
    return double(layout_.sample_size) / double(layout_.same.sample_rate);
  }
  const std::string& label() const override { return label_; }
  const std::string& sampler() const override { return sampler_; }

 private:
  Work plan(const AudioRequest& r, int64_t batch) const;
  void encode_text(Context& c, const sa3::T5GemmaEncoder& encoder, Work& w) const;
  // The requests' init or inpaint clips for the encoder: [B, C, frames x samples_per_latent] fp32.
  Tensor prepare_clips(Context& c, const std::vector<AudioRequest>& requests, const Work& w) const;
  void encode_clips(Context& c, const sa3::SameEncoder& encoder, Work& w, bool chunked) const;
  void condition(Context& c, const sa3::DurationEmbedder& duration, const sa3::Dit& dit, Work& w) const;
  void step(Context& c, const sa3::Dit& dit, Work& w, int i) const;
  void decode(Context& c, const sa3::SameDecoder& same, Work& w, bool chunked) const;
  // Fills w.noise [B*T, C] (fp32) with each sample's next draw of C x T values, channel-major as
  // torch.randn([1, C, T]) lays them out.
  void draw_noise(Context& c, Work& w, Tensor& out) const;
  DType compute(const AudioRequest& r) const { return r.fp32 ? DType::f32 : DType::bf16; }
  // Each stage's model from whichever layout the directory has; load false: shapes only.
  WeightSet checkpoint(bool load) const;
  sa3::T5GemmaEncoder load_text(bool load = true) const;
  sa3::DurationEmbedder load_duration(bool load = true) const;
  sa3::Dit load_dit(DType dt, bool load = true) const;
  sa3::SameDecoder load_same(DType dt, bool load = true) const;
  sa3::SameEncoder load_encoder(DType dt, bool load = true) const;

  Layout layout_;
  Weights weights_;
  Backend* device_;
  std::string label_, sampler_;
  const sa3::DitConfig& dit_cfg_ = layout_.dit;
  const sa3::SameConfig& same_cfg_ = layout_.same;
  sa3::T5GemmaConfig text_cfg_;
  std::optional<SentencePieceTokenizer> tokenizer_;
  PaddingSide padding_side_ = PaddingSide::left;
  bool add_bos_ = true, add_eos_ = false;
  std::optional<sa3::T5GemmaEncoder> text_;
  std::optional<sa3::DurationEmbedder> duration_;
  std::optional<sa3::Dit> dit_;
  std::optional<sa3::SameDecoder> same_;
  std::optional<sa3::SameEncoder> encoder_;
  DType resident_dtype_ = DType::bf16;
};

void check_sa3_index(const ModelDir& dir) {
  const std::string index = dir.root() + "/model_index.json";
  const std::pair<const char*, const char*> components[] = {
      {"transformer", "StableAudio3DiTModel"},       {"vae", "AutoencoderSAME"},
      {"text_encoder", "T5GemmaEncoderModel"},       {"duration_embedder", "StableAudio3DurationEmbedder"},
      {"scheduler", "FlowMatchEulerDiscreteScheduler"}};
  for (const auto& [name, cls] : components)
    APUS_CHECK(dir.component_class(name) == cls, index, ": ", name, " class '",
               dir.component_class(name), "' is not supported (expected ", cls, ")");
  const std::string tok = dir.component_class("tokenizer");
  APUS_CHECK(tok == "GemmaTokenizer" || tok == "GemmaTokenizerFast", index, ": tokenizer class '",
             tok, "' is not supported (expected GemmaTokenizer)");
}


Layout diffusers_layout(const ModelDir& dir) {
  check_sa3_index(dir);
  const Config scheduler = dir.config("scheduler", "scheduler_config.json");
  Layout l;
  l.euler = sa3_scheduler_is_euler(scheduler);
  l.root = dir.root();
  l.dit = sa3::DitConfig::read(dir.config("transformer"));
  l.same = sa3::SameConfig::read(dir.config("vae"));
  l.encoder = sa3::SameConfig::read(dir.config("vae"), /*encoder=*/true);
  l.duration = sa3::DurationConfig::read(dir.config("duration_embedder"));
  l.text_dir = dir.component("text_encoder");
  l.tokenizer_dir = dir.component("tokenizer");
  l.sample_size = l.dit.differential ? kMediumSampleSize : kSmallSampleSize;
  return l;
}

Layout official_layout(const std::string& root) {
  const sa3::OfficialConfig o = sa3::read_official_config(root + "/model_config.json");
  Layout l;
  l.official = true;
  l.root = root;
  l.dit = o.dit;
  l.same = o.same;
  l.encoder = o.encoder;
  l.encoder_mask_noise = o.encoder_mask_noise;
  l.duration = o.duration;
  l.text_dir = root + "/" + o.text_encoder_folder;
  l.tokenizer_dir = l.text_dir;
  APUS_CHECK(is_directory(l.text_dir), l.text_dir, ": missing; the T5Gemma encoder and tokenizer ",
             "folder model_config.json names (its 'subfolder')");
  l.max_tokens = o.max_tokens;
  l.max_tokens_key = o.max_tokens_key;
  l.sample_size = o.sample_size;
  l.encoder_chunk = o.encoder_chunk;
  l.chunked_decode = o.chunked_decode;
  l.euler = o.euler;
  l.mask_noise = o.mask_noise;
  l.bottleneck_noise = o.bottleneck_noise;
  return l;
}

WeightSet Sa3Model::checkpoint(bool load) const {
  return load ? WeightSet::open_dir(layout_.root, device_) : WeightSet::shapes_only();
}

sa3::T5GemmaEncoder Sa3Model::load_text(bool load) const {
  return sa3::T5GemmaEncoder::load(layout_.text_dir, load, device_);
}

sa3::DurationEmbedder Sa3Model::load_duration(bool load) const {
  if (!layout_.official) return sa3::DurationEmbedder::load(layout_.root + "/duration_embedder", load, device_);
  return sa3::DurationEmbedder::load_official(layout_.duration, sa3::ParamSource::official_duration(checkpoint(load)));
}

sa3::Dit Sa3Model::load_dit(DType dt, bool load) const {
  if (!layout_.official) return sa3::Dit::load(layout_.root + "/transformer", dt, load, device_);
  return sa3::Dit::load(layout_.dit, sa3::ParamSource::official_dit(checkpoint(load)), dt);
}

sa3::SameDecoder Sa3Model::load_same(DType dt, bool load) const {
  if (!layout_.official) return sa3::SameDecoder::load(layout_.root + "/vae", dt, load, device_);
  return sa3::SameDecoder::load(layout_.same, sa3::ParamSource::official_same(checkpoint(load), "pretransform.model."), dt);
}

sa3::SameEncoder Sa3Model::load_encoder(DType dt, bool load) const {
  if (!layout_.official) return sa3::SameEncoder::load(layout_.root + "/vae", dt, load, device_);
  return sa3::SameEncoder::load(layout_.encoder, sa3::ParamSource::official_same(checkpoint(load), "pretransform.model."), dt);
}

Sa3Model::Sa3Model(Layout layout, Weights weights, Backend* device)
    : layout_(std::move(layout)),
      weights_(weights),
      device_(device),
      label_(model_label(layout_.root)),
      sampler_(layout_.euler ? "Euler (rectified_flow)" : "ping-pong (rf_denoiser)") {
  text_cfg_ = sa3::T5GemmaConfig::read(read_config(layout_.text_dir + "/config.json"));
  // Every prompt is padded to max_tokens, and the encoder runs a sliding layer only where the whole
  // sequence fits its window.
  const bool slides = std::find(text_cfg_.sliding.begin(), text_cfg_.sliding.end(), true) != text_cfg_.sliding.end();
  APUS_CHECK(!slides || layout_.max_tokens <= text_cfg_.sliding_window, layout_.max_tokens_key, " is ",
             layout_.max_tokens, ", expected 1..", text_cfg_.sliding_window, " (the sliding window of ",
             layout_.text_dir, "/config.json; longer prompts are not supported)");
  const std::string where = layout_.root + (layout_.official ? "/model_config.json" : "/model_index.json");
  APUS_CHECK(text_cfg_.hidden == dit_cfg_.cond_dim && layout_.duration.output_dim == dit_cfg_.cond_dim &&
                 layout_.duration.output_dim == dit_cfg_.global_dim,
             where, ": the text encoder (", text_cfg_.hidden, "), duration embedder (",
             layout_.duration.output_dim, ") and transformer (cond_token_dim ", dit_cfg_.cond_dim,
             ", global_cond_dim ", dit_cfg_.global_dim, ") widths do not agree");
  APUS_CHECK(same_cfg_.latent_dim == dit_cfg_.io_channels && dit_cfg_.local_dim == dit_cfg_.io_channels + 1,
             where, ": the transformer's io_channels ", dit_cfg_.io_channels, " / local_add_cond_dim ",
             dit_cfg_.local_dim, " do not fit the decoder's latent_dim ", same_cfg_.latent_dim);
  if (weights_ == Weights::none) return;
  const std::string& tok_dir = layout_.tokenizer_dir;
  APUS_CHECK(path_exists(tok_dir + "/tokenizer.model"), tok_dir,
             "/tokenizer.model: missing; apus reads Gemma's SentencePiece model (transformers' ",
             "save_pretrained writes only tokenizer.json: copy tokenizer.model from the ",
             "t5gemma-b-b-ul2 folder of the published checkpoint)");
  tokenizer_.emplace(SentencePieceTokenizer::load(tok_dir + "/tokenizer.model"));
  APUS_CHECK(tokenizer_->vocab_size() <= text_cfg_.vocab, tok_dir, "/tokenizer.model: ",
             tokenizer_->vocab_size(), " pieces, more than the text encoder's ", text_cfg_.vocab,
             "-entry embedding (config.json vocab_size)");
  const std::string tok_config = tok_dir + "/tokenizer_config.json";
  if (path_exists(tok_config)) {
    padding_side_ = read_padding_side(tok_config);
    const Config tc = read_config(tok_config);
    add_bos_ = tc.get_bool("add_bos_token", true);  // GemmaTokenizer's defaults
    add_eos_ = tc.get_bool("add_eos_token", false);
  }
  if (weights_ == Weights::resident) {
    // A server's model serves one precision: bf16, the fast path.
    text_.emplace(load_text());
    duration_.emplace(load_duration());
    dit_.emplace(load_dit(resident_dtype_));
    same_.emplace(load_same(resident_dtype_));
    encoder_.emplace(load_encoder(resident_dtype_));
    text_->make_resident();
  }
}

Work Sa3Model::plan(const AudioRequest& r, int64_t batch) const {
  const double limit = max_seconds();
  const int64_t rate = same_cfg_.sample_rate, spl = same_cfg_.samples_per_latent();
  // The output holds int(seconds x rate) frames, as the official code cuts it: at least one.
  APUS_CHECK_FIELD(std::isfinite(r.seconds) && int64_t(r.seconds * double(rate)) >= 1 && r.seconds <= limit, "seconds",
                   "seconds ", r.seconds, " outside [", 1.0 / double(rate), ", ", limit, "] (one output frame at ", rate,
                   " Hz .. this model's sample_size)");
  APUS_CHECK_FIELD(r.steps >= 1 && r.steps <= AudioLimits::max_steps, "steps", "steps ", r.steps, " outside 1..",
                   AudioLimits::max_steps);
  check_batch(batch, AudioLimits::max_batch);
  const int64_t align = std::max<int64_t>(1, layout_.encoder_chunk / same_cfg_.stride);
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  Work w;
  w.batch = batch;
  const int64_t padded = int64_t((r.seconds + kHeadroomSeconds) * double(rate));
  w.canvas.samples = int64_t(r.seconds * double(rate));
  // The official generate() caps the canvas at its sample_size argument, 5292032 samples by
  // default (the config's larger value reaches it only through the official UI): clips up to that
  // length get generate()'s canvas; longer ones (medium, to 380 s) the config's.
  const int64_t cap = w.canvas.samples <= kGenerateSampleSize ? std::min(kGenerateSampleSize, layout_.sample_size)
                                                              : layout_.sample_size;
  w.canvas.frames = std::min(ceil_div(ceil_div(padded, spl), align) * align, cap / spl);
  w.canvas.valid = std::min(ceil_div(w.canvas.samples, spl) + int64_t(kHeadroomSeconds * double(rate)) / spl,
                            w.canvas.frames);
  w.init = r.init_audio.has_value();
  w.inpaint = r.inpaint_audio.has_value();
  APUS_CHECK_FIELD(w.init || !r.init_noise_level, "init_noise_level", "init_noise_level ", r.init_noise_level.value_or(0),
                   " is for audio-to-audio: it needs an init audio clip");
  w.init_level = w.init ? r.init_noise_level.value_or(kDefaultInitNoiseLevel) : 1.0;
  APUS_CHECK_FIELD(std::isfinite(w.init_level) && w.init_level > 0 && w.init_level <= 1, "init_noise_level",
                   "init_noise_level ", w.init_level, " outside (0, 1]");
  APUS_CHECK_FIELD(w.inpaint || r.inpaint_regions.empty(), "inpaint_regions", "inpaint regions need an inpaint clip");
  APUS_CHECK_FIELD(!w.inpaint || !r.inpaint_regions.empty(), "inpaint_regions",
                   "an inpaint clip needs at least one region to generate (inpaint start and end)");
  for (const auto& [start, end] : r.inpaint_regions)
    APUS_CHECK_FIELD(std::isfinite(start) && std::isfinite(end) && start >= 0 && end > start && end <= r.seconds,
                     "inpaint_regions", "inpaint region ", start, " .. ", end, " s is not a span inside the ", r.seconds,
                     " s clip");
  APUS_CHECK(!(w.init || w.inpaint) || layout_.encoder_mask_noise == 0, layout_.root,
             "/model_config.json: the encoder's 'mask_noise' ", layout_.encoder_mask_noise,
             " is not supported (audio-to-audio and inpainting encode without noise)");
  // The official ones mask by latent: the region's samples [int(start * rate), int(end * rate))
  // and everything past int(seconds * rate) are generated; each latent takes its first sample's.
  if (w.inpaint) {
    w.keep.assign(size_t(w.canvas.frames), 1.0f);
    for (int64_t i = 0; i < w.canvas.frames; ++i) {
      const int64_t sample = i * spl;
      bool generated = sample >= w.canvas.samples;
      for (const auto& [start, end] : r.inpaint_regions)
        generated = generated || (sample >= int64_t(start * double(rate)) && sample < int64_t(end * double(rate)));
      if (generated) w.keep[size_t(i)] = 0.0f;
    }
  }
  w.sigmas = logsnr_sigmas(r.steps, float(w.init_level));
  w.tokens = layout_.max_tokens;
  APUS_CHECK_FIELD(std::isfinite(r.cfg) && r.cfg > 0 && r.cfg <= 100, "cfg", "cfg ", r.cfg, " outside (0, 100]");
  APUS_CHECK_FIELD(std::isfinite(r.apg) && r.apg >= 0 && r.apg <= 1, "apg", "apg ", r.apg, " outside [0, 1]");
  // The official DiT guides whenever cfg is not 1, whatever the sampler.
  w.guided = r.cfg != 1;
  w.negative = w.guided && r.negative_prompt.has_value();
  APUS_CHECK_FIELD(w.guided || !r.negative_prompt, "negative_prompt", "a negative prompt needs guidance (cfg other than 1)");
  w.cfg = r.cfg;
  w.apg = r.apg;
  return w;
}

void Sa3Model::encode_text(Context& c, const sa3::T5GemmaEncoder& encoder, Work& w) const {
  w.text = encoder.encode(c, w.ids, w.mask, w.negative ? 2 * w.batch : w.batch);
}

Tensor Sa3Model::prepare_clips(Context& c, const std::vector<AudioRequest>& requests, const Work& w) const {
  const int64_t ch = same_cfg_.audio_channels, length = w.canvas.frames * same_cfg_.samples_per_latent();
  if (c.count_only) return Tensor::shape_only({w.batch, ch, length}, DType::f32);
  Tensor clips = Tensor::heap({w.batch, ch, length}, DType::f32);
  for (int64_t b = 0; b < w.batch; ++b) {
    const AudioRequest& r = requests[size_t(b)];
    const AudioClip& clip = w.init ? *r.init_audio : *r.inpaint_audio;
    sa3::prepare_clip(clip, w.init ? "init audio" : "inpaint audio", same_cfg_.sample_rate, ch, length,
                      clips.ptr<float>() + b * ch * length);
  }
  return ops::to_context(c, clips);
}

void Sa3Model::encode_clips(Context& c, const sa3::SameEncoder& encoder, Work& w, bool chunked) const {
  w.clip_latents = encoder.encode(c, w.clips, chunked);
}

void Sa3Model::condition(Context& c, const sa3::DurationEmbedder& duration, const sa3::Dit& dit,
                         Work& w) const {
  CostScope scope(c, "conditioning");
  ArenaScope arena(*c.arena);
  const int64_t b = w.batch, text = w.tokens, tokens = text + 1, d = dit_cfg_.cond_dim, t = w.canvas.frames;
  const int64_t samples = w.guided ? 2 * b : b;
  w.duration = duration.embed(c, w.seconds);
  // Cross tokens per sample: the text (padding replaced in the DiT's prologue), then the duration.
  // Guided, the unconditional half follows: all zeros (the duration token too), or the negative
  // prompt's tokens with its padding zeroed and the duration token kept, as the official DiT
  // builds it; nothing there is replaced by the padding embedding.
  Tensor cross = ops::zeros(c, {samples * tokens, d}, c.act);
  std::vector<int64_t> valid(size_t(samples * tokens), 1);
  for (int64_t s = 0; s < b; ++s) {
    Tensor text_rows = cross.rows(s * tokens, s * tokens + text);
    ops::copy(c, w.text.rows(s * text, (s + 1) * text), text_rows);
    Tensor last = cross.rows(s * tokens + text, (s + 1) * tokens);
    ops::copy(c, w.duration.rows(s, s + 1), last);
    std::copy(w.mask.begin() + s * text, w.mask.begin() + (s + 1) * text, valid.begin() + s * tokens);
    if (!w.negative) continue;
    // The negative prompt's valid tokens, zeros for its padding: a gather from its rows with a
    // zero row appended (the same ops whatever the mask).
    const int64_t u = b + s;
    Tensor table = ops::zeros(c, {text + 1, d}, c.act);
    Tensor table_text = table.rows(0, text);
    ops::copy(c, w.text.rows(u * text, (u + 1) * text), table_text);
    const Tensor ids = ops::host_filled(c, {text}, DType::i32, [&](Tensor& t) {
      for (int64_t p = 0; p < text; ++p) t.ptr<int32_t>()[p] = int32_t(w.mask[size_t(u * text + p)] ? p : text);
    });
    Tensor neg_text = cross.rows(u * tokens, u * tokens + text);
    ops::embedding(c, table, ids, neg_text);
    Tensor neg_last = cross.rows(u * tokens + text, (u + 1) * tokens);
    ops::copy(c, w.duration.rows(s, s + 1), neg_last);
  }
  Tensor global = Tensor::in(*c.arena, {samples, d}, c.act);
  for (int64_t half = 0; half < samples / b; ++half) {
    Tensor rows = global.rows(half * b, (half + 1) * b);
    ops::copy(c, w.duration, rows);
  }
  // Inpainting: per latent the mask (1: kept), then the clip's latents where kept, for both
  // halves of a guided batch; text-to-audio passes zeros, as the official code does.
  Tensor local = ops::zeros(c, {samples * t, dit_cfg_.local_dim}, c.act);
  if (w.inpaint) {
    // The clip's latents where kept: blended into the zeros with the mask as weight (0 or 1, exact).
    const Tensor keep = ops::host_filled(c, {t}, DType::f32, [&](Tensor& m) {
      std::copy(w.keep.begin(), w.keep.end(), m.ptr<float>());
    });
    for (int64_t s = 0; s < samples; ++s) {
      Tensor rows = local.rows(s * t, (s + 1) * t);
      Tensor mask_col = rows.cols(0, 1), latents = rows.cols(1, dit_cfg_.local_dim);
      ops::copy(c, keep.reshape({t, 1}), mask_col);
      ops::blend(c, latents, w.clip_latents.rows((s % b) * t, (s % b + 1) * t), keep, latents);
    }
  }
  w.prologue = dit.prologue(c, cross, valid, global, local, w.canvas.valid);
  w.velocity = ops::empty(c, {samples * t, dit_cfg_.io_channels}, c.act);
  if (w.guided) w.guided_velocity = ops::empty(c, {b * t, dit_cfg_.io_channels}, DType::f32);
}

void Sa3Model::draw_noise(Context& c, Work& w, Tensor& out) const {
  const int64_t ch = dit_cfg_.io_channels, t = w.canvas.frames;
  // Counted too: the draw is host work, the transpose into the rows an op.
  for (int64_t s = 0; s < w.batch; ++s) {
    const Tensor planes = ops::host_filled(c, {ch, t}, DType::f32, [&](Tensor& p) {
      w.generators[size_t(s)].randn(p.ptr<float>(), p.numel());
    });
    Tensor rows = out.rows(s * t, (s + 1) * t);
    ops::transpose(c, planes, rows);
  }
}

void Sa3Model::step(Context& c, const sa3::Dit& dit, Work& w, int i) const {
  const float t = w.sigmas[size_t(i)], t_next = w.sigmas[size_t(i) + 1];
  ArenaScope arena(*c.arena);
  const int64_t rows = w.latents.shape[0];
  Tensor x = w.latents;
  if (c.act != DType::f32 || w.guided) {
    // Guided, the batch runs twice: conditional rows, then unconditional.
    x = Tensor::in(*c.arena, {(w.guided ? 2 : 1) * rows, w.latents.shape[1]}, c.act);
    for (int64_t half = 0; half < x.shape[0] / rows; ++half) {
      Tensor part = x.rows(half * rows, (half + 1) * rows);
      ops::copy(c, w.latents, part);
    }
  }
  dit.forward(c, *w.prologue, x, t, w.velocity);
  CostScope scope(c, "sampler");
  Tensor v = w.velocity;
  if (w.guided) {
    ops::guided_velocity(c, w.latents, w.velocity.rows(0, rows), w.velocity.rows(rows, 2 * rows),
                         w.guided_velocity, t, w.cfg, w.apg, w.batch, w.canvas.valid);
    v = w.guided_velocity;
  }
  if (layout_.euler) {
    ops::euler_update(c, w.latents, v, t_next - t);
    return;
  }
  // The official loop draws the next noise even on the last step, where t_next = 0 discards it.
  draw_noise(c, w, w.noise);
  ops::pingpong_update(c, w.latents, v, w.noise, t, t_next);
}

void Sa3Model::decode(Context& c, const sa3::SameDecoder& same, Work& w, bool chunked) const {
  ArenaScope arena(*c.arena);
  Tensor z = w.latents;
  if (c.act != DType::f32) {
    z = Tensor::in(*c.arena, w.latents.shape, c.act);
    ops::copy(c, w.latents, z);
  }
  // The official decode's noise continues each sample's generator after the sampler's draws.
  const sa3::DecodeNoise noise{layout_.bottleneck_noise, layout_.mask_noise, &w.generators};
  w.audio = same.decode(c, z, w.batch, chunked, noise);
}

PipelineCost Sa3Model::count(const AudioRequest& r, int batch) const {
  Work w = plan(r, batch);
  PipelineCost p;
  p.model = label_;
  p.seconds = r.seconds;
  p.steps = r.steps;
  p.cfg = w.guided ? r.cfg : 1.0;
  const int prompts = (w.negative ? 2 : 1) * batch;
  w.ids.assign(size_t(prompts * w.tokens), 0);
  w.mask.assign(size_t(prompts * w.tokens), 1);
  w.seconds.assign(size_t(batch), float(r.seconds));
  w.generators.assign(size_t(batch), TorchGenerator(0));  // counting draws nothing
  const int64_t rows = batch * w.canvas.frames;
  w.latents = Tensor::shape_only({rows, dit_cfg_.io_channels}, DType::f32);
  w.noise = Tensor::shape_only({rows, dit_cfg_.io_channels}, DType::f32);
  const auto text = load_text(false);
  const auto duration = load_duration(false);
  const auto dit = load_dit(DType::bf16, false);
  const auto same = load_same(DType::bf16, false);
  StageCost text_stage = count_stage(kTextStage, 1, [&](Context& c) { encode_text(c, text, w); });
  std::optional<StageCost> encode_stage;
  if (w.init || w.inpaint) {
    const auto encoder = load_encoder(DType::bf16, false);
    encode_stage = count_stage(kEncodeStage, 1, [&](Context& c) {
      w.clips = prepare_clips(c, {}, w);
      encode_clips(c, encoder, w, layout_.chunked_decode);
    });
    p.parameters += double(encoder.parameter_count());
  }
  StageCost prologue_stage = count_stage(kPrologueStage, 1, [&](Context& c) { condition(c, duration, dit, w); });
  StageCost step_stage = count_stage(kStepStage, r.steps, [&](Context& c) { step(c, dit, w, 0); });
  StageCost decode_stage = count_stage(kDecodeStage, 1, [&](Context& c) {
    decode(c, same, w, r.chunked_decode.value_or(layout_.chunked_decode));
  });
  p.parameters += double(text.parameter_count() + duration.parameter_count() + dit.parameter_count() +
                        same.parameter_count());
  p.stages = {text_stage, prologue_stage, step_stage, decode_stage};
  if (encode_stage) p.stages.insert(p.stages.begin() + 1, *encode_stage);
  return p;
}

std::vector<AudioResult> Sa3Model::generate_batch(const std::vector<AudioRequest>& requests,
                                                  const Progress& progress) const {
  APUS_CHECK(weights_ != Weights::none, layout_.root, ": opened for counting only");
  APUS_CHECK(!requests.empty(), "no request to render");
  const AudioRequest& r = requests.front();
  const int64_t batch = int64_t(requests.size());
  Work w = plan(r, batch);  // the first request's settings checked before the others are held to them
  for (const AudioRequest& o : requests)
    APUS_CHECK(o.seconds == r.seconds && o.steps == r.steps && o.fp32 == r.fp32 &&
                   o.chunked_decode == r.chunked_decode && o.cfg == r.cfg && o.apg == r.apg &&
                   o.negative_prompt.has_value() == r.negative_prompt.has_value() &&
                   o.init_audio.has_value() == r.init_audio.has_value() && o.init_noise_level == r.init_noise_level &&
                   o.inpaint_audio.has_value() == r.inpaint_audio.has_value() && o.inpaint_regions == r.inpaint_regions,
               "a batch shares seconds, steps, precision, guidance and its audio inputs' settings: ", o.seconds,
               " s, ", o.steps, " steps differs from ", r.seconds, " s, ", r.steps, " steps");
  APUS_CHECK(weights_ != Weights::resident || compute(r) == resident_dtype_,
             "this resident model serves bf16 requests only");
  check_memory(count(r, int(batch)), weights_ == Weights::resident,
               std::to_string(r.seconds) + " s" + (batch > 1 ? " x" + std::to_string(batch) : ""), device_);
  auto say = [&](const std::string& s) { if (progress) progress(s); };
  std::vector<AudioResult> results(requests.size());
  std::vector<StageTime> stages;
  const std::unique_ptr<Trace> trace = trace_if_asked(requests);
  StageClock clock(stages, trace.get());
  // On a device activations live in its memory.
  Arena arena(size_t(64) << 20, false, device_ ? static_cast<Allocator&>(*device_) : host_allocator());
  const DType dt = compute(r);
  Context ctx{&arena, dt};
  ctx.backend = device_;
  ctx.trace = trace.get();

  // Everything that can reject the request comes before any weight loads. The prompts, then (for
  // guidance by negative prompts) the negative prompts, one batch through the text encoder.
  auto tokenize = [&](const std::string& text, const char* what) {
    require_utf8(text, std::string("the ") + what);
    std::vector<int32_t> ids = tokenizer_->encode(text);
    // The official conditioner calls the tokenizer with its special tokens on: the config decides.
    if (add_bos_) ids.insert(ids.begin(), tokenizer_->bos_id());
    if (add_eos_) ids.push_back(tokenizer_->eos_id());
    const int n = int(ids.size());
    PaddedIds padded = pad_ids(std::move(ids), w.tokens, tokenizer_->pad_id(), padding_side_);
    if (padded.truncated)
      say(std::string(what) + " truncated to " + std::to_string(w.tokens) + " tokens (it has " +
          std::to_string(n) + "), as the official conditioner truncates");
    w.ids.insert(w.ids.end(), padded.ids.begin(), padded.ids.end());
    w.mask.insert(w.mask.end(), padded.mask.begin(), padded.mask.end());
    return n;
  };
  for (size_t i = 0; i < requests.size(); ++i) results[i].prompt_tokens = tokenize(requests[i].prompt, "prompt");
  if (w.negative)
    for (const AudioRequest& o : requests) tokenize(*o.negative_prompt, "negative prompt");
  for (size_t i = 0; i < requests.size(); ++i) {
    const AudioRequest& o = requests[i];
    w.seconds.push_back(float(o.seconds));
    results[i].seed = o.seed ? *o.seed : std::random_device{}();
    w.generators.emplace_back(results[i].seed);
    say("seed " + std::to_string(results[i].seed));
  }
  clock.stop("tokenize");
  // The initial latents are the generator's first draw, fp32 as torch.randn([1, C, T]).
  w.latents = ops::empty(ctx, {batch * w.canvas.frames, dit_cfg_.io_channels}, DType::f32);
  w.noise = ops::empty(ctx, w.latents.shape, DType::f32);
  draw_noise(ctx, w, w.latents);
  // Audio-to-audio and inpainting encode their clips (the official encoder draws no noise).
  if (w.init || w.inpaint) {
    w.clips = prepare_clips(ctx, requests, w);
    with_model(encoder_, [&] { return load_encoder(dt); },
               [&](const sa3::SameEncoder& encoder) {
                 clock.stop("encoder load");
                 run_stage(ctx, kEncodeStage, [&] { encode_clips(ctx, encoder, w, layout_.chunked_decode); });
                 require_finite(ctx, w.clip_latents, "the SAME encoder");
                 clock.stop("encode", kEncodeStage);
               });
  }
  if (w.init) {
    // The official start: init x (1 - level) + noise x level, each product and the sum in fp32.
    // On the host: the scalars are Python floats (1 - level in double), which no op's rounding rule
    // matches; once per request.
    const Tensor clip = ops::to_host(ctx, w.clip_latents);
    const Tensor z = clip.dtype == DType::f32 ? clip : to_dtype(clip, DType::f32);
    Tensor start = ops::to_host(ctx, w.latents);
    const float keep = float(1.0 - w.init_level), level = float(w.init_level);
    float* x = start.ptr<float>();
    const float* init = z.ptr<float>();
    for (int64_t i = 0; i < start.numel(); ++i) x[i] = init[i] * keep + x[i] * level;
    w.latents = ops::to_context(ctx, start);
  }

  // An empty prompt is all padding: every text position takes the learned padding embedding, so
  // the encoder (which would attend to no key) need not run.
  const bool any_text = std::any_of(w.mask.begin(), w.mask.end(), [](int64_t m) { return m != 0; });
  with_model(text_, [&] { return load_text(); },
             [&](const sa3::T5GemmaEncoder& encoder) {
               clock.stop("text encoder load");
               if (any_text) {
                 run_stage(ctx, kTextStage, [&] { encode_text(ctx, encoder, w); });
                 require_finite(ctx, w.text, "the text encoder");
               } else {
                 Tensor none = Tensor::heap({int64_t(w.mask.size()), text_cfg_.hidden}, dt);
                 std::memset(none.data, 0, none.nbytes());
                 w.text = ops::to_context(ctx, none);
               }
               clock.stop("text encoder", kTextStage);
             });
  with_model(dit_, [&] { return load_dit(dt); },
             [&](const sa3::Dit& dit) {
               clock.stop("transformer load");
               with_model(duration_, [&] { return load_duration(); },
                          [&](const sa3::DurationEmbedder& duration) {
                            run_stage(ctx, kPrologueStage, [&] { condition(ctx, duration, dit, w); });
                          });
               clock.stop("conditioning", kPrologueStage);
               for (int i = 0; i < r.steps; ++i)
                 timed_step(ctx, clock, say, i, r.steps, w.sigmas[size_t(i)], w.latents, kStepStage,
                            [&] { run_stage(ctx, kStepStage, [&] { step(ctx, dit, w, i); }); });
             });
  with_model(same_, [&] { return load_same(dt); },
             [&](const sa3::SameDecoder& same) {
               clock.stop("decoder load");
               run_stage(ctx, kDecodeStage,
                         [&] { decode(ctx, same, w, r.chunked_decode.value_or(layout_.chunked_decode)); });
               require_finite(ctx, w.audio, "the SAME decoder");
               clock.stop("decode", kDecodeStage);
             });
  // The official output: fp32, clamped to [-1, 1], the first int(d * rate) samples of each channel
  // (past the padding mask's valid latents it zeroes, which lie beyond that cut).
  const int64_t channels = same_cfg_.audio_channels, length = w.audio.shape[2],
                n = std::min(w.canvas.samples, length);
  const Tensor decoded = ops::to_host(ctx, w.audio);
  const Tensor audio = decoded.dtype == DType::f32 ? decoded : to_dtype(decoded, DType::f32);
  const std::string timeline = trace ? trace->json() : "";
  for (int64_t s = 0; s < batch; ++s) {
    AudioResult& res = results[size_t(s)];
    res.sample_rate = int(same_cfg_.sample_rate);
    res.channels = int(channels);
    res.samples.resize(size_t(n * channels));
    const float* base = audio.ptr<float>() + s * channels * length;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t ch = 0; ch < channels; ++ch)
        res.samples[size_t(i * channels + ch)] = std::clamp(base[ch * length + i], -1.0f, 1.0f);
    res.stages = stages;
    if (requests[size_t(s)].trace) res.trace = timeline;
  }
  return results;
}

}  // namespace

std::unique_ptr<AudioModel> open_sa3(const ModelDir& dir, Weights weights) {
  return std::make_unique<Sa3Model>(diffusers_layout(dir), weights, dir.device());
}

std::unique_ptr<AudioModel> open_sa3_official(const std::string& root, Weights weights, Backend* device) {
  return std::make_unique<Sa3Model>(official_layout(root), weights, device);
}

}  // namespace apus
