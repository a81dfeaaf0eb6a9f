#include <cmath>
#include <vector>

#include "ops/cpu/rows.h"
#include "ops/cpu/cpu_ops.h"

namespace apus::cpu {


void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale,
                         Tensor& y, float eps) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(y.shape == x.shape && shift.numel() == d && scale.numel() == d,
             "layer_norm_modulate: x ", shape_str(x.shape), ", shift ", shape_str(shift.shape),
             ", scale ", shape_str(scale.shape), ", y ", shape_str(y.shape));
  std::vector<float> sh(static_cast<size_t>(d)), sc(static_cast<size_t>(d));
  cpu::load_vec(shift, sh.data());
  cpu::load_vec(scale, sc.data());
  // The reference computes (1 + scale) * LN(x) + shift as three rounded ops.
  for (auto& v : sc) v += 1.0f;
  cpu::round_to(y.dtype, sc.data(), d);
  const bool rounded = y.dtype != DType::f32;
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(d));
#pragma omp for
    for (int64_t r = 0; r < m; ++r) {
      load_row(x, r, row.data(), d);
      const float mu = sum_row(row.data(), d) / float(d);
      const float var = squared_deviation_row(row.data(), d, mu) / float(d);
      const float rstd = 1.0f / std::sqrt(var + eps);
      for (int64_t i = 0; i < d; ++i) {
        float v = (row[i] - mu) * rstd;
        if (rounded) v = round_bf16(round_bf16(round_bf16(v) * sc[i]) + sh[i]);
        else v = v * sc[i] + sh[i];
        row[i] = v;
      }
      store_row(y, r, row.data(), d);
    }
  }
}

void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps,
              int64_t group, bool round_before_weight) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(y.shape == x.shape && d % group == 0 && weight.numel() == group,
             "rms_norm: x ", shape_str(x.shape), ", weight ", shape_str(weight.shape),
             ", group ", group);
  std::vector<float> w(static_cast<size_t>(group));
  cpu::load_vec(weight, w.data());
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(d));
#pragma omp for
    for (int64_t r = 0; r < m; ++r) {
      load_row(x, r, row.data(), d);
      for (int64_t g = 0; g < d; g += group) {
        float* v = row.data() + g;
        float ss = 0;
        for (int64_t i = 0; i < group; ++i) ss += v[i] * v[i];
        const float rs = 1.0f / std::sqrt(ss / float(group) + eps);
        for (int64_t i = 0; i < group; ++i) v[i] *= rs;
        if (round_before_weight) cpu::round_to(y.dtype, v, group);
        for (int64_t i = 0; i < group; ++i) v[i] *= w[i];
      }
      store_row(y, r, row.data(), d);
    }
  }
}

void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                int64_t groups, float eps, bool fuse_silu) {
  const int64_t ch = x.shape[1], hw = x.shape[2] * x.shape[3];
  APUS_CHECK(x.rank() == 4 && x.shape[0] == 1 && ch % groups == 0 && y.shape == x.shape,
             "group_norm: x ", shape_str(x.shape), " with ", groups, " groups");
  std::vector<float> w(static_cast<size_t>(ch)), b(static_cast<size_t>(ch));
  cpu::load_vec(weight, w.data());
  cpu::load_vec(bias, b.data());
  const int64_t per = ch / groups;
  const Tensor xr = x.reshape({ch, hw});
  Tensor yr = y.reshape({ch, hw});
#pragma omp parallel
  {
    std::vector<float> buf(static_cast<size_t>(per * hw));
#pragma omp for
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < per; ++j) load_row(xr, g * per + j, buf.data() + j * hw, hw);
      // Per-channel partial sums in float (vectorised), combined in double.
      double total = 0;
      for (int64_t j = 0; j < per; ++j) total += sum_row(buf.data() + j * hw, hw);
      const float mean = float(total / double(buf.size()));
      double dev = 0;
      for (int64_t j = 0; j < per; ++j) dev += squared_deviation_row(buf.data() + j * hw, hw, mean);
      const float rstd = float(1.0 / std::sqrt(dev / double(buf.size()) + eps));
      for (int64_t j = 0; j < per; ++j) {
        float* v = buf.data() + j * hw;
        const int64_t cidx = g * per + j;
        const float a = rstd * w[cidx], b0 = b[cidx] - mean * a;
        for (int64_t i = 0; i < hw; ++i) v[i] = v[i] * a + b0;
        if (fuse_silu) {
          cpu::round_to(y.dtype, v, hw);  // the reference rounds between GroupNorm and SiLU
          silu_row(v, hw);
        }
        store_row(yr, cidx, v, hw);
      }
    }
  }
}

}  // namespace apus::cpu
