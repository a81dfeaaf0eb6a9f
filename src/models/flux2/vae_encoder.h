#pragma once
// FLUX.2 VAE encoder (diffusers AutoencoderKLFlux2, encoder half) together with what
// Flux2KleinPipeline._encode_vae_image does after vae.encode: the distribution's mode, the 2x2
// patchify and the batch-norm normalisation; the result packed into sampler tokens.
#include <vector>

#include "models/flux2/vae_blocks.h"
#include "models/flux2/vae_decoder.h"

namespace apus::flux2 {

class VaeEncoder {
 public:
  static VaeEncoder load(const Config& config, WeightLoader weights);
  const VaeConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  size_t make_resident() const { return weights_.make_resident(); }

  // image [1, in_channels, H, W] in [-1, 1] (activation dtype), H and W multiples of
  // pixels_per_token -> packed [h*w, packed_channels] tokens in row-major grid order, h = H /
  // pixels_per_token, w = W / pixels_per_token: what the pipeline's prepare_image_latents packs
  // for one reference image.
  void encode(Context& c, const Tensor& image, Tensor& packed) const;

 private:
  struct DownBlock {
    std::vector<vae::Resnet> resnets;
    Tensor down_w, down_b;  // absent in the last block
  };
  explicit VaeEncoder(WeightLoader weights) : weights_(std::move(weights)) {}
  VaeConfig cfg_;
  WeightLoader weights_;
  // The normalisation (x - mean) / std as two rounded affine ops: x + (-mean), then times 1/std
  // (per activation dtype, f32 tensors).
  struct Normalise {
    Tensor ones, neg_mean, inv_std, zeros;
  };
  Normalise norm_f32_, norm_bf16_;
  Tensor conv_in_w_, conv_in_b_, quant_w_, quant_b_;
  std::vector<DownBlock> down_;
  vae::Resnet mid_in_, mid_out_;
  vae::Attention mid_attn_;
  vae::Norm norm_out_;
  Tensor conv_out_w_, conv_out_b_;
};

}  // namespace apus::flux2
