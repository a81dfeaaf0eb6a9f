#include "models/sa3/fourier.h"

#include <cmath>

#include "sampling/logsnr.h"

namespace apus::sa3 {

Tensor expo_fourier_frequencies(int64_t n, double min_freq, double max_freq) {
  Tensor f = Tensor::heap({n}, DType::f32);
  const std::vector<float> ramp = torch_linspace(0.0f, 1.0f, n);
  const float lo = float(std::log(min_freq)), span = float(std::log(max_freq) - std::log(min_freq));
  for (int64_t i = 0; i < n; ++i) {
    const float product = ramp[size_t(i)] * span;
    f.ptr<float>()[i] = float(std::exp(double(product + lo)));
  }
  return f;
}

}  // namespace apus::sa3
