#pragma once
// Stable Audio 3 text-to-audio: tokenise, encode, condition, sample, decode, in the order and
// precision of the official generate(): the canvas with 6 s of headroom, its padding, the log-SNR
// schedule, ping-pong (the distilled models) or Euler (the -base ones) with the official guidance
// when cfg is not 1, torch's CPU generator drawing every noise in the official order, the SAME
// decode (chunked, with its inference noise, as the config says), clamp and truncation.
// layout.cpp reads the two layouts and loads their parts; plan.cpp turns a request into a batch's
// plan (every default and bound); stages.cpp holds the stages and the one table (pipeline/driver.h)
// that counting and running both walk.
//
// Precision: the official CPU run is fp32 throughout. bf16 runs the text encoder, DiT and decoder
// in bf16 and keeps what the official sampler holds (latents, noise, the update) in fp32, so a
// seed draws the same noise in both.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "models/sa3/dit.h"
#include "models/sa3/duration_embedder.h"
#include "models/sa3/same_decoder.h"
#include "models/sa3/same_encoder.h"
#include "models/sa3/t5gemma_encoder.h"
#include "ops/adapters.h"
#include "pipeline/driver.h"
#include "pipeline/sa3/lora.h"
#include "pipeline/sa3/model_config.h"
#include "sampling/draws_ahead.h"
#include "sampling/torch_rng.h"
#include "text/bpe_tokenizer.h"
#include "text/sentencepiece_tokenizer.h"

namespace apus {

// How a directory holds the pipeline: diffusers' StableAudio3Pipeline folders, or the official
// single checkpoint (model_config.json, model.safetensors, the T5Gemma folder beside them).
struct Sa3Layout {
  bool official = false;
  std::string root;
  sa3::DitConfig dit;
  sa3::SameConfig same;     // the decoder
  sa3::SameConfig encoder;  // the encoder: audio-to-audio and inpainting
  sa3::DurationConfig duration;
  std::string label;       // what the model is called: model_label(root) unless set
  std::string checkpoint;  // the official layout's weights: `root`, or one file (ComfyUI's repackaging)
  // sa3.cpp's GGUF files, under the official names and T5Gemma's: the weights of `checkpoint` and,
  // where `text_weights` is empty, the text encoder's.
  std::shared_ptr<const WeightSource> gguf;
  std::string text_dir, tokenizer_dir;  // their configs (config.json, tokenizer_config.json)
  std::string text_weights;             // the T5Gemma weights: text_dir, one file, or empty: in `gguf`
  // Gemma's tokenizer (GemmaTokenizer::load): tokenizer_dir/tokenizer.model, or a file given.
  std::string tokenizer_model;
  int max_tokens = 256;                                         // the T5Gemma conditioner's max_length
  std::string max_tokens_key = "the pipeline's prompt length";  // where max_tokens comes from
  int64_t sample_size = 0;                                      // the longest canvas, in samples
  int64_t encoder_chunk = 32;                                   // the SAME encoder's chunk_size: canvases align to it
  bool euler = false;                                           // rectified_flow (-base): Euler; rf_denoiser: ping-pong
  bool chunked_decode = false;                                  // the official pretransform's `chunked`
  float mask_noise = 0;                                         // the decoder's inference noise (official configs only)
  float encoder_mask_noise = 0;  // the encoder's (refused: the published encoders draw none)
  bool bottleneck_noise = false;
  // What the DiT's and T5Gemma's weights, and the SAME decoder's, pass through first (the int8
  // tier, pipeline/registry.h); null: nothing.
  std::shared_ptr<const WeightTransform> linears, decoder_linears;
  // The DiT's and T5Gemma's linears held as each rank's share of their features over these ranks
  // (ModelParts::tensor_ranks: parallel tensor), or null.
  const ProcessGroup* tensor_ranks = nullptr;
};

// T5Gemma's tokenizer: Gemma's SentencePiece model (tokenizer.model, or a safetensors file carrying
// it as a u8 `spiece_model` tensor, ComfyUI's T5Gemma file), or the BPE sa3.cpp's vocabulary GGUF
// holds (HF's conversion of the same model).
class GemmaTokenizer {
 public:
  static GemmaTokenizer load(const std::string& source);
  // Ids without BOS/EOS.
  std::vector<int32_t> encode(std::string_view text) const;
  int32_t pad_id() const { return pad_; }
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  int32_t vocab_size() const { return vocab_; }

 private:
  std::optional<SentencePieceTokenizer> sentencepiece_;
  std::optional<BpeTokenizer> bpe_;
  int32_t pad_ = 0, bos_ = 0, eos_ = 0, vocab_ = 0;
};

Sa3Layout diffusers_layout(const ModelDir& dir);
// The tokenizer a single-file model's parts name: --tokenizer, or the T5Gemma safetensors that
// carries one; false (l unchanged) when they name none.
bool tokenizer_from_parts(const ModelParts& parts, Sa3Layout& l);
Sa3Layout official_layout(const std::string& root);
// --quant on a layout: a quantised tier or q8_0 on the DiT's and T5Gemma's linears
// (io/weights/quant_weights.h), and the int8 tier on SAME's decoder as same_decoder_tier scopes it.
void use_quant(Sa3Layout& l, Quant quant, Backend* device);

class Sa3Model final : public AudioModel {
 public:
  using Request = AudioRequest;
  using Result = AudioResult;

