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
    v[size_t(i)] = i < steps / 2 ? std::fma(step, float(i), start) : std::fma(-step, float(steps - 1 - i), end);
  return v;
}

namespace {

// exp as torch's vectorised CPU kernels evaluate it in fp32 (SLEEF's expf_u10, with FMA): a
// degree-6 polynomial on the argument reduced by a two-part ln 2, scaled by 2^q.
float vectorised_expf(float d) {
  const float q = std::nearbyint(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
  float s = std::fma(q, -0.693145751953125f, d);
  s = std::fma(q, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  for (const float c : {0.00139304355252534151077271f, 0.00833336077630519866943359f, 0.0416664853692054748535156f,
                        0.166666671633720397949219f, 0.5f})
    u = std::fma(u, s, c);
  u = 1.0f + std::fma(s * s, u, s);
  if (d < -104) return 0.0f;
  if (d > 100) return INFINITY;
  return std::ldexp(u, int(q));
}

// torch.sigmoid(-logsnr) over a contiguous fp32 tensor on the CPU: 1 / (1 + exp(logsnr)) in fp32,
// with the vectorised loop's exp over whole pairs of AVX-512 vectors (32 floats) and libm's expf
// over the rest (the scalar loop), as torch evaluates the official schedule's steps + 1 values.
std::vector<float> torch_sigmoid_of_negated(const std::vector<float>& logsnr) {
  constexpr size_t kVectorPair = 32;
  const size_t vectorised = logsnr.size() / kVectorPair * kVectorPair;
  std::vector<float> out(logsnr.size());
  for (size_t i = 0; i < logsnr.size(); ++i)
    out[i] = 1.0f / (1.0f + (i < vectorised ? vectorised_expf(logsnr[i]) : std::exp(logsnr[i])));
  return out;
}

}  // namespace

std::vector<float> logsnr_sigmas(int steps, float sigma_max, float logsnr_start, float logsnr_end) {
  APUS_CHECK(steps >= 1 && sigma_max > 0 && sigma_max <= 1, "log-SNR schedule: ", steps, " steps from sigma ",
             sigma_max, " (expected >= 1 steps, 0 < sigma <= 1)");
  const std::vector<float> t = torch_linspace(sigma_max, 0.0f, steps + 1);
  const float span = logsnr_end - logsnr_start;  // fp32 tensor arithmetic in the reference
  std::vector<float> logsnr(t.size());
  for (size_t i = 0; i < t.size(); ++i) logsnr[i] = logsnr_end - t[i] * span;
  std::vector<float> sigmas = torch_sigmoid_of_negated(logsnr);
  for (size_t i = 0; i < t.size(); ++i) {
    float& s = sigmas[i];
    if (t[i] <= 0) s = 0.0f;
    if (t[i] >= 1) s = 1.0f;
  }
  sigmas[0] = sigma_max;
  return sigmas;
}

bool sa3_scheduler_is_euler(const Config& s) {
  APUS_CHECK(s.get_int("num_train_timesteps", 1000) == 1, s.path, ": num_train_timesteps ",
             s.get_int("num_train_timesteps", 1000), " is not supported (Stable Audio 3's DiT takes sigma itself: 1)");
  APUS_CHECK(!s.get_bool("use_dynamic_shifting", false) && s.get_double("shift", 1.0) == 1.0 &&
                 !s.get_bool("invert_sigmas", false) && !s.get_bool("use_karras_sigmas", false) &&
                 !s.get_bool("use_exponential_sigmas", false) && !s.get_bool("use_beta_sigmas", false),
             s.path, ": a shift, dynamic shifting or another sigma family is not supported (the ",
             "pipeline hands the scheduler its own log-SNR sigmas)");
  APUS_CHECK(!s.has("shift_terminal"), s.path,
             ": shift_terminal is not supported (it would stretch the pipeline's sigmas)");
  // Only dynamic shifting (refused above) reads these.
  s.no_effect({"base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len", "time_shift_type"});
  return !s.get_bool("stochastic_sampling", false);
}

}  // namespace apus
