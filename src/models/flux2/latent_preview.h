#pragma once
// A cheap look at klein's packed latents mid-sampling: each token's 2x2 latent pixels as colours,
// through an affine map of the token fitted to the model's own VAE: least squares of the mean
// colour of each quarter of a token's pixels on the token, over two decoded 16x16-token grids of
// unit normal latents (the batch-normed latents' scale). One-token decodes would not do: the
// decoder's GroupNorms normalise over the whole image. How well it shows a trained VAE's colours
// is not measured here (the test models' random VAEs are barely linear in their latents).
#include <cstdint>
#include <vector>

#include "apus/apus.h"
#include "core/tensor.h"
#include "models/flux2/vae_decoder.h"

namespace apus::flux2 {

class LatentPreview {
 public:
  // One decode of two 256x256-pixel images and a (packed_channels + 1)^2 solve.
  static LatentPreview fit(const VaeDecoder& vae, Backend* device);
  // The fit on given tokens [grids * side * side, packed_channels] (f32, row-major grids) and
  // their images [grids, colours, side * pixels_per_token, same] (f32, [-1, 1]).
  static LatentPreview fit_to(const Tensor& tokens, const std::vector<float>& images, int64_t side,
                              int64_t pixels_per_token);
  // tokens: [h * w, packed_channels] f32, row-major grid -> 2h x 2w pixels.
  Rgb8Image image(const float* tokens, int64_t h, int64_t w) const;

 private:
  int64_t channels_ = 0;
  std::vector<float> bias_;  // [4 quarters][3]: the zero token's colours
  std::vector<float> gain_;  // [4 quarters][3][channels]
};

}  // namespace apus::flux2
