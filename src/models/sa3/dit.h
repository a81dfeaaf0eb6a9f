#pragma once
// Stable Audio 3's diffusion transformer: the medium DiT (differential attention) and the small
// ones (plain attention), as the official DiffusionTransformer computes them (adaLN from the
// duration and timestep, memory tokens, partial RoPE, cross-attention to text + duration tokens,
// per-block local conditioning). Weights in diffusers' StableAudio3DiTModel layout.
//
// Where diffusers 0.42.1 differs, the official code decides: block RMSNorms use eps 1e-5 (diffusers
// 1e-6) and the local-conditioning branch runs on every call (zeros for text-to-audio still add
// W2 SiLU(b1) + b2). In bf16 the timestep's Fourier features and the RoPE frequencies stay fp32
// (the official model cast to a 16-bit dtype rounds t and inv_freq, which moves high angles by
// radians); the rest follows the official module order and roundings.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "io/model_dir.h"
#include "io/weights/weight_source.h"
#include "models/common/sequence_split.h"
#include "models/common/tensor_split.h"
#include "ops/ops.h"

namespace apus::sa3 {

struct DitConfig {
  int64_t io_channels, dim, depth, heads, head_dim, rope_dim, cond_dim, global_dim, local_dim;
  int64_t timestep_features, ff_inner, memory_tokens;
  bool differential;
  float norm_eps = 1e-5f, qk_norm_eps = 1e-6f;
  static DitConfig read(const Config& c);  // diffusers' StableAudio3DiTModel config.json
  // The keys diffusers' config.json and the official model_config.json's DiT share (io_channels,
  // patch_size, embed_dim, depth, num_heads, the conditioning widths, timestep_features_dim), each
  // defaulting to `defaults`' value as its class does.
  static DitConfig read_sizes(const Config& c, const DitConfig& defaults);
  // head_dim and rope_dim from dim and heads, checked; `where` names the config in errors.
  void derive_heads(const std::string& where);
};

// How a DiT of `config` splits over `tensor_ranks` (whole for null or one rank): heads of q, k, v,
// the residual stream's features, the feed-forward's features.
TensorSplit tensor_split(const DitConfig& config, const ProcessGroup* tensor_ranks);
// The rows of each block linear (and bias) a rank holds under `split`, by weight name, in the order
// held; empty without a split.
std::map<std::string, std::vector<Share>> held_rows(const DitConfig& config, const TensorSplit& split);

// What stays fixed across sampler steps for a batch of B samples of T latent frames.
struct DitPrologue {
  int64_t batch = 1, frames = 0;
  // Frames past valid_frames are the canvas's padding: the official code (without flash-attn)
  // zeroes their self-attention values; they still take part as keys and queries.
  int64_t valid_frames = 0;
  Tensor global;  // [B, dim] to_global_embed(global condition)
  // Per block: [B*S, k width] normed keys, [B*S, dim] values; under a tensor split this rank's
  // heads' only (undefined for a rank without heads).
  std::vector<Tensor> cross_k, cross_v;
  std::vector<Tensor> local;  // per block: [B*T, dim] to_local_embed(local condition)
  Tensor cos, sin;            // [memory + T, rope_dim / 2] f32
  Tensor padding_zeros;       // [T - valid_frames, dim]: what the padding frames' values become
  Share memory;               // the learned memory tokens the sequence holds: all M of them
  // Under Ulysses, the split of each sample's [memory; frames] runs: frames, memory, local and the
  // tables then hold this rank's share of each, and every self-attention exchanges the rest.
  std::optional<SequenceSplit> sequence;
  // Samples [first, first + count) of the batch: views of their rows, the tables shared.
  DitPrologue samples(int64_t first, int64_t count) const;
  // This rank's tokens under `split` (runs {M, T}): copies of its local rows and table rows.
  DitPrologue rank_share(Context& c, const SequenceSplit& split) const;
};

class Dit {
 public:
  // Weights under diffusers' names. Every parameter is converted to `compute` once here (the
  // official model.to(dtype)). With `tensor_ranks` (more than one) the blocks' linears hold this
  // rank's share of their output features (held_rows), and the blocks gather the features where
  // the next op needs them all (models/common/tensor_split.h).
  static Dit load(const DitConfig& config, WeightLoader weights, DType compute,
                  const ProcessGroup* tensor_ranks = nullptr);
  const DitConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  // The weights fetched, by name, with the shapes asked for: what adapters must fit.
  const std::map<std::string, Shape>& weight_shapes() const { return weights_.fetched(); }
  size_t make_resident() const { return weights_.make_resident(); }

  // cross [B*S, cond_dim]: the text tokens and the duration token of each sample, cross_valid
  // [B*S] (0: a padded text position, replaced by the learned padding embedding as the official
  // conditioner does); global [B, global_dim] (the duration embedding); local [B*T, local_dim]
  // (zeros for text-to-audio, mask + masked latents for inpainting).
  // valid_frames < T marks the canvas's padding (see DitPrologue); 0 means every frame.
  DitPrologue prologue(Context& c, const Tensor& cross, const std::vector<int64_t>& cross_valid, const Tensor& global,
                       const Tensor& local, int64_t valid_frames = 0) const;
  // x [B*T, io_channels] latent frames (sample-major), t in [0, 1] for every sample; writes the
  // velocity [B*T, io_channels].
  void forward(Context& c, const DitPrologue& pro, const Tensor& x, float t, Tensor& velocity) const;

 private:
  struct Block {
    Tensor pre_norm, cross_norm, ff_norm, scale_shift_gate;
    Tensor to_qkv, to_out, q_norm, k_norm;
    Tensor cross_q, cross_kv, cross_out, cross_q_norm, cross_k_norm;
    Tensor ff_in, ff_in_bias, ff_out, ff_out_bias;
    Tensor local_1, local_1_bias, local_2, local_2_bias;
  };
  explicit Dit(WeightLoader weights) : weights_(std::move(weights)) {}
  DitConfig cfg_;
  TensorSplit split_;
  WeightLoader weights_;
  Tensor time_1_, time_1_bias_, time_2_, time_2_bias_, cond_1_, cond_2_, global_1_, global_2_;
  Tensor mod_1_, mod_1_bias_, mod_2_, mod_2_bias_, pre_conv_, post_conv_, proj_in_, proj_out_;
  Tensor memory_, padding_, time_freqs_, ones_;
  std::vector<Block> blocks_;

  void block(Context& c, const Block& b, size_t index, const DitPrologue& pro, Tensor& x, const Tensor& mod) const;
  // y [rows, dim] = Linear -> SiLU -> Linear (the conditioning MLPs), biases optional.
  void mlp(Context& c, const Tensor& x, const Tensor& w1, const Tensor* b1, const Tensor& w2, const Tensor* b2,
           Tensor& y) const;
  // y [B*T, dim] = block b's to_local_embed MLP of local [B*T, local_dim]; under a tensor split
  // each linear's features over the ranks, gathered.
  void local_embedding(Context& c, const Block& b, const Tensor& local, Tensor& y) const;
};

}  // namespace apus::sa3
