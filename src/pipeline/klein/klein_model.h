#pragma once
// FLUX.2 [klein]: tokenise, encode, sample, decode, in the order and precision of diffusers'
// Flux2KleinPipeline (text-to-image, editing with references, guidance for the -base models),
// Flux2KleinInpaintPipeline (inpainting) and Flux2KleinKVPipeline (the reference K/V cache).
// plan.cpp turns a request into a batch's plan (every default and bound); stages.cpp holds the
// stages and the one table (pipeline/driver.h) that counting and running both walk.
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "models/flux2/klein.h"
#include "models/flux2/latent_preview.h"
#include "models/flux2/text_encoder.h"
#include "models/flux2/transformer.h"
#include "models/flux2/vae_decoder.h"
#include "models/flux2/vae_encoder.h"
#include "ops/adapters.h"
#include "pipeline/driver.h"
#include "sampling/flow_match.h"
#include "text/bpe_tokenizer.h"

namespace apus {

class KleinModel final : public ImageModel {
 public:
  using Request = ImageRequest;
  using Result = ImageResult;

  // A reference image as Flux2ImageProcessor leaves it (see resolved() for the resize of
  // references over 1024x1024 pixels): the sides floored to multiples of 16 by a centre crop. An
  // image to inpaint is resized to that size instead, and then taken whole.
  struct Crop {
    int64_t left, top, width, height;
    int64_t tokens() const { return (width / flux2::kTokenPixels) * (height / flux2::kTokenPixels); }
  };

  // What a batch of requests carries from stage to stage (shape-only tensors in counting mode),
  // sample after sample along the rows.
  struct Work {
    int64_t batch = 1;
    // Guided, the transformer runs 2 x batch samples: the prompts', then the negative prompts'.
    bool guided = false;
    int64_t samples = 1;
    float cfg = 1;
    int steps = 0;
    int64_t h = 0, w = 0;      // latent grid
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
    int steps_run = 0;  // the sampler steps run (fewer than planned when finish_steps ended it)
    // Flux2KleinKVPipeline with references: their keys and values, computed once in the prologue,
    // stand in for their tokens at every step.
    bool reference_cache = false;
    std::optional<flux2::ReferenceKv> reference_kv;
    Tensor noise, inpaint_mask;  // [batch * h * w, C] as latents; f32 [batch * h * w]
    FlowSchedule schedule;
    Tensor prompt_embeds, latents, velocity, image;
    std::optional<flux2::TransformerPrologue> prologue;
    // The requests' LoRAs, applied by every transformer linear they adapt.
    std::shared_ptr<const Adapters> adapters;
    std::vector<PreviewSink> previews;  // per request, where it asked for them
    Parallelism parallel;               // the request's split over processes
  };

  // tensor_ranks: the transformer's weights split over them (ModelParts::tensor_ranks), or null.
  KleinModel(const ModelDir& dir, Weights weights, const ProcessGroup* tensor_ranks = nullptr);

  std::vector<ImageResult> generate_batch(const std::vector<ImageRequest>& requests, const Progress& progress,
                                          const std::atomic<bool>* stop) const override {
    return generate_batch_of(*this, requests, progress, stop);
  }
  PipelineCost count(const ImageRequest& request, int batch) const override {
    return count_batch(*this, resolved(request), batch);
  }
  const std::string& label() const override { return label_; }
  const std::string& sampler() const override { return sampler_; }
  // The KV pipeline's own default is 4 steps and it has no guidance.
  int default_steps() const override { return takes_guidance() ? flux2::kBaseSteps : flux2::kDistilledSteps; }
  float default_cfg() const override { return takes_guidance() ? flux2::kBaseGuidance : 1.0f; }
  bool takes_guidance() const override { return !distilled_ && !reference_cache_; }

