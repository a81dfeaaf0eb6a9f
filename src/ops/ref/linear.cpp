// linear and conv2d as explicit sums in f64.
#include "ops/ref/ref_ops.h"

namespace apus::ref {

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  APUS_CHECK(x.shape[1] == k && y.shape == Shape({m, n}), "linear: shapes do not agree");
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
