#pragma once
// FLUX.2 VAE decoder (diffusers AutoencoderKLFlux2, decoder half) together with what the
// Flux2KleinPipeline does between the sampler and vae.decode, and the image postprocessing.
#include <vector>

#include "io/model_dir.h"
#include "models/flux2/vae_blocks.h"
#include "ops/ops.h"

namespace apus::flux2 {

struct VaeConfig {
  int64_t latent_channels, in_channels, out_channels, layers_per_block, groups, patch;
  std::vector<int64_t> block_out;          // the decoder's channels, outermost (full resolution) first
  std::vector<int64_t> encoder_block_out;  // the encoder's (block_out_channels), the same way
  bool mid_attention, quant_conv, post_quant_conv;
  double bn_eps;
  // Features of one sampler token: a patch x patch block of latent pixels.
  int64_t packed_channels() const { return patch * patch * latent_channels; }
  // Image pixels per sampler token along each axis (16 for the published model).
  int64_t pixels_per_token() const { return patch << (block_out.size() - 1); }
  static VaeConfig read(const Config& c);
};

class VaeDecoder {
 public:
  static VaeDecoder load(const Config& config, WeightLoader weights);
  const VaeConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  size_t make_resident() const { return weights_.make_resident(); }

  // packed [N*h*w, packed_channels] tokens in row-major grid order, N samples one after another
  // (activation dtype) -> latents [N, latent_channels, patch*h, patch*w]: the batch-norm
  // de-normalisation and the unpatchify the pipeline applies before vae.decode.
  void unpack_latents(Context& c, const Tensor& packed, int64_t h, int64_t w, Tensor& latents) const;
  // packed tokens as above -> image [N, out_channels, h*pixels_per_token, w*pixels_per_token]
  // in the activation dtype, in [-1, 1] before postprocessing. With `ranks` (a split's, every rank
  // holding the same latents) each convolution's output channels are dealt out over them
  // (models/common/feature_split.h); every rank returns the whole image.
  void decode(Context& c, const Tensor& packed, int64_t h, int64_t w, Tensor& image,
              const ProcessGroup* ranks = nullptr) const;

 private:
  struct UpBlock {
    std::vector<vae::Resnet> resnets;
    Tensor up_w, up_b;  // absent in the last block
  };
  explicit VaeDecoder(WeightLoader weights) : weights_(std::move(weights)) {}
  VaeConfig cfg_;
  WeightLoader weights_;
  vae::BatchNormStats stats_f32_, stats_bf16_;
  Tensor post_quant_w_, post_quant_b_, conv_in_w_, conv_in_b_;
  vae::Resnet mid_in_, mid_out_;
  vae::Attention mid_attn_;
  std::vector<UpBlock> up_;
  vae::Norm norm_out_;
  Tensor conv_out_w_, conv_out_b_;

  int64_t max_activation(int64_t lh, int64_t lw) const;
};

}  // namespace apus::flux2
