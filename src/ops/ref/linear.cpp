// linear and conv2d as explicit sums in f64.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/scaled_codes.h"
#include "core/tier_rows.h"
#include "ops/ref/ref_ops.h"

namespace apus::ref {

namespace {

// A quantised tier's linear as the op contract writes it: each row of x to codes at the scale
// max |row| / largest (int8: the nearest integer of x * 127 / max |row|, clamped; fp8: fp8_value,
// whose own test in test_fp8.cpp holds it to every value of the format), the weight's codes as
// their values, the sum exact in f64 (int8's integers, fp8's 4-bit products) then rounded to
// fp32, the scales and bias in fp32. A row holding a NaN or an infinity gives NaN.
template <typename Code, typename WeightCode> void tier_linear(const Tensor& x, const Tensor& w, const Tensor* bias,
                                                               Tensor& y, float largest, Code code,
                                                               WeightCode weight_code) {
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  std::vector<double> q(static_cast<size_t>(k));
  for (int64_t i = 0; i < m; ++i) {
    float amax = 0;
    bool finite = true;
    for (int64_t t = 0; t < k; ++t) {
      const float v = float(get(x, i, t));
      finite = finite && std::isfinite(v);
      amax = std::max(amax, std::fabs(v));
    }
    const float x_scale = amax / largest;
    for (int64_t t = 0; t < k; ++t) q[size_t(t)] = amax == 0 ? 0.0 : code(float(get(x, i, t)), largest / amax);
    for (int64_t j = 0; j < n; ++j) {
      if (!finite) {
        put(y, i, j, std::nan(""));
        continue;
      }
      double dot = 0;
      for (int64_t t = 0; t < k; ++t) dot += q[size_t(t)] * weight_code(w.row(j), t);
      const float w_scale = w.encoding.block_scales
                                ? w.encoding.code_scale * w.encoding.block_scales->at(w.encoding.block_row0 + j, 0)
                                : w.encoding.code_scale;
      const float scale = x_scale * w_scale;
      const float v =
          bias ? std::fma(float(dot), scale, float(as(x.dtype, get(rows2d(*bias), 0, j)))) : float(dot) * scale;
      put(y, i, j, v);
    }
  }
}

void linear_int8(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  APUS_CHECK(w.dtype == DType::i8 && w.shape[1] <= kInt8MaxDot, "linear: an int8 tier weight must be i8 with rows of ",
             "at most ", kInt8MaxDot, ", got ", dtype_name(w.dtype), " ", shape_str(w.shape));
  tier_linear(
      x, w, bias, y, 127.0f,
      [](float v, float inv) { return double(std::clamp(std::nearbyint(v * inv), -127.0f, 127.0f)); },
      [](const void* row, int64_t t) { return double(static_cast<const int8_t*>(row)[t]); });
}

void linear_fp8(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  APUS_CHECK(w.dtype == DType::fp8_e4m3, "linear: an fp8 tier weight must be float8_e4m3fn, got ", dtype_name(w.dtype));
  tier_linear(
      x, w, bias, y, kFp8Max, [](float v, float inv) { return double(fp8_value(v, inv)); },
      [](const void* row, int64_t t) { return double(fp8_e4m3_to_f32(static_cast<const uint8_t*>(row)[t])); });
}

}  // namespace

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  APUS_CHECK(x.shape[1] == k && y.shape == Shape({m, n}), "linear: shapes do not agree");
  if (w.encoding.products == Products::int8) {
    linear_int8(x, w, bias, y);
    return;
  }
  if (w.encoding.products == Products::fp8) {
    linear_fp8(x, w, bias, y);
    return;
  }
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = bias ? as(x.dtype, get(rows2d(*bias), 0, j)) : 0.0;
      for (int64_t q = 0; q < k; ++q) s += get(x, i, q) * as(x.dtype, get(w, j, q));
      put(y, i, j, s);
    }
}

void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride, int64_t pad,
            int64_t pad_end) {
  const int64_t n = x.shape[0], ci = x.shape[1], h = x.shape[2], wd = x.shape[3];
  const int64_t co = y.shape[1], ho = y.shape[2], wo = y.shape[3], kh = w.shape[2], kw = w.shape[3];
  APUS_CHECK(w.shape[1] == ci && w.shape[0] == co && y.shape[0] == n && ho == (h + pad + pad_end - kh) / stride + 1 &&
                 wo == (wd + pad + pad_end - kw) / stride + 1,
             "conv2d: shapes do not agree");
  const Tensor wr = w.reshape({co * ci * kh, kw});
  for (int64_t s = 0; s < n; ++s) {
    const Tensor xr = x.reshape({n * ci * h, wd}).rows(s * ci * h, (s + 1) * ci * h);
    Tensor yr = y.reshape({n * co * ho, wo}).rows(s * co * ho, (s + 1) * co * ho);
    for (int64_t o = 0; o < co; ++o)
      for (int64_t r = 0; r < ho; ++r)
        for (int64_t col = 0; col < wo; ++col) {
          double acc = bias ? get(rows2d(*bias), 0, o) : 0.0;
          for (int64_t i = 0; i < ci; ++i)
            for (int64_t a = 0; a < kh; ++a)
              for (int64_t b = 0; b < kw; ++b) {
                const int64_t rr = r * stride + a - pad, cc = col * stride + b - pad;
                if (rr < 0 || rr >= h || cc < 0 || cc >= wd) continue;
                acc += get(xr, i * h + rr, cc) * as(x.dtype, get(wr, (o * ci + i) * kh + a, b));
              }
          put(yr, o * ho + r, col, acc);
        }
  }
}

}  // namespace apus::ref
