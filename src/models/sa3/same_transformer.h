#pragma once
// What SAME's encoder and decoder share: the configuration of one resampling level (SAME-L and
// SAME-S have one on each side), the transformer inside it (DynamicTanh blocks of differential
// attention over a band of tokens or within chunks, SiLU or sin(pi x) feed-forwards), and the
// weight-normed mapping convolution between audio patches and the transformer's width.
#include <string>
#include <vector>

#include "io/model_dir.h"
#include "io/weights/weight_source.h"
#include "models/common/tensor_split.h"
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
  int64_t patch_width() const { return audio_channels * patch_size; }
  // diffusers' AutoencoderSAME config.json, which describes both sides alike but for the
  // sinusoidal blocks: the decoder's side, or the encoder's.
  static SameConfig read(const Config& c, bool encoder = false);
};

class SameTransformer {
 public:
  // The blocks under `prefix` ("decoder.blocks.0.") + "transformers.N.", from `converted` (the
  // model's weights converted to its compute dtype). With `tensor_ranks` (more than one) each
  // block's linears hold this rank's share of their output features (q, k, v by heads, the rest
  // by features), the features gathered where the next op needs them all.
  static SameTransformer load(const SameConfig& config, const WeightLoader& converted, const std::string& prefix,
                              const ProcessGroup* tensor_ranks = nullptr);
  bool split() const { return split_.splits(); }
  // x [B*N, dim]: each sample's N tokens (groups of stride + 1), in place. RoPE counts from 0 over
  // what one attention sees (a sample, or one chunk).
  void run(Context& c, Tensor& x, int64_t batch) const;

 private:
  struct Norm {
    Tensor alpha, gamma, beta;
  };
  struct Block {
    Norm attn_norm, ff_norm, q_norm, k_norm;
    Tensor to_qkv, to_out, ff_in, ff_in_bias, ff_out, ff_out_bias;
  };
  SameConfig cfg_;
  TensorSplit split_;
  std::vector<Block> blocks_;
  void block(Context& c, const Block& b, int64_t index, Tensor& x, const ops::AttentionOptions& attn, const Tensor& cos,
             const Tensor& sin) const;
};

// The weight-normed mapping convolution `prefix`.weight_g / weight_v (out x in x kernel) as one
// GEMM weight [out, kernel * in], W[o] = g[o] v[o] / ||v[o]|| formed in double (torch's
// weight_norm over dim 0) from g and v as received (not yet in `compute`), taps side by side to
// meet conv_taps' layout, then held in `compute`.
Tensor weight_normed_mapping(const WeightLoader& weights, DType compute, const std::string& prefix, int64_t out,
                             int64_t in, int64_t kernel);

// The bottleneck's running_std as `compute` rounds it (1 in counting mode, without data): the
// encoder divides the latents by it, the decoder multiplies them (and its noise) by it, so
// anything but a finite positive number is refused naming the file and tensor.
float bottleneck_std(const WeightLoader& weights, DType compute);

// x [B*N, d] (each sample's N positions) -> [B*N, 3d]: [x(t-1), x(t), x(t+1)], zero past each
// sample's ends: a kernel-3 'same' convolution becomes one GEMM with weight_normed_mapping's weight.
Tensor conv_taps(Context& c, const Tensor& x, int64_t batch);

// The official encode_audio / decode_audio chunking over `frames` latents: chunks of 128 latents
// every 96, the last anchored at the end; each chunk keeps [lo, hi) of its own latents (the
// overlaps trimmed by 16 on every inner edge), written in order so the last wins.
struct SameChunk {
  int64_t start, lo, hi;
};
constexpr int64_t kSameChunk = 128, kSameOverlap = 32;
std::vector<SameChunk> same_chunks(int64_t frames);

}  // namespace apus::sa3
