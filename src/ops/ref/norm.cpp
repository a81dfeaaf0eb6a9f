// The normalisations, with each sub-step's rounding where the op's Rounding asks for it.
#include <cmath>
#include <vector>

#include "ops/ref/ref_ops.h"

namespace apus::ref {

void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, float eps,
                         ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  const bool each = rounding == ops::Rounding::each_step;
  // [D] for every row, or [B, D]: sample b covers rows b*m/B .. (b+1)*m/B.
  const Tensor sh = shift.rank() == 2 ? shift : rows2d(shift);
  const Tensor sc = scale.rank() == 2 ? scale : rows2d(scale);
  const int64_t per_sample = m / sh.shape[0];
  for (int64_t r = 0; r < m; ++r) {
    double mu = 0, var = 0;
    for (int64_t i = 0; i < d; ++i) mu += get(x, r, i);
    mu /= double(d);
    for (int64_t i = 0; i < d; ++i) var += (get(x, r, i) - mu) * (get(x, r, i) - mu);
    const double rstd = 1.0 / std::sqrt(var / double(d) + double(eps));
    for (int64_t i = 0; i < d; ++i) {
      const double v = (get(x, r, i) - mu) * rstd, s = 1.0 + get(sc, r / per_sample, i);
      const double t = get(sh, r / per_sample, i);
      put(y, r, i, each ? as(y.dtype, as(y.dtype, as(y.dtype, v) * as(y.dtype, s)) + t) : v * s + t);
    }
  }
}

void modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y,
              ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  const bool each = rounding == ops::Rounding::each_step;
  const Tensor sh = shift.rank() == 2 ? shift : rows2d(shift);
  const Tensor sc = scale.rank() == 2 ? scale : rows2d(scale);
  const int64_t per_sample = m / sh.shape[0];
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < d; ++i) {
      const double v = get(x, r, i), s = 1.0 + get(sc, r / per_sample, i);
      const double t = get(sh, r / per_sample, i);
      put(y, r, i, each ? as(y.dtype, as(y.dtype, v * as(y.dtype, s)) + t) : v * s + t);
    }
}

void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps, int64_t group,
              ops::Rounding rounding) {
  const int64_t m = x.shape[0], d = x.shape[1];
  APUS_CHECK(d % group == 0 && weight.numel() == group, "rms_norm: shapes do not agree");
  const Tensor w = weight.reshape({1, group});
  std::vector<double> row(static_cast<size_t>(d));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < d; ++i) row[size_t(i)] = get(x, r, i);  // x and y may alias
    for (int64_t g = 0; g < d; g += group) {
      double ss = 0;
      for (int64_t i = 0; i < group; ++i) ss += row[size_t(g + i)] * row[size_t(g + i)];
      const double rs = 1.0 / std::sqrt(ss / double(group) + double(eps));
      for (int64_t i = 0; i < group; ++i) {
        double v = row[size_t(g + i)] * rs;
        if (rounding == ops::Rounding::each_step) v = as(y.dtype, v);
        put(y, r, g + i, v * get(w, 0, i));
      }
    }
  }
}

void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, int64_t groups,
                float eps, bool fuse_silu, ops::Rounding rounding) {
  const int64_t n = x.shape[0], ch = x.shape[1], hw = x.shape[2] * x.shape[3], per = ch / groups;
  APUS_CHECK(ch % groups == 0 && y.shape == x.shape, "group_norm: shapes do not agree");
  const Tensor w = weight.reshape({1, ch}), b = bias.reshape({1, ch});
  for (int64_t s = 0; s < n; ++s) {
    const Tensor xr = x.reshape({n * ch, hw}).rows(s * ch, (s + 1) * ch);
    Tensor yr = y.reshape({n * ch, hw}).rows(s * ch, (s + 1) * ch);
    for (int64_t g = 0; g < groups; ++g) {
      double mean = 0, var = 0;
      for (int64_t j = g * per; j < (g + 1) * per; ++j)
        for (int64_t i = 0; i < hw; ++i) mean += get(xr, j, i);
      mean /= double(per * hw);
      for (int64_t j = g * per; j < (g + 1) * per; ++j)
        for (int64_t i = 0; i < hw; ++i) var += (get(xr, j, i) - mean) * (get(xr, j, i) - mean);
      const double rstd = 1.0 / std::sqrt(var / double(per * hw) + double(eps));
      for (int64_t j = g * per; j < (g + 1) * per; ++j)
        for (int64_t i = 0; i < hw; ++i) {
          double v = (get(xr, j, i) - mean) * rstd * get(w, 0, j) + get(b, 0, j);
          if (fuse_silu) v = silu(rounding == ops::Rounding::each_step ? as(y.dtype, v) : v);
          put(yr, j, i, v);
        }
    }
  }
}

}  // namespace apus::ref
