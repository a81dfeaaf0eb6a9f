// Tables computed from positions and timesteps: RoPE's cos/sin and the timestep sinusoid.
#include <cmath>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/rows.h"

namespace apus::cpu {

void rope_tables(Context& c, const Tensor& positions, const std::vector<int64_t>& axes, double theta,
                 ops::RopeMath math, Tensor& cos, Tensor& sin) {
  const int64_t s = positions.shape[0];
  int64_t dim = 0;
  for (int64_t a : axes) dim += a;
  APUS_CHECK(positions.rank() == 2 && positions.dtype == DType::i64 && positions.shape[1] == int64_t(axes.size()) &&
                 cos.shape == Shape({s, dim / 2}) && sin.shape == cos.shape && cos.dtype == DType::f32 &&
                 sin.dtype == DType::f32,
             "rope_tables: positions ", shape_str(positions.shape), ", cos ", shape_str(cos.shape), " for ",
             axes.size(), " axes of ", dim);
  parallel_for(s, [&](int64_t r) {
    const int64_t* pos = positions.ptr<int64_t>() + r * int64_t(axes.size());
    float* cr = cos.ptr<float>() + r * (dim / 2);
    float* sr = sin.ptr<float>() + r * (dim / 2);
    int64_t j = 0;
    for (size_t a = 0; a < axes.size(); ++a) {
      const int64_t d = axes[a];
      const float p = float(pos[a]);
      for (int64_t i = 0; i < d / 2; ++i, ++j) {
        if (math == ops::RopeMath::f32) {
          const float angle = p * (1.0f / std::pow(float(theta), float(2 * i) / float(d)));
          cr[j] = std::cos(angle);
          sr[j] = std::sin(angle);
        } else {
          const double angle = double(p) * (1.0 / std::pow(theta, double(2 * i) / double(d)));
          cr[j] = float(std::cos(angle));
          sr[j] = float(std::sin(angle));
        }
      }
    }
  });
}

void timestep_embedding(Context& c, float t, Tensor& y) {
  APUS_CHECK(y.rank() == 2 && y.shape[0] == 1 && y.shape[1] % 2 == 0, "timestep_embedding: y ", shape_str(y.shape),
             ", expected [1, 2H]");
  const int64_t half = y.shape[1] / 2;
  float* v = thread_scratch(0, 2 * half);
  for (int64_t i = 0; i < half; ++i) {
    const float arg = t * std::exp(-std::log(10000.0f) * float(i) / float(half));
    v[i] = std::cos(arg);
    v[half + i] = std::sin(arg);
  }
  store_row(y, 0, v, 2 * half);
}

void fourier_features(Context& c, float t, const Tensor& freqs, Tensor& y) {
  const int64_t half = freqs.numel();
  APUS_CHECK(y.shape == Shape({1, 2 * half}), "fourier_features: freqs ", shape_str(freqs.shape), ", y ",
             shape_str(y.shape), "; expected y [1, ", 2 * half, "]");
  float* f = thread_scratch(0, half);
  load_row(vector_row(freqs), 0, f, half);
  float* v = thread_scratch(1, 2 * half);
  for (int64_t i = 0; i < half; ++i) {
    const float a = t * f[i] * 2.0f * 3.14159265358979323846f;
    v[i] = std::cos(a);
    v[half + i] = std::sin(a);
  }
  store_row(y, 0, v, 2 * half);
}

}  // namespace apus::cpu
