#pragma once
// FLUX.2 VAE decoder (diffusers AutoencoderKLFlux2, decoder half) together with what the
// Flux2KleinPipeline does between the sampler and vae.decode, and the image postprocessing.
#include <vector>

#include "io/model_dir.h"
#include "ops/ops.h"

namespace apus::flux2 {

struct VaeConfig {
  int64_t latent_channels, out_channels, layers_per_block, groups, patch;
  std::vector<int64_t> block_out;  // the decoder's channels, outermost (full resolution) first
  bool mid_attention, post_quant_conv;
  double bn_eps;
  // Features of one sampler token: a patch x patch block of latent pixels.
  int64_t packed_channels() const { return patch * patch * latent_channels; }
  // Image pixels per sampler token along each axis (16 for the published model).
  int64_t pixels_per_token() const { return patch << (block_out.size() - 1); }
  static VaeConfig read(const Config& c);
};

class VaeDecoder {
 public:
  static VaeDecoder load(const ModelDir& dir);
  const VaeConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t make_resident() const { return weights_.make_resident(); }

  // packed [N*h*w, packed_channels] tokens in row-major grid order, N samples one after another
  // (activation dtype) -> latents [N, latent_channels, patch*h, patch*w]: the batch-norm
  // de-normalisation and the unpatchify the pipeline applies before vae.decode.
  void unpack_latents(Context& c, const Tensor& packed, int64_t h, int64_t w,
                      Tensor& latents) const;
  // packed tokens as above -> image [N, out_channels, h*pixels_per_token, w*pixels_per_token]
  // in the activation dtype, in [-1, 1] before postprocessing.
  void decode(Context& c, const Tensor& packed, int64_t h, int64_t w, Tensor& image) const;

 private:
  struct Norm {
    Tensor weight, bias;
  };
  struct Resnet {
    Norm norm1, norm2;
    Tensor conv1_w, conv1_b, conv2_w, conv2_b;
    Tensor shortcut_w, shortcut_b;  // a 1x1 conv, only where the block changes the channel count
  };
  struct Attention {
    Norm norm;
    Tensor q_w, q_b, k_w, k_b, v_w, v_b, out_w, out_b;
  };
  struct UpBlock {
    std::vector<Resnet> resnets;
    Tensor up_w, up_b;  // absent in the last block
  };
  // The batch-norm statistics as the pipeline applies them in the latents' dtype: the mean cast
  // to it and sqrt(var + eps) evaluated in it, for f32 and bf16 activations; computed at load.
  struct Denorm {
    Tensor mean, std;
  };
  VaeConfig cfg_;
  WeightSet weights_;
  Denorm denorm_f32_, denorm_bf16_;
  Tensor post_quant_w_, post_quant_b_, conv_in_w_, conv_in_b_;
  Resnet mid_in_, mid_out_;
  Attention mid_attn_;
  std::vector<UpBlock> up_;
  Norm norm_out_;
  Tensor conv_out_w_, conv_out_b_;

  int64_t max_activation(int64_t lh, int64_t lw) const;
  void resnet(Context& c, const Resnet& r, const Tensor& x, Tensor& y) const;
  void attention(Context& c, const Attention& a, const Tensor& x, Tensor& y) const;
};

}  // namespace apus::flux2
