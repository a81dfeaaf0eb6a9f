// The element-wise and data-movement ops.
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/ref/ref_ops.h"

namespace apus::ref {

void glu(Context& c, const Tensor& a, const Tensor& b, Tensor& y, ops::Activation act, ops::Rounding rounding) {
  for (int64_t r = 0; r < a.shape[0]; ++r)
    for (int64_t i = 0; i < a.shape[1]; ++i) {
      const double x = get(a, r, i);
      const bool each = rounding == ops::Rounding::each_step;
      double s = act == ops::Activation::silu ? silu(x)
                 : act == ops::Activation::gelu_tanh
                     ? gelu_tanh(x)
                     : std::sin(as(each ? y.dtype : DType::f32, double(float(M_PI) * float(x))));
      if (each) s = as(y.dtype, s);
      put(y, r, i, s * get(b, r, i));
    }
}

void silu(Context& c, const Tensor& x, Tensor& y) {
  const Tensor xr = rows2d(x);
  Tensor yr = y.shape == xr.shape ? y : y.reshape(xr.shape);
  for (int64_t r = 0; r < xr.shape[0]; ++r)
    for (int64_t i = 0; i < xr.shape[1]; ++i) put(yr, r, i, silu(get(xr, r, i)));
}

void add_gated(Context& c, Tensor& x, const Tensor& y, const Tensor* gate, ops::Rounding rounding) {
  const Tensor g = gate ? (gate->rank() == 2 ? *gate : rows2d(*gate)) : Tensor{};
  const int64_t per_sample = gate ? x.shape[0] / g.shape[0] : 1;
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      double t = get(y, r, i);
      if (gate) {
        t *= get(g, r / per_sample, i);
        if (rounding == ops::Rounding::each_step) t = as(x.dtype, t);
      }
      put(x, r, i, get(x, r, i) + t);
    }
}

void dyt(Context& c, const Tensor& x, const Tensor& alpha, const Tensor& gamma, const Tensor& beta, Tensor& y,
         ops::Rounding rounding) {
  const bool each = rounding == ops::Rounding::each_step;
  const Tensor g = rows2d(gamma), b = rows2d(beta);
  const double a = get(rows2d(alpha), 0, 0);
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      double v = a * get(x, r, i);
      if (each) v = as(y.dtype, v);
      v = std::tanh(v);
      if (each) v = as(y.dtype, v);
      const int64_t group = g.numel();
      v *= get(g, 0, i % group);
      if (each) v = as(y.dtype, v);
      put(y, r, i, v + get(b, 0, i % group));
    }
}

void gate_sigmoid(Context& c, const Tensor& x, Tensor& y, ops::Rounding rounding) {
  const Tensor xr = x.rank() == 2 ? x : rows2d(x);
  Tensor yr = y.rank() == 2 ? y : rows2d(y);
  for (int64_t r = 0; r < xr.shape[0]; ++r)
    for (int64_t i = 0; i < xr.shape[1]; ++i) {
      double t = 1.0 - get(xr, r, i);
      if (rounding == ops::Rounding::each_step) t = as(y.dtype, t);
      put(yr, r, i, 1.0 / (1.0 + std::exp(-t)));
    }
}

void pingpong_update(Context& c, Tensor& x, const Tensor& velocity, const Tensor& noise, float t, float t_next) {
  const DType dt = x.dtype;
  const double keep = as(dt, 1.0 - double(t_next));
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      const double denoised = as(dt, get(x, r, i) - as(dt, double(t) * get(velocity, r, i)));
      put(x, r, i, as(dt, keep * denoised) + as(dt, double(t_next) * get(noise, r, i)));
    }
}

void blend(Context& c, const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y) {
  const DType dt = y.dtype;
  for (int64_t r = 0; r < y.shape[0]; ++r) {
    const double wr = as(dt, double(w.ptr<float>()[w.numel() == 1 ? 0 : r]));
    const double keep = as(dt, 1.0 - wr);
    for (int64_t i = 0; i < y.shape[1]; ++i) put(y, r, i, as(dt, keep * get(a, r, i)) + as(dt, wr * get(b, r, i)));
  }
}

