#pragma once
// Perceptual distances between two clips for the end-to-end tests: a multi-resolution STFT loss
// (spectral convergence + log-magnitude L1, averaged over three resolutions, as audio codecs and
// vocoders are compared) and a log-mel L1. Plain loops and a radix-2 FFT: clips in the tests are
// seconds long at most.
#include <algorithm>
#include <cmath>
#include <complex>
#include <vector>

namespace apus::test {

// In-place iterative radix-2 FFT; size a power of two.
inline void fft(std::vector<std::complex<double>>& a) {
  const size_t n = a.size();
  for (size_t i = 1, j = 0; i < n; ++i) {
    size_t bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) std::swap(a[i], a[j]);
  }
  for (size_t len = 2; len <= n; len <<= 1) {
    const double ang = -2 * M_PI / double(len);
    const std::complex<double> w(std::cos(ang), std::sin(ang));
    for (size_t i = 0; i < n; i += len) {
      std::complex<double> wk(1);
      for (size_t k = 0; k < len / 2; ++k, wk *= w) {
        const auto u = a[i + k], v = a[i + k + len / 2] * wk;
        a[i + k] = u + v;
        a[i + k + len / 2] = u - v;
      }
    }
  }
}

// |STFT| frames x (n/2 + 1) of one channel of interleaved audio, Hann window, hop n / 4.
inline std::vector<std::vector<double>> magnitudes(const std::vector<float>& x, int channels, int ch, size_t n) {
  const size_t frames_in = x.size() / size_t(channels), hop = n / 4;
  std::vector<std::vector<double>> out;
  for (size_t start = 0; start + n <= frames_in; start += hop) {
    std::vector<std::complex<double>> buf(n);
    for (size_t i = 0; i < n; ++i)
      buf[i] = double(x[(start + i) * size_t(channels) + size_t(ch)]) *
               (0.5 - 0.5 * std::cos(2 * M_PI * double(i) / double(n)));
    fft(buf);
    std::vector<double> mag(n / 2 + 1);
    for (size_t k = 0; k <= n / 2; ++k) mag[k] = std::abs(buf[k]);
    out.push_back(std::move(mag));
  }
  return out;
}

struct AudioDistance {
  double stft = 0;     // mean over resolutions of spectral convergence + log-magnitude L1
  double log_mel = 0;  // mean |log(mel_a + eps) - log(mel_b + eps)| over 40 bands
};

// a against reference b, both interleaved with `channels` channels at `rate` Hz.
inline AudioDistance audio_distance(const std::vector<float>& a, const std::vector<float>& b, int channels, int rate) {
  AudioDistance d;
  const size_t sizes[] = {512, 256, 128};
  const double eps = 1e-7;
  for (size_t n : sizes) {
    double sc = 0, lm = 0;
    for (int ch = 0; ch < channels; ++ch) {
      const auto ma = magnitudes(a, channels, ch, n), mb = magnitudes(b, channels, ch, n);
      double num = 0, den = 0, l1 = 0;
      size_t count = 0;
      for (size_t f = 0; f < ma.size(); ++f)
        for (size_t k = 0; k < ma[f].size(); ++k) {
          num += (ma[f][k] - mb[f][k]) * (ma[f][k] - mb[f][k]);
          den += mb[f][k] * mb[f][k];
          l1 += std::fabs(std::log(ma[f][k] + eps) - std::log(mb[f][k] + eps));
          ++count;
        }
      sc += std::sqrt(num / std::max(den, 1e-30));
      lm += l1 / double(std::max<size_t>(count, 1));
    }
    d.stft += (sc + lm) / double(channels) / double(std::size(sizes));
  }
  // Log-mel: 40 triangular bands up to Nyquist over the 512-point STFT.
  const size_t n = 512, bins = n / 2 + 1, bands = 40;
  auto mel = [](double hz) { return 2595.0 * std::log10(1.0 + hz / 700.0); };
  auto hz = [](double m) { return 700.0 * (std::pow(10.0, m / 2595.0) - 1.0); };
  std::vector<double> edges(bands + 2);
  for (size_t i = 0; i < edges.size(); ++i)
    edges[i] = hz(mel(0) + (mel(rate / 2.0) - mel(0)) * double(i) / double(bands + 1)) * double(n) / rate;
  double total = 0;
  size_t count = 0;
  for (int ch = 0; ch < channels; ++ch) {
    const auto ma = magnitudes(a, channels, ch, n), mb = magnitudes(b, channels, ch, n);
    for (size_t f = 0; f < ma.size(); ++f)
      for (size_t m = 0; m < bands; ++m) {
        double ea = 0, eb = 0;
        for (size_t k = 0; k < bins; ++k) {
          const double x = double(k);
          const double w = x < edges[m] || x > edges[m + 2] ? 0
                           : x <= edges[m + 1]              ? (x - edges[m]) / std::max(edges[m + 1] - edges[m], 1e-9)
                                               : (edges[m + 2] - x) / std::max(edges[m + 2] - edges[m + 1], 1e-9);
          ea += w * ma[f][k] * ma[f][k];
          eb += w * mb[f][k] * mb[f][k];
        }
        total += std::fabs(std::log(ea + eps) - std::log(eb + eps));
        ++count;
      }
  }
  d.log_mel = total / double(std::max<size_t>(count, 1));
  return d;
}

}  // namespace apus::test
