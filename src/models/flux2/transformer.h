#pragma once
// FLUX.2 transformer (diffusers Flux2Transformer2DModel): double-stream blocks over separate
// text and image weights, single-stream blocks over the joint sequence, shared modulation.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "io/model_dir.h"
#include "models/common/sequence_split.h"
#include "models/common/tensor_split.h"
#include "ops/ops.h"

namespace apus::flux2 {

struct TransformerConfig {
  int64_t in_channels, out_channels, heads, head_dim, hidden, num_double, num_single;
  int64_t joint_dim, mlp_hidden, timestep_channels;
  std::vector<int64_t> axes_dims;
  double rope_theta;
  float eps;
  static TransformerConfig read(const Config& c);
};

// What does not change across sampler steps: the text projection and the RoPE tables. A batch of
// B samples shares the position tables.
struct TransformerPrologue {
  int64_t batch = 1;
  Tensor txt;       // [B*T, hidden] context_embedder(prompt embeddings), activation dtype
  Tensor cos, sin;  // [T + L, head_dim / 2] f32: one sample's joint sequence, text first
  // Under Ulysses, the split of each sample's [text; image] runs: txt, cos and sin then hold this
  // rank's share of each (T and L its own), and every attention exchanges the rest.
  std::optional<SequenceSplit> sequence;
  // Samples [first, first + count) of the batch: views of their text rows, the tables shared.
  TransformerPrologue samples(int64_t first, int64_t count) const;
  // This rank's tokens under `split` (runs {T, L}): copies of its text rows and table rows.
  TransformerPrologue rank_share(Context& c, const SequenceSplit& split) const;
};

// The reference images' keys and values at every block (after their norms and RoPE), as
// Flux2KleinKVPipeline caches them: the references' tokens run once, on their own (attending only
// to each other), modulated at timestep 0; every step's queries then see them between the text's
// keys and the image's. One entry per double block, then per single block; shared by a batch.
struct ReferenceKv {
  struct Layer {
    Tensor k, v;  // [R, hidden] activation dtype
  };
  std::vector<Layer> layers;
};

// How a transformer of `config` splits over `tensor_ranks` (whole for null or one rank).
TensorSplit tensor_split(const TransformerConfig& config, const ProcessGroup* tensor_ranks);

// Under a tensor split: the rows of each block linear's weight this rank holds (each a fused
// weight's part, in order), by the weight's name. Empty without a split.
std::map<std::string, std::vector<Share>> held_rows(const TransformerConfig& config, const TensorSplit& split);

class Transformer {
 public:
  // With `tensor_ranks` (more than one), the blocks' linears hold this rank's share of their
  // output features (models/common/tensor_split.h) and every forward runs split over those ranks.
  static Transformer load(const Config& config, WeightLoader weights, const ProcessGroup* tensor_ranks = nullptr);
  const TransformerConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  // Every weight by name with its shape: what adapters are checked against.
  const std::map<std::string, Shape>& weight_shapes() const { return weights_.fetched(); }
  const TensorSplit& split() const { return split_; }
  size_t make_resident() const { return weights_.make_resident(); }

  // prompt_embeds [B*T, joint_dim], B samples one after another; txt_ids [T, 4], img_ids [L, 4]
  // i64 position ids (T, H, W, L axes) shared by the samples, shape-only in counting mode.
  TransformerPrologue prologue(Context& c, const Tensor& prompt_embeds, const Tensor& txt_ids,
                               const Tensor& img_ids) const;
  // latents [B*L, in_channels] (activation dtype); timestep is the scheduler's t = 1000 sigma,
  // the same for every sample. Writes velocity [B*L, out_channels]. With `references`, every
  // attention also sees their cached keys and values.
  void forward(Context& c, const TransformerPrologue& pro, const Tensor& latents, float timestep, Tensor& velocity,
               const ReferenceKv* references = nullptr) const;
  // Runs packed reference tokens [R, in_channels] at position ids ids [R, 4] through every block
  // and keeps their keys and values (the KV pipeline's extract pass).
  ReferenceKv reference_kv(Context& c, const Tensor& tokens, const Tensor& ids) const;

 private:
  struct Double {
    Tensor to_q, to_k, to_v, add_q, add_k, add_v, to_out, to_add_out;
    Tensor norm_q, norm_k, norm_added_q, norm_added_k;
    Tensor ff_in, ff_out, ff_ctx_in, ff_ctx_out;
  };
  struct Single {
    Tensor qkv_mlp, out, norm_q, norm_k;
  };
  explicit Transformer(WeightLoader weights) : weights_(std::move(weights)) {}
  TransformerConfig cfg_;
  WeightLoader weights_;
  TensorSplit split_;
  Tensor x_embedder_, context_embedder_, time_1_, time_2_, mod_img_, mod_txt_, mod_single_;
  Tensor norm_out_, proj_out_;
  std::vector<Double> double_;
  std::vector<Single> single_;

  // How a block's attention meets the references: it attends to their cached keys and values,
  // or (the references' own pass) keeps its keys and values as theirs.
  struct BlockKv {
    const ReferenceKv::Layer* attend = nullptr;
    ReferenceKv::Layer* keep = nullptr;
  };
  struct Modulation {
    Tensor img, txt, single, out;  // [1, 6h], [1, 6h], [1, 3h], [1, 2h]
  };
  // The blocks' shared modulation at the model's timestep tau (already rounded as the reference).
  Modulation modulation(Context& c, float tau) const;
  // Joint attention over each sample's [txt; img] rows (txt_len text rows), the references' keys
  // and values between the text's and the image's when kv.attend is set; over the ranks under
  // pro's sequence split.
  void joint_attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       const TransformerPrologue& pro, int64_t txt_len, const BlockKv& kv) const;
  void double_block(Context& c, const Double& b, Tensor& hidden, int64_t txt_len, int64_t batch, const Modulation& mod,
                    const TransformerPrologue& pro, const BlockKv& kv) const;
  void single_block(Context& c, const Single& b, Tensor& hidden, const Tensor& mod, const TransformerPrologue& pro,
                    int64_t txt_len, const BlockKv& kv) const;
};

}  // namespace apus::flux2
