#pragma once
// What FLUX.2 [klein] fixes for every request, shared by the pipeline and the cost model.
#include <vector>

#include "apus/apus.h"
#include "io/model_dir.h"

namespace apus::flux2 {

// Pixels per side of a latent token: the VAE's 8x downsampling and the transformer's 2x2 patches.
// Every image side the pipeline renders is a multiple of it.
constexpr int kTokenPixels = 16;
constexpr int kMaxSequence = 512;                       // the pipeline's max_sequence_length
inline const std::vector<int> kTextTaps = {9, 18, 27};  // the pipeline's text_encoder_out_layers

// What model_index.json says about the pipeline.
struct KleinIndex {
  // is_distilled: true for the step-distilled models (no guidance), false for the -base models,
  // sampled with classifier-free guidance; absent, the pipeline's default (false for
  // Flux2KleinPipeline, true for Flux2KleinKVPipeline).
  bool distilled = true;
  // Flux2KleinKVPipeline (the -kv checkpoints): references run once and their keys and values
  // are cached; no guidance, no inpainting.
  bool reference_cache = false;
};

// Refuses a directory that is not a Flux2KleinPipeline or Flux2KleinKVPipeline with the
// component classes this implementation reproduces, naming model_index.json and the key.
KleinIndex check_klein_index(const ModelDir& dir);

// The official pipeline's defaults: 50 steps and guidance 4.0 for a -base model. The distilled
// models are meant for 4 steps (their model card; the pipeline's own default is 50) and ignore
// guidance.
constexpr int kBaseSteps = 50, kDistilledSteps = 4;
constexpr float kBaseGuidance = 4.0f;
constexpr float kInpaintGuidance = 8.0f;  // Flux2KleinInpaintPipeline's default scale (-base)

// The inpainting mask as Flux2KleinInpaintPipeline prepares it: resized to width x height with
// PIL's Lanczos filter (in RGB), converted to grey as PIL's convert("L"), 1 where that is >= 128
// (u8 / 255 >= 0.5), else 0, then interpolated bilinearly (torch, align_corners false) to the
// (height / 16) x (width / 16) latent grid: one weight per image token, row by row.
std::vector<float> inpaint_mask(const Rgb8Image& mask, int width, int height);

// get_timesteps: the index of the first of `steps` steps that an inpainting of `strength` runs.
int inpaint_first_step(int steps, double strength);

// Position ids (T, H, W, L axes) of the text tokens, (0, 0, 0, i), and of the image tokens of an
// h x w latent grid, (0, row, col, 0): i64 [n, 4].
Tensor text_position_ids(int64_t tokens);
Tensor image_position_ids(int64_t h, int64_t w);
// The image tokens' ids, then each reference grid's (rows, cols) with T = 10, 20, ... (the
// pipeline's _prepare_image_ids): i64 [h*w + sum of rows*cols, 4].
Tensor image_and_reference_position_ids(int64_t h, int64_t w,
                                        const std::vector<std::pair<int64_t, int64_t>>& references);

}  // namespace apus::flux2