  // The latent canvas of a request, as the official _adapt_sample_size and padding mask size it.
  struct Canvas {
    int64_t frames = 0;   // latents sampled: (d + 6) s rounded up to whole latents, then to the
                          // encoder's chunk alignment, capped (generate()'s or the config's cap)
    int64_t valid = 0;    // latents the padding mask keeps: ceil(d) + 6 s of headroom, capped
    int64_t samples = 0;  // int(d * rate): the output's length
  };

  struct Work {
    int64_t batch = 1;
    Parallelism parallel;  // the request's split over processes
    int tokens = 256;
    bool guided = false;    // classifier-free guidance: the DiT runs the batch twice
    bool negative = false;  // ... the second half from negative prompts (ids and text hold 2B)
    float cfg = 1, apg = 1;
    Canvas canvas;
    std::vector<int32_t> ids;
    std::vector<int64_t> mask;
    std::vector<float> seconds;
    std::vector<float> sigmas;
    std::vector<TorchGenerator> generators;                 // one per sample, as each request alone would draw
    std::vector<std::unique_ptr<DrawsAhead>> decode_draws;  // on a device: each sample's decoder noise
    Tensor text, duration, latents, noise, velocity, guided_velocity, audio;
    // Audio-to-audio and inpainting: each sample's clip [B, C, frames x 4096] (fp32) and its
    // latents; inpainting's per-latent mask (1: kept from the clip).
    bool init = false, inpaint = false;
    double init_level = 1;
    bool chunked = false;  // the decode in the official 128-latent chunks
    Tensor clips, clip_latents;
    std::vector<float> keep;
    std::optional<sa3::DitPrologue> prologue;
    std::shared_ptr<const Adapters> adapters;  // the request's LoRAs, or null
    std::vector<PreviewSink> previews;         // per request, where it asked for them
  };

  // The DiT with the duration conditioner its prologue embeds: one part of the pipeline.
  struct Transformer {
    sa3::Dit dit;
    sa3::DurationEmbedder duration;
    int64_t parameter_count() const { return dit.parameter_count() + duration.parameter_count(); }
    size_t held_bytes() const { return dit.held_bytes() + duration.held_bytes(); }
    void make_resident() const {
      dit.make_resident();
      duration.make_resident();
    }
  };

  // device: the backend the models' weights and each request's activations live on; null: the CPU.
  Sa3Model(Sa3Layout layout, Weights weights, Backend* device);
  std::vector<AudioResult> generate_batch(const std::vector<AudioRequest>& requests, const Progress& progress,
                                          const std::atomic<bool>* stop) const override {
    return generate_batch_of(*this, requests, progress, stop);
  }
  PipelineCost count(const AudioRequest& request, int batch) const override {
    return count_batch(*this, resolved(request), batch);
  }
  double max_seconds() const override { return double(layout_.sample_size) / double(layout_.same.sample_rate); }
  const std::string& label() const override { return label_; }
  const std::string& sampler() const override { return sampler_; }
  double default_seconds() const override { return 30; }
  int default_steps() const override { return 8; }
  float default_cfg() const override { return 1; }

  // The family's side of the driver (pipeline/driver.h).
  Weights weights() const { return weights_; }
  const std::string& root() const { return layout_.root; }
  Backend* device() const { return device_; }
  AudioRequest resolved(const AudioRequest& r) const;
  Work plan(const AudioRequest& r, int64_t batch) const;
  void check_batch_agrees(const std::vector<AudioRequest>& requests) const;
  PipelineCost cost_header(const AudioRequest& r, const Work& w, int batch) const;
  void count_inputs(Work& w, int batch) const;
  std::string describe(const AudioRequest& r) const { return std::to_string(*r.seconds) + " s"; }  // r resolved
  DType compute(const AudioRequest& r) const { return r.fp32 ? DType::f32 : DType::bf16; }
  // The prompts, then (for guidance by negative prompts) the negative prompts, one batch through
  // the text encoder.
  void tokenize(Work& w, const std::vector<AudioRequest>& requests, std::vector<AudioResult>& results,
                const Progress& say) const;
  // The initial latents (each generator's first draw, fp32 as torch.randn([1, C, T])) and the
  // input clips of audio-to-audio and inpainting.
  void initial_noise(Context& c, Work& w, const std::vector<AudioRequest>& requests,
                     std::vector<AudioResult>& results) const;
  const std::vector<std::unique_ptr<Part<Work>>>& parts() const { return parts_; }
  void finish(Context& c, Work& w, const std::vector<AudioRequest>& requests, std::vector<AudioResult>& results) const;

