#pragma once
// How far a render is from a reference render, for `apus gate` and the end-to-end tests. Images:
// PSNR over RGB; SSIM (Wang et al. 2004) on BT.601 luma as scikit-image's structural_similarity
// computes it with gaussian_weights (11x11, sigma 1.5), use_sample_covariance false, data_range
// 255, averaged where the window fits; GMSD (Xue et al. 2014), the deviation of the gradient-
// magnitude similarity map, as piq.gmsd computes it (luma, a 2x2 average, Prewitt filters over
// zero padding, c = 170 / 255^2 on [0, 1]): a perceptual distance without a learned network, 0 for
// identical images. Audio: a multi-resolution STFT distance (spectral convergence +
// log-magnitude L1 over three resolutions) and a log-mel L1. Deterministic, plain loops in double.
#include <cstdint>
#include <vector>

#include "apus/apus.h"

namespace apus {

struct ImageScores {
  double psnr = 0;  // dB; 100 for identical images
  double ssim = 0;  // 1 for identical images
  double gmsd = 0;  // 0 for identical images
};
// a against ref, both the same size.
ImageScores image_scores(const Rgb8Image& a, const Rgb8Image& ref);

struct AudioScores {
  double stft = 0;     // mean over resolutions of spectral convergence + log-magnitude L1
  double log_mel = 0;  // mean |log(mel_a + eps) - log(mel_ref + eps)| over 40 bands
};
// a against ref, both interleaved with `channels` channels at `rate` Hz, the same length; the
// STFT sizes are 512, 256 and 128 samples (hop a quarter), the mel bands span 0 .. rate / 2.
AudioScores audio_scores(const std::vector<float>& a, const std::vector<float>& ref, int channels, int rate);

}  // namespace apus
