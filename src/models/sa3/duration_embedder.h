#pragma once
// Stable Audio 3's duration conditioner (diffusers' StableAudio3DurationEmbedder, the reference's
// NumberConditioner with expo Fourier features): seconds -> clamp, normalise -> fp32 Fourier
// features -> Linear. Its vector is both the DiT's global condition and the last cross token.
#include <map>
#include <string>
#include <vector>

#include "io/model_dir.h"
#include "ops/ops.h"

namespace apus::sa3 {

struct DurationConfig {
  int64_t output_dim, fourier_dim;
  double min_val, max_val;
  static DurationConfig read(const Config& c);
  // The embedder normalises seconds by (max_val - min_val) in fp32: the span must be finite and
  // positive there. `where` names the file and key path in the error.
  void check_range(const std::string& where) const;
};

class DurationEmbedder {
 public:
  // diffusers' StableAudio3DurationEmbedder: freqs, linear.weight and linear.bias.
  static DurationEmbedder load(const DurationConfig& config, WeightLoader weights);
  // The official checkpoint's NumberConditioner: the frequencies are computed (the official module
  // registers none), the linear layer read.
  static DurationEmbedder load_official(const DurationConfig& config, WeightLoader weights);
  const DurationConfig& config() const { return cfg_; }
  int64_t parameter_count() const { return weights_.fetched_elements(); }
  size_t held_bytes() const { return weights_.held_bytes(); }  // the weights as held in memory
  // The weights fetched, by name, with the shapes asked for: what adapters must fit.
  const std::map<std::string, Shape>& weight_shapes() const { return weights_.fetched(); }
  size_t make_resident() const { return weights_.make_resident(); }
  // One [B, output_dim] row per duration, in the activation dtype (heap). The Fourier features
  // stay fp32 with fp32 frequencies in a bf16 run too, as the official code keeps them (diffusers'
  // bf16 load rounds the frequencies to bf16, which moves the high angles by radians).
  Tensor embed(Context& c, const std::vector<float>& seconds) const;

 private:
  explicit DurationEmbedder(WeightLoader weights) : weights_(std::move(weights)) {}
  DurationConfig cfg_;
  WeightLoader weights_;
  Tensor freqs_, weight_, bias_;
};

}  // namespace apus::sa3