 private:
  std::vector<std::unique_ptr<Part<Work>>> make_parts() const;
  void encode_text(Context& c, const sa3::T5GemmaEncoder& encoder, Work& w) const;
  // The requests' init or inpaint clips for the encoder: [B, C, frames x samples_per_latent] fp32.
  Tensor prepare_clips(Context& c, const std::vector<AudioRequest>& requests, const Work& w) const;
  void encode_clips(Context& c, const sa3::SameEncoder& encoder, Work& w) const;
  // Audio-to-audio's start: the clip's latents mixed with the initial noise.
  void start_from_clip(Context& c, Work& w) const;
  void condition(Context& c, const Transformer& parts, Work& w) const;
  void step(Context& c, const sa3::Dit& dit, Work& w, int i) const;
  void decode(Context& c, const sa3::SameDecoder& same, Work& w) const;
  // Before step i's update: each request's estimate of its clean latents (x - t v) decoded by the
  // resident SAME, as peaks, to the requests that asked.
  void send_previews(Context& c, const Work& w, const Tensor& velocity, int i) const;
  // Fills w.noise [B*T, C] (fp32) with each sample's next draw of C x T values, channel-major as
  // torch.randn([1, C, T]) lays them out.
  void draw_noise(Context& c, Work& w, Tensor& out) const;
  // The weights in `dir`; load false: shapes only. Then each part's model from whichever layout
  // the directory has.
  // A component folder's weights, or one file's.
  std::shared_ptr<const WeightSource> checkpoint(const std::string& path, bool load) const;
  // A loader of `source` through `transform` when there is one (the int8 tier).
  WeightLoader loader(std::shared_ptr<const WeightSource> source,
                      const std::shared_ptr<const WeightTransform>& transform) const;
  sa3::T5GemmaEncoder load_text(bool load = true) const;
  // split false: whole weights whatever the layout's tensor_ranks (the shapes adapters fit).
  Transformer load_transformer(DType dt, bool load = true, bool split = true) const;
  sa3::SameDecoder load_same(DType dt, bool load = true) const;
  sa3::SameEncoder load_encoder(DType dt, bool load = true) const;

  Sa3Layout layout_;
  Weights weights_;
  Backend* device_;
  std::string label_, sampler_;
  const sa3::DitConfig& dit_cfg_ = layout_.dit;
  const sa3::SameConfig& same_cfg_ = layout_.same;
  sa3::T5GemmaConfig text_cfg_;
  std::optional<GemmaTokenizer> tokenizer_;
  PaddingSide padding_side_ = PaddingSide::left;
  bool add_bos_ = true, add_eos_ = false;
  std::optional<sa3::T5GemmaEncoder> text_;
  std::optional<Transformer> dit_;
  std::optional<sa3::SameDecoder> same_;
  std::optional<sa3::SameEncoder> encoder_;
  DType resident_dtype_ = DType::bf16;
  sa3::LoraTargets lora_targets_;  // the weights adapters may change
  std::vector<std::unique_ptr<Part<Work>>> parts_ = make_parts();
};
static_assert(PipelineFamily<Sa3Model>);

// The family's openers (pipeline/sa3/family.cpp picks one). A diffusers folder:
// `tensor_ranks` as Sa3Layout's.
std::unique_ptr<AudioModel> open_sa3(const ModelDir& dir, Weights weights, const ProcessGroup* tensor_ranks);
// Stable Audio 3's official single-checkpoint layout (model_config.json beside model.safetensors).
std::unique_ptr<AudioModel> open_sa3_official(const std::string& root, Weights weights, Backend* device, Quant quant,
                                              const ProcessGroup* tensor_ranks);
// What `--quant int8` makes of SAME's decoder: the int8 tier on its attention projections alone
// (null for any other Quant: q8_0 and fp8 leave the decoder as stored).
std::shared_ptr<const WeightTransform> same_decoder_tier(Quant quant);
// A Stable Audio 3 checkpoint as one file under the official model.safetensors keys (ComfyUI's
// stable_audio_3_*.safetensors), told by this key.
inline constexpr const char* kSa3SingleFileKey = "model.model.transformer.layers.0.self_attn.to_qkv.weight";
// Its configs from --config (an official folder) or the published layout of its shape, T5Gemma
// from --text-encoder, the tokenizer from --tokenizer or the text encoder file's spiece_model.
std::unique_ptr<AudioModel> open_sa3_single_file(const ModelParts& parts, Weights weights, Backend* device);
// sa3.cpp's GGUF files: --model the DiT (general.architecture sa3-dit), the other parts from
// --vae, --text-encoder and --tokenizer or beside it (pipeline/sa3/gguf_layout.cpp).
std::unique_ptr<AudioModel> open_sa3_gguf(const ModelParts& parts, Weights weights, Backend* device);

}  // namespace apus