  // The family's side of the driver (pipeline/driver.h).
  Weights weights() const { return weights_; }
  const std::string& root() const { return dir_.root(); }
  Backend* device() const { return dir_.device(); }
  // The request with the model's defaults in place of its absent settings (width, height, steps
  // and cfg all present afterwards), each checked against ImageLimits and the model.
  ImageRequest resolved(const ImageRequest& r) const;
  Work plan(const ImageRequest& r, int64_t batch) const;  // grid and schedule
  void check_batch_agrees(const std::vector<ImageRequest>& requests) const;
  PipelineCost cost_header(const ImageRequest& r, const Work& w, int batch) const;
  void count_inputs(Work& w, int batch) const;
  std::string describe(const ImageRequest& r) const;
  DType compute(const ImageRequest& r) const { return r.fp32 ? DType::f32 : DType::bf16; }
  void tokenize(Work& w, const std::vector<ImageRequest>& requests, std::vector<ImageResult>& results,
                const Progress& say) const;
  // Each request's initial noise [1, C, h, w] packed to tokens into its rows of w.latents.
  void initial_noise(Context& c, Work& w, const std::vector<ImageRequest>& requests,
                     std::vector<ImageResult>& results) const;
  const std::vector<std::unique_ptr<Part<Work>>>& parts() const { return parts_; }
  void finish(Context& c, Work& w, const std::vector<ImageRequest>& requests, std::vector<ImageResult>& results) const;

 private:
  void resolve_inpainting(ImageRequest& r) const;
  std::vector<std::unique_ptr<Part<Work>>> make_parts() const;
  void encode_text(Context& c, const flux2::TextEncoder& encoder, Work& w) const;
  void encode_references(Context& c, const flux2::VaeEncoder& encoder, Work& w) const;
  void prologue(Context& c, const flux2::Transformer& dit, Work& w) const;
  void step(Context& c, const flux2::Transformer& dit, Work& w, int i) const;
  void decode(Context& c, const flux2::VaeDecoder& vae, Work& w) const;
  // After step i: each request's estimate of its image (latents - sigma_next x velocity) through
  // the preview projection, to the requests that asked.
  void send_previews(Context& c, const Work& w, const Tensor& velocity, int i) const;
  // Each sample's image latents noised to `sigma` into `out` (the scheduler's scale_noise).
  void check_configs_agree(const flux2::TextEncoderConfig& text, const flux2::VaeConfig& vae) const;
  void noised_image(Context& c, const Work& w, float sigma, Tensor& out) const;
  // The directory to load a part from: with weights, or its configs alone (counting).
  const ModelDir& source(Weights weights) const { return weights == Weights::none ? configs_ : dir_; }

  ModelDir dir_;
  ModelDir configs_;  // the same directory without weights: what counting loads
  Weights weights_;
  const ProcessGroup* tensor_ranks_ = nullptr;  // the transformer's weights split over them
  bool distilled_ = true;
  bool reference_cache_ = false;  // Flux2KleinKVPipeline
  std::string label_, sampler_ = "Euler (flow match)";
  std::optional<BpeTokenizer> tokenizer_;
  flux2::TransformerConfig dit_cfg_;
  std::map<std::string, Shape> dit_weights_;  // the transformer's weight shapes, for adapters
  Config scheduler_cfg_;
  std::optional<flux2::TextEncoder> text_;
  std::optional<flux2::Transformer> dit_;
  std::optional<flux2::VaeDecoder> vae_;
  std::optional<flux2::VaeEncoder> vae_encoder_;
  mutable std::once_flag preview_fitted_;
  mutable std::optional<flux2::LatentPreview> preview_;  // fitted from vae_ at the first preview
  std::vector<std::unique_ptr<Part<Work>>> parts_ = make_parts();
};
static_assert(PipelineFamily<KleinModel>);

// A diffusers folder of the family (pipeline/klein/family.cpp opens what else it reads).
std::unique_ptr<ImageModel> open_klein(const ModelDir& dir, Weights weights, const ProcessGroup* tensor_ranks);

}  // namespace apus