void guided_velocity(Context& c, const Tensor& x, const Tensor& cond, const Tensor& uncond, Tensor& y, float sigma,
                     float scale, float apg, int64_t batch, int64_t valid) {
  const int64_t rows = x.shape[0], ch = x.shape[1], t = rows / batch;
  const DType dt = y.dtype;
  std::vector<double> dc(size_t(rows * ch)), diff(size_t(rows * ch));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < ch; ++k) {
      const double xv = get(x, i, k);
      const double d_c = as(dt, xv - as(dt, get(cond, i, k) * sigma));
      dc[size_t(i * ch + k)] = d_c;
      diff[size_t(i * ch + k)] = as(dt, d_c - as(dt, xv - as(dt, get(uncond, i, k) * sigma)));
    }
  for (int64_t b = 0; b < batch; ++b) {
    double* pc = dc.data() + b * t * ch;
    double* pd = diff.data() + b * t * ch;
    if (apg != 0) {
      double sq = 0, dot = 0;
      for (int64_t i = 0; i < valid * ch; ++i) sq += pc[i] * pc[i];
      const double norm = std::max(std::sqrt(sq), 1e-8);
      for (int64_t i = 0; i < valid * ch; ++i) dot += pd[i] * pc[i] / norm;
      for (int64_t i = 0; i < t * ch; ++i) {
        const double orth = i < valid * ch ? pd[i] - dot * pc[i] / norm : 0.0;
        pd[i] = apg == 1 ? as(dt, orth) : as(dt, as(dt, apg * orth) + as(dt, (1 - double(apg)) * pd[i]));
      }
    }
    for (int64_t i = 0; i < t * ch; ++i) pd[i] = as(dt, pc[i] + as(dt, (double(scale) - 1) * pd[i]));
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < ch; ++k) put(y, i, k, as(dt, get(x, i, k) - diff[size_t(i * ch + k)]) / sigma);
}

void euler_update(Context& c, Tensor& x, const Tensor& velocity, float step) {
  const bool bf16 = velocity.dtype == DType::bf16;
  const double dt = bf16 ? as(DType::bf16, step) : double(step);
  for (int64_t r = 0; r < x.shape[0]; ++r)
    for (int64_t i = 0; i < x.shape[1]; ++i) {
      const double d = dt * get(velocity, r, i);
      put(x, r, i, get(x, r, i) + (bf16 ? as(DType::bf16, d) : d));
    }
}

void copy(Context& c, const Tensor& x, Tensor& y) {
  const Tensor xr = rows2d(x);
  Tensor yr = y.shape == xr.shape ? y : y.reshape(xr.shape);
  for (int64_t r = 0; r < xr.shape[0]; ++r)
    for (int64_t i = 0; i < xr.shape[1]; ++i) put(yr, r, i, get(xr, r, i));
}

bool all_finite(Context& c, const Tensor& x) {
  const Tensor xr = rows2d(x);
  for (int64_t r = 0; r < xr.shape[0]; ++r)
    for (int64_t i = 0; i < xr.shape[1]; ++i)
      if (!std::isfinite(get(xr, r, i))) return false;
  return true;
}

void nonfinite_flag(Context& c, const Tensor& x, Tensor& flags, int64_t slot) {
  check_flag_slot(flags, slot);
  flags.ptr<int32_t>()[slot] = all_finite(c, x) ? 0 : 1;
}

void transpose(Context& c, const Tensor& x, Tensor& y) {
  const int64_t m = x.shape[0], n = x.shape[1];
  const size_t es = dtype_size(x.dtype);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(static_cast<char*>(y.data) + size_t(j * m + i) * es,
                  static_cast<const char*>(x.data) + size_t(i * n + j) * es, es);
}

void rope(Context& c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim, ops::RopeStyle style,
          ops::Rounding rounding) {
  const int64_t s = x.shape[0], d = x.shape[1], half = cos.shape[1];
  APUS_CHECK(2 * half <= head_dim && d % head_dim == 0, "rope: table wider than a head");
  const bool each = rounding == ops::Rounding::each_step;
  const DType dt = x.dtype;
  std::vector<double> row(static_cast<size_t>(d));
  for (int64_t r = 0; r < s; ++r) {
    for (int64_t i = 0; i < d; ++i) row[size_t(i)] = get(x, r, i);
    for (int64_t h = 0; h < d; h += head_dim)
      for (int64_t j = 0; j < half; ++j) {
        const int64_t i0 = h + (style == ops::RopeStyle::interleaved ? 2 * j : j);
        const int64_t i1 = h + (style == ops::RopeStyle::interleaved ? 2 * j + 1 : j + half);
        const double x0 = row[size_t(i0)], x1 = row[size_t(i1)];
        const int64_t tr = r % cos.shape[0];
        const double cs = each ? as(dt, get(cos, tr, j)) : get(cos, tr, j);
        const double sn = each ? as(dt, get(sin, tr, j)) : get(sin, tr, j);
        put(x, r, i0, each ? as(dt, x0 * cs) + as(dt, -x1 * sn) : x0 * cs - x1 * sn);
        put(x, r, i1, each ? as(dt, x1 * cs) + as(dt, x0 * sn) : x1 * cs + x0 * sn);
      }
  }
}

void upsample_nearest2x(Context& c, const Tensor& x, Tensor& y) {
  const int64_t ch = x.shape[0] * x.shape[1], h = x.shape[2], w = x.shape[3];
  const Tensor xr = x.reshape({ch * h, w});
  Tensor yr = y.reshape({ch * 2 * h, 2 * w});
  for (int64_t ci = 0; ci < ch; ++ci)
    for (int64_t i = 0; i < 2 * h; ++i)
      for (int64_t j = 0; j < 2 * w; ++j) put(yr, ci * 2 * h + i, j, get(xr, ci * h + i / 2, j / 2));
}

}  // namespace apus::ref
