#include "sampling/logsnr.h"

#include <cmath>

#include "core/error.h"

namespace apus {

std::vector<float> torch_linspace(float start, float end, int64_t steps) {
  APUS_CHECK(steps >= 1, "linspace: ", steps, " steps");
  std::vector<float> v(static_cast<size_t>(steps));
  if (steps == 1) {
    v[0] = start;
    return v;
  }
  const float step = (end - start) / float(steps - 1);
  for (int64_t i = 0; i < steps; ++i)
    v[size_t(i)] = i < steps / 2 ? std::fma(step, float(i), start)
                                 : std::fma(-step, float(steps - 1 - i), end);
  return v;
}

std::vector<float> logsnr_sigmas(int steps, float sigma_max, float logsnr_start, float logsnr_end) {
  APUS_CHECK(steps >= 1 && sigma_max > 0 && sigma_max <= 1, "log-SNR schedule: ", steps,
             " steps from sigma ", sigma_max, " (expected >= 1 steps, 0 < sigma <= 1)");
  const std::vector<float> t = torch_linspace(sigma_max, 0.0f, steps + 1);
  const float span = logsnr_end - logsnr_start;  // fp32 tensor arithmetic in the reference
  std::vector<float> sigmas(t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    const float product = t[i] * span;
    const float logsnr = logsnr_end - product;
    float s = float(1.0 / (1.0 + std::exp(double(logsnr))));
    if (t[i] <= 0) s = 0.0f;
    if (t[i] >= 1) s = 1.0f;
    sigmas[i] = s;
  }
  sigmas[0] = sigma_max;
  return sigmas;
}

bool sa3_scheduler_is_euler(const Config& s) {
  APUS_CHECK(s.get_int("num_train_timesteps", 1000) == 1, s.path, ": num_train_timesteps ",
             s.get_int("num_train_timesteps", 1000),
             " is not supported (Stable Audio 3's DiT takes sigma itself: 1)");
  APUS_CHECK(!s.get_bool("use_dynamic_shifting", false) && s.get_double("shift", 1.0) == 1.0 &&
                 !s.get_bool("invert_sigmas", false) && !s.get_bool("use_karras_sigmas", false) &&
                 !s.get_bool("use_exponential_sigmas", false) && !s.get_bool("use_beta_sigmas", false),
             s.path, ": a shift, dynamic shifting or another sigma family is not supported (the ",
             "pipeline hands the scheduler its own log-SNR sigmas)");
  APUS_CHECK(!s.has("shift_terminal"), s.path, ": shift_terminal is not supported (it would stretch the pipeline's sigmas)");
  // Only dynamic shifting (refused above) reads these.
  s.no_effect({"base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len", "time_shift_type"});
  return !s.get_bool("stochastic_sampling", false);
}

}  // namespace apus
