#include "models/sa3/duration_embedder.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "models/sa3/fourier.h"

namespace apus::sa3 {

DurationConfig DurationConfig::read(const Config& c) {
  DurationConfig d{};
  d.output_dim = c.get_size("output_dim", 768, 1);
  d.fourier_dim = c.get_size("fourier_dim", 256, 2);
  APUS_CHECK(d.fourier_dim % 2 == 0, c.path, ": fourier_dim ", d.fourier_dim, " must be even");
  d.min_val = c.get_double("min_val", 0.0);
  d.max_val = c.get_double("max_val", 384.0);
  d.check_range(c.path);
  // They only initialise the `freqs` buffer, which the checkpoint stores and the model reads.
  c.no_effect({"min_freq", "max_freq"});
  return d;
}

void DurationConfig::check_range(const std::string& where) const {
  const float span = float(max_val) - float(min_val);
  APUS_CHECK(std::isfinite(span) && span > 0, where, ": 'min_val' ", min_val, " and 'max_val' ", max_val,
             " leave no finite positive span in fp32 (max_val must exceed min_val)");
}

DurationEmbedder DurationEmbedder::load(const DurationConfig& config, WeightLoader weights) {
  DurationEmbedder m(std::move(weights));
  m.cfg_ = config;
  // The frequencies as saved (min_freq..max_freq, exponentially spaced): read, not recomputed.
  m.freqs_ = m.weights_.get("freqs", {m.cfg_.fourier_dim / 2});
  m.weight_ = m.weights_.get("linear.weight", {m.cfg_.output_dim, m.cfg_.fourier_dim});
  m.bias_ = m.weights_.get("linear.bias", {m.cfg_.output_dim});
  return m;
}

DurationEmbedder DurationEmbedder::load_official(const DurationConfig& config, WeightLoader weights) {
  DurationEmbedder m(std::move(weights));
  m.cfg_ = config;
  m.freqs_ = m.weights_.place(expo_fourier_frequencies(m.cfg_.fourier_dim / 2));
  m.weight_ = m.weights_.get("linear.weight", {m.cfg_.output_dim, m.cfg_.fourier_dim});
  m.bias_ = m.weights_.get("linear.bias", {m.cfg_.output_dim});
  return m;
}

Tensor DurationEmbedder::embed(Context& c, const std::vector<float>& seconds) const {
  ArenaScope scope(*c.arena);
  CostScope duration_scope(c, "duration");
  const int64_t b = int64_t(seconds.size()), f = cfg_.fourier_dim;
  APUS_CHECK(b >= 1, "duration embedder: no duration given");
  Tensor features = Tensor::in(*c.arena, {b, f}, c.act);
  for (int64_t i = 0; i < b; ++i) {
    // Clamped and normalised in fp32, as the reference does.
    const float lo = float(cfg_.min_val), hi = float(cfg_.max_val);
    const float t = (std::clamp(seconds[size_t(i)], lo, hi) - lo) / (hi - lo);
    Tensor row = features.rows(i, i + 1);
    ops::fourier_features(c, t, freqs_, row);
  }
  Tensor out = ops::empty(c, {b, cfg_.output_dim}, c.act);
  ops::linear(c, features, weight_, &bias_, out);
  return out;
}

}  // namespace apus::sa3
