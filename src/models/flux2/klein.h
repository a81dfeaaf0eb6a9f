#pragma once
// What FLUX.2 [klein] fixes for every request, shared by the pipeline and the cost model.
#include <vector>

#include "io/model_dir.h"

namespace apus::flux2 {

constexpr int kMaxSequence = 512;                    // the pipeline's max_sequence_length
inline const std::vector<int> kTextTaps = {9, 18, 27};  // the pipeline's text_encoder_out_layers

// Refuses a directory that is not a guidance-distilled Flux2KleinPipeline with the component
// classes this implementation reproduces, naming model_index.json and the key.
void check_klein_index(const ModelDir& dir);

// Position ids (T, H, W, L axes) of the text tokens, (0, 0, 0, i), and of the image tokens of an
// h x w latent grid, (0, row, col, 0): i64 [n, 4].
Tensor text_position_ids(int64_t tokens);
Tensor image_position_ids(int64_t h, int64_t w);

}  // namespace apus::flux2
