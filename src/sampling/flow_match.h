#pragma once
// Flow-matching schedule and Euler sampler as diffusers' FlowMatchEulerDiscreteScheduler runs
// them for FLUX.2: float32 sigmas, exponential time shift by the empirical mu.
#include <vector>

#include "io/model_dir.h"
#include "ops/ops.h"

namespace apus {

// FLUX.2's empirical rule for the shift, from the image token count and the step count.
double flux2_empirical_mu(int64_t image_tokens, int steps);

struct FlowSchedule {
  std::vector<float> sigmas;     // steps + 1 values, the last 0
  std::vector<float> timesteps;  // steps values, 1000 * sigma
};

// Reads scheduler_config.json for the shift type and training timesteps; rejects what it lacks.
FlowSchedule flow_match_schedule(const Config& scheduler_config, int steps, double mu);

// x <- x + (sigma_next - sigma) v, with the reference's roundings, back in x's dtype.
void euler_step(Context& c, Tensor& x, const Tensor& velocity, float sigma, float sigma_next);

// Classifier-free guidance as diffusers' FLUX.2 pipelines combine the two branches:
// uncond + scale (cond - uncond), each eager op rounded to the velocities' dtype. cond [M, D] is
// left holding the difference, uncond the guided velocity.
void classifier_free_guidance(Context& c, Tensor& cond, Tensor& uncond, float scale);

}  // namespace apus
