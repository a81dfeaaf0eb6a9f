#include "core/tier_rows.h"

#include <cmath>
#include <limits>

#include "core/clones.h"

namespace apus {

APUS_CLONES float quantize_int8_row(const float* x, int64_t n, int8_t* q) {
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
  const float inv = 127.0f / amax;
  for (int64_t i = 0; i < n; ++i) q[i] = int8_code(x[i], inv);
  return amax / 127.0f;
}

APUS_CLONES void int8_products_row(const int32_t* acc, float row_scale, const float* col_scale, const float* bias,
                                   float* out, int64_t n) {
  if (bias) {
    for (int64_t j = 0; j < n; ++j) out[j] = scaled_sum(float(acc[j]), row_scale, col_scale[j], bias + j);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = scaled_sum(float(acc[j]), row_scale, col_scale[j], nullptr);
  }
}

APUS_CLONES float quantize_fp8_row(const float* x, int64_t n, float* q) {
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
  const float inv = kFp8Max / amax;
  for (int64_t i = 0; i < n; ++i) q[i] = fp8_value(x[i], inv);
  return amax / kFp8Max;
}

APUS_CLONES void fp8_products_row(const float* sums, float row_scale, const float* col_scale, const float* bias,
                                  float* out, int64_t n) {
  if (bias) {
    for (int64_t j = 0; j < n; ++j) out[j] = scaled_sum(sums[j], row_scale, col_scale[j], bias + j);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = scaled_sum(sums[j], row_scale, col_scale[j], nullptr);
  }
}

}  // namespace apus
