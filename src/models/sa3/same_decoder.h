#pragma once
// Stable Audio 3's SAME-L audio decoder (latents -> 44.1 kHz stereo), as the official SAMEDecoder
// computes it: the bottleneck's scale, a projection, each latent followed by 16 learned
// placeholder tokens, transformer blocks with DynamicTanh norms and differential attention over a
// band |i - j| <= 17 tokens, the placeholders kept, a weight-normed 1x1 convolution to patches and
// the unpatch. Weights in diffusers' AutoencoderSAME layout.
//
// The official decode's inference noise (the bottleneck's noise_regularize, the placeholders'
// mask_noise; diffusers' class has neither) and its chunked decode (128 latents, overlap 32, each
// chunk on its own with fresh noise) are options. SAME-S (the small models') attends within
// 34-token chunks, shifted by half a chunk for its second half of blocks, and maps with a
// kernel-3 convolution; diffusers' class cannot hold it, so it comes from official checkpoints.
#include <string>
#include <vector>

#include "io/model_dir.h"
#include "models/sa3/params.h"
#include "sampling/torch_rng.h"
#include "ops/ops.h"

namespace apus::sa3 {

struct SameConfig {
  int64_t audio_channels, patch_size, latent_dim, dim, stride, depth, head_dim, ff_inner;
  // SAME-L attends over a band of `window` tokens (sliding_window latents x (stride + 1)); SAME-S
  // (window 0) within chunks of chunk_tokens (chunk_size + chunk_size / stride), its second half
  // of blocks on chunks shifted by half a chunk when midpoint_shift.
  int64_t window = 0, chunk_tokens = 0;
  bool midpoint_shift = false;
  int64_t mapping_kernel = 1;  // the weight-normed mapping's kernel: 1 (SAME-L) or 3 (SAME-S)
  int64_t sin_blocks;          // blocks i with depth - i < sin_blocks use sin(pi x) in their FF
  int64_t sample_rate;
  bool differential;
  int64_t samples_per_latent() const { return stride * patch_size; }
  static SameConfig read(const Config& c);
};

// The official decode's noise, drawn per decoded piece from each sample's generator (torch's
// global one in the official code), in its order: the bottleneck's N(0, 1) x running_std x 1e-3
// over C x T, then the placeholders' N(0, 1) x mask over T x 16 x D.
struct DecodeNoise {
  bool bottleneck = false;
  float mask = 0;
  std::vector<TorchGenerator>* generators = nullptr;  // one per sample; null: no noise
  bool any() const { return generators && (bottleneck || mask > 0); }
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
  // the activation dtype (heap), planar channels. chunked: the official decode_audio's chunks of
  // 128 latents overlapping by 32 (sequences shorter than a chunk decode whole).
  Tensor decode(Context& c, const Tensor& latents, int64_t batch, bool chunked = false,
                const DecodeNoise& noise = {}) const;

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

  void block(Context& c, const Block& b, int64_t index, Tensor& x, const ops::AttentionOptions& attn,
             const Tensor& cos, const Tensor& sin) const;
  Tensor decode_piece(Context& c, const Tensor& latents, int64_t batch, const DecodeNoise& noise) const;
};

}  // namespace apus::sa3
