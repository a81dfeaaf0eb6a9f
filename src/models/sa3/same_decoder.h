#pragma once
// Stable Audio 3's SAME-L audio decoder (latents -> 44.1 kHz stereo), as the official SAMEDecoder
// computes it: the bottleneck's scale, a projection, each latent followed by 16 learned
// placeholder tokens, transformer blocks with DynamicTanh norms and differential attention over a
// band |i - j| <= 17 tokens, the placeholders kept, a weight-normed 1x1 convolution to patches and
// the unpatch. Weights in diffusers' AutoencoderSAME layout.
//
// Not here yet: the official decode's inference noise (bottleneck noise_regularize, the
// placeholders' mask_noise: diffusers' class has neither), its chunked decode (128 latents,
// overlap 32: equal to the whole-sequence decode without that noise, as the band reaches +-12
// latents), and SAME-S (chunked attention, kernel-3 mapping).
#include <string>
#include <vector>

#include "io/model_dir.h"
#include "models/sa3/params.h"
#include "ops/ops.h"

namespace apus::sa3 {

struct SameConfig {
  int64_t audio_channels, patch_size, latent_dim, dim, stride, depth, head_dim, ff_inner;
  int64_t window;      // band half-width in tokens: sliding_window latents x (stride + 1)
  int64_t sin_blocks;  // blocks i with depth - i < sin_blocks use sin(pi x) in their FF
  int64_t sample_rate;
  bool differential;
  int64_t samples_per_latent() const { return stride * patch_size; }
  static SameConfig read(const Config& c);
};

class SameDecoder {
 public:
  // dir holds config.json and diffusion_pytorch_model.safetensors; every parameter is converted
  // to `compute` once (the official model.to(dtype)); load_weights false reads the config only.
  static SameDecoder load(const std::string& dir, DType compute, bool load_weights = true);
  static SameDecoder load(const SameConfig& config, ParamSource source, DType compute);
  const SameConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return source_.set.fetched_elements(); }
  size_t make_resident() const { return source_.set.make_resident(); }
  // latents [B*T, latent_dim] (frames sample-major) -> audio [B, audio_channels, T * 4096] in
  // the activation dtype (heap), planar channels.
  Tensor decode(Context& c, const Tensor& latents, int64_t batch) const;

 private:
  struct Norm {
    Tensor alpha, gamma, beta;
  };
  struct Block {
    Norm attn_norm, ff_norm, q_norm, k_norm;
    Tensor to_qkv, to_out, ff_in, ff_in_bias, ff_out, ff_out_bias;
  };
  SameConfig cfg_;
  ParamSource source_;
  std::vector<Tensor> owned_;
  Tensor scale_, zeros_;  // running_std as a [latent_dim] vector; the shift 0
  Tensor proj_, proj_bias_, new_token_, mapping_, mapping_bias_;
  std::vector<Block> blocks_;

  void block(Context& c, const Block& b, int64_t index, Tensor& x, int64_t batch,
             const Tensor& cos, const Tensor& sin) const;
};

}  // namespace apus::sa3
