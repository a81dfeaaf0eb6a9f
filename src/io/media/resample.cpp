#include "io/media/resample.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "core/error.h"

namespace apus {

namespace {

constexpr int kZeroCrossings = 6;  // lowpass_filter_width
constexpr double kRolloff = 0.99;

struct SincKernel {
  int64_t orig, next, width, taps;
  std::vector<float> weights;  // [next][taps]
};

// torchaudio's _get_sinc_resample_kernel with dtype None, step for step: the phase offsets
// -j / next formed in float32 (an integer arange divided in the default dtype), everything else in
// float64, the result rounded to float32.
SincKernel sinc_kernel(int64_t from, int64_t to) {
  const int64_t g = std::gcd(from, to);
  SincKernel k;
  k.orig = from / g;
  k.next = to / g;
  const double base = double(std::min(k.orig, k.next)) * kRolloff;
  k.width = int64_t(std::ceil(kZeroCrossings * double(k.orig) / base));
  k.taps = 2 * k.width + k.orig;
  k.weights.resize(size_t(k.next * k.taps));
  const double pi = M_PI, scale = base / double(k.orig);
  for (int64_t j = 0; j < k.next; ++j) {
    const double phase = double(float(-j) / float(k.next));
    for (int64_t i = 0; i < k.taps; ++i) {
      double t = (phase + double(i - k.width) / double(k.orig)) * base;
      t = std::clamp(t, -double(kZeroCrossings), double(kZeroCrossings));
      const double c = std::cos(t * pi / kZeroCrossings / 2);
      const double window = c * c;
      t *= pi;
      const double sinc = t == 0 ? 1.0 : std::sin(t) / t;
      k.weights[size_t(j * k.taps + i)] = float(sinc * (window * scale));
    }
  }
  return k;
}

}  // namespace

std::vector<std::vector<float>> resample(const std::vector<std::vector<float>>& planes, int from, int to,
                                         int64_t max_frames) {
  APUS_CHECK(from > 0 && to > 0, "resample: rates ", from, " -> ", to, " Hz, expected positive rates");
  if (from == to) return planes;
  const int64_t g = std::gcd(int64_t(from), int64_t(to));
  const double taps =
      double(to / g) *
      (2.0 * std::ceil(kZeroCrossings * double(from / g) / (double(std::min(from, to) / g) * kRolloff)) +
       double(from / g));
  APUS_CHECK(taps <= 16e6, "resampling ", from, " Hz to ", to, " Hz needs a ", taps,
             "-tap filter bank (their ratio does not reduce); convert the clip to ", to, " Hz first");
  const SincKernel k = sinc_kernel(from, to);
  std::vector<std::vector<float>> out;
  for (const std::vector<float>& x : planes) {
    const int64_t length = int64_t(x.size());
    // torch.ceil(torch.as_tensor(new * length / orig)): the quotient in double.
    const int64_t n = std::min(max_frames, int64_t(std::ceil(double(k.next * length) / double(k.orig))));
    std::vector<float> y(static_cast<size_t>(n));
    for (int64_t o = 0; o < n; ++o) {
      const int64_t frame = o / k.next, j = o % k.next;
      const float* w = k.weights.data() + j * k.taps;
      // Input index of tap i: frame * orig + i - width (the left padding), zeros outside.
      const int64_t start = frame * k.orig - k.width;
      double acc = 0;
      for (int64_t i = std::max<int64_t>(0, -start); i < k.taps && start + i < length; ++i)
        acc += double(w[i]) * double(x[size_t(start + i)]);
      y[size_t(o)] = float(acc);
    }
    out.push_back(std::move(y));
  }
  return out;
}

}  // namespace apus
