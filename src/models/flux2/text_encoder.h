#pragma once
// Qwen3 as FLUX.2 klein uses it: a causal decoder run only as deep as the deepest hidden-state
// tap, whose taps are concatenated per token into the transformer's text embedding.
#include <vector>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "ops/ops.h"

namespace apus::flux2 {

struct TextEncoderConfig {
  int64_t hidden, layers, heads, kv_heads, head_dim, intermediate, vocab;
  float eps;
  double rope_theta;
  static TextEncoderConfig read(const Config& c);
};

class TextEncoder {
 public:
  // Loads only the layers the taps need; deeper layers' weights are never touched.
  // With `tensor_ranks` (more than one), each linear holds this rank's share of its output
  // features (tensor parallelism), and encode() runs over those ranks.
  static TextEncoder load(const Config& config, WeightLoader weights, const std::vector<int>& taps,
                          const ProcessGroup* tensor_ranks = nullptr);
  const TextEncoderConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  size_t make_resident() const { return weights_.make_resident(); }
  // ids and mask [B*T], B prompts one after another; returns [B*T, taps * hidden] in the
  // activation dtype (heap). With `ranks` (a split's, every rank holding the same prompts) each
  // linear's output features are dealt out over them (models/common/feature_split.h).
  Tensor encode(Context& c, const std::vector<int32_t>& ids, const std::vector<int64_t>& attention_mask,
                int64_t batch = 1, const ProcessGroup* ranks = nullptr) const;

 private:
  explicit TextEncoder(WeightLoader weights) : weights_(std::move(weights)) {}
  struct Layer {
    Tensor in_norm, q, k, v, o, q_norm, k_norm, post_norm, gate, up, down;
  };
  TextEncoderConfig cfg_;
  std::vector<int> taps_;
  WeightLoader weights_;
  const ProcessGroup* held_ranks_ = nullptr;  // the linears' weights split over them
  Tensor embed_;
  Tensor final_norm_;  // only where a tap is the last hidden state
  std::vector<Layer> layers_;
};

}  // namespace apus::flux2
