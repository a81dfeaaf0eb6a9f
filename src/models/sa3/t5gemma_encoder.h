#pragma once
// Stable Audio 3's text encoder: the encoder of T5Gemma (google/t5gemma-b-b-ul2), as
// transformers' T5GemmaEncoder computes it. Its attention runs eager (the model declares no SDPA
// support), so in bf16 the scores are rounded after every step and capped by tanh.
#include <string>
#include <vector>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "ops/ops.h"

namespace apus::sa3 {

struct T5GemmaConfig {
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim;
  double rope_theta;
  float eps;
  float attention_scale;   // query_pre_attn_scalar^-1/2
  float softcap;           // attn_logit_softcapping; 0: none
  int64_t sliding_window;  // of the layers whose layer_types entry is sliding_attention
  std::vector<bool> sliding;
  // config.json's "encoder" object (T5GemmaConfig), or the file itself when it is the module's.
  static T5GemmaConfig read(const Config& c);
};

class T5GemmaEncoder {
 public:
  // The weights of transformers' T5GemmaEncoderModel (keys encoder.*) or T5GemmaModel's
  // (model.encoder.*). With `tensor_ranks` (more than one) each linear holds this rank's share of
  // its output features, and encode() runs over those ranks.
  static T5GemmaEncoder load(const T5GemmaConfig& config, WeightLoader weights,
                             const ProcessGroup* tensor_ranks = nullptr);
  const T5GemmaConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  size_t make_resident() const { return weights_.make_resident(); }
  // ids and mask [B*T], B prompts one after another; returns last_hidden_state [B*T, hidden] in
  // the activation dtype (heap). Padded query rows are computed too (they attend to the real keys).
  // With `ranks` (a split's, every rank holding the same prompts) each linear's output features are
  // dealt out over them (models/common/feature_split.h).
  Tensor encode(Context& c, const std::vector<int32_t>& ids, const std::vector<int64_t>& mask, int64_t batch,
                const ProcessGroup* ranks = nullptr) const;

 private:
  // Gemma's RMSNorm scales by (1 + w) with w as the model holds it: f32, and bf16-rounded for a
  // bf16 run. Both computed at load; index 0 f32, 1 bf16.
  struct Norm {
    Tensor scale[2];
  };
  struct Layer {
    Norm pre_attn, post_attn, pre_ff, post_ff;
    Tensor q, k, v, o, gate, up, down;
  };
  explicit T5GemmaEncoder(WeightLoader weights) : weights_(std::move(weights)) {}
  T5GemmaConfig cfg_;
  WeightLoader weights_;
  const ProcessGroup* held_ranks_ = nullptr;  // the linears' weights split over them
  Tensor embed_;
  std::vector<Layer> layers_;
  Norm final_norm_;
  Tensor embed_scale_[2], zeros_;  // the embedding normaliser sqrt(hidden) in each dtype; shift 0
  Norm norm(const std::string& name) const;
};

}  // namespace apus::sa3
