#include "core/tier_rows.h"

#include <cmath>
#include <limits>

#include "core/clones.h"

namespace apus {

namespace {

// A row's codes code(x[i], largest / max |x|) into q and its scale max |x| / largest: 0 and zeros
// for a row of zeros, NaN (q unset) for a row holding a NaN or an infinity. Inlined into each
// clone of its callers, so it is vectorised for each.
template <typename Q, typename Code>
[[gnu::always_inline]] inline float quantize_row(const float* x, int64_t n, float largest, Q* q, Code code) {
  float amax = 0;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax ? a : amax;
    finite &= a <= std::numeric_limits<float>::max();
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0) {
    for (int64_t i = 0; i < n; ++i) q[i] = 0;
    return 0;
  }
  const float inv = largest / amax;
  for (int64_t i = 0; i < n; ++i) q[i] = code(x[i], inv);
  return amax / largest;
}

// out[j] = scaled_sum(float(sums[j]), row_scale, col_scale[j], bias + j or null).
template <typename Sum> [[gnu::always_inline]] inline void products_row(const Sum* sums, float row_scale,
                                                                        const float* col_scale, const float* bias,
                                                                        float* out, int64_t n) {
  if (bias) {
    for (int64_t j = 0; j < n; ++j) out[j] = scaled_sum(float(sums[j]), row_scale, col_scale[j], bias + j);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = scaled_sum(float(sums[j]), row_scale, col_scale[j], nullptr);
  }
}

}  // namespace

APUS_CLONES float quantize_int8_row(const float* x, int64_t n, int8_t* q) {
  return quantize_row(x, n, 127.0f, q, [](float v, float inv) { return int8_code(v, inv); });
}

APUS_CLONES void int8_products_row(const int32_t* acc, float row_scale, const float* col_scale, const float* bias,
                                   float* out, int64_t n) {
  products_row(acc, row_scale, col_scale, bias, out, n);
}

APUS_CLONES float quantize_fp8_row(const float* x, int64_t n, float* q) {
  return quantize_row(x, n, kFp8Max, q, [](float v, float inv) { return fp8_value(v, inv); });
}

APUS_CLONES void fp8_products_row(const float* sums, float row_scale, const float* col_scale, const float* bias,
                                  float* out, int64_t n) {
  products_row(sums, row_scale, col_scale, bias, out, n);
}

}  // namespace apus
