#pragma once
// Stable Audio 3's sampling schedule and ping-pong sampler as the official code runs them for its
// distilled models: sigmas on a log-SNR line (LogSNRShift with rate 0, the default when a
// model_config.json has no sampling_distribution_shift_options), fresh noise after every step.
#include <cstdint>
#include <vector>

#include "io/model_dir.h"
#include "ops/ops.h"

namespace apus {

// torch.linspace(start, end, steps) in fp32 as torch's CPU kernel computes it: a float step,
// each value a fused multiply-add from the nearer end (bit-equal to torch 2.9.1 on x86).
std::vector<float> torch_linspace(float start, float end, int64_t steps);

// steps + 1 sigmas: t = linspace(sigma_max, 0), logsnr = end - t (end - start),
// sigma = sigmoid(-logsnr), ends pinned (t >= 1: 1, t <= 0: 0), the first set to sigma_max; each
// step in fp32 as torch's CPU kernels (AVX-512) compute it, bit-equal to the official schedule.
std::vector<float> logsnr_sigmas(int steps, float sigma_max, float logsnr_start = -6.2f, float logsnr_end = 2.0f);

// Checks a StableAudio3Pipeline's scheduler_config.json (FlowMatchEulerDiscreteScheduler, which the
// pipeline hands its own log-SNR sigmas: shifts and other sigma families are refused) and says
// which sampler it means: stochastic_sampling is the distilled models' ping-pong, else the -base
// models' Euler (true).
bool sa3_scheduler_is_euler(const Config& scheduler_config);

}  // namespace apus
