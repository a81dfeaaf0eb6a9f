#include "sampling/flow_match.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace apus {

double flux2_empirical_mu(int64_t image_tokens, int steps) {
  const double a1 = 8.73809524e-05, b1 = 1.89833333, a2 = 0.00016927, b2 = 0.45666666;
  const double seq = double(image_tokens);
  if (image_tokens > 4300) return a2 * seq + b2;
  const double m200 = a2 * seq + b2, m10 = a1 * seq + b1;
  const double a = (m200 - m10) / 190.0, b = m200 - 200.0 * a;
  return a * steps + b;
}

FlowSchedule flow_match_schedule(const Config& cfg, int steps, double mu) {
  APUS_CHECK(steps >= 1 && steps <= 1000, "steps ", steps, " out of range (expected 1..1000)");
  APUS_CHECK(cfg.get_bool("use_dynamic_shifting", false), cfg.path,
             ": only use_dynamic_shifting true (FLUX.2) is supported");
  const std::string shift_type = cfg.get_string("time_shift_type", "exponential");
  APUS_CHECK(shift_type == "exponential", cfg.path, ": time_shift_type '", shift_type,
             "' is not supported (expected exponential)");
  for (const char* key : {"use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"})
    APUS_CHECK(!cfg.get_bool(key, false), cfg.path, ": ", key, " is not supported");
  APUS_CHECK(!cfg.has("shift_terminal"), cfg.path, ": shift_terminal is not supported");
  APUS_CHECK(!cfg.get_bool("stochastic_sampling", false), cfg.path, ": stochastic_sampling true is not supported");
  // With dynamic shifting the pipeline's mu replaces these (FLUX.2 computes mu from the image's
  // token count and the steps, not from the base/max shift interpolation).
  cfg.no_effect({"shift", "base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len"});
  const float train_steps = float(cfg.get_size("num_train_timesteps", 1000, 1));
  FlowSchedule s;
  // np.linspace in float64, stored as float32; the shift then runs in float32 with exp(mu)
  // a weakly typed Python float.
  const float e = float(std::exp(mu));
  for (int i = 0; i < steps; ++i) {
    const double lin = steps == 1 ? 1.0 : 1.0 + (1.0 / steps - 1.0) * double(i) / double(steps - 1);
    const float sigma = float(lin);
    const float shifted = e / (e + (1.0f / sigma - 1.0f));
    s.sigmas.push_back(shifted);
    s.timesteps.push_back(shifted * train_steps);
  }
  s.sigmas.push_back(0.0f);
  return s;
}

void euler_step(Context& c, Tensor& x, const Tensor& velocity, float sigma, float sigma_next) {
  ops::euler_update(c, x, velocity, sigma_next - sigma);
}

void classifier_free_guidance(Context& c, Tensor& cond, Tensor& uncond, float scale) {
  const int64_t d = cond.shape[1];
  ArenaScope arena(*c.arena);
  // The gates of the two fused multiply-adds: -1 (the difference) and the scale.
  const Tensor minus_one =
      ops::host_filled(c, {d}, DType::f32, [&](Tensor& t) { std::fill_n(t.ptr<float>(), d, -1.0f); });
  const Tensor gain = ops::host_filled(c, {d}, DType::f32, [&](Tensor& t) { std::fill_n(t.ptr<float>(), d, scale); });
  ops::add_gated(c, cond, uncond, &minus_one, ops::Rounding::each_step);
  ops::add_gated(c, uncond, cond, &gain, ops::Rounding::each_step);
}

}  // namespace apus
