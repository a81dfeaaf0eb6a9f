#pragma once
// The quantised tiers' arithmetic (ops/op_list.h, linear with a weight of int8 or fp8 products): a
// row of n values as codes with one fp32 scale (int8, or float8_e4m3fn values), and a row of sums
// back to fp32. Compiled per ISA; the reference backend spells the same operations out on its own
// (ops/ref/linear.cpp). The element steps are host/device functions, so the GPU's tiers compute
// the same bits.
#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace apus {

// Largest row length whose int8 dot products fit int32: n * 127 * 127 < 2^31.
constexpr int64_t kInt8MaxDot = 133144;

// One code of a row whose inv = 127 / max |row|: clamp(nearbyint(x * inv), -127, 127) in fp32
// (round half to even). Shared with the GPU's row quantisation (ops/cuda/tier_linear.cu).
APUS_HD inline int8_t int8_code(float x, float inv) {
  const float c = rintf(x * inv);
  return int8_t(c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c));
}

// One output of a tier's product from its sum of code products: fma(sum, row_scale * col_scale,
// bias) with the scales' product rounded first; without a bias the product alone.
APUS_HD inline float scaled_sum(float sum, float row_scale, float col_scale, const float* bias) {
  return bias ? fmaf(sum, row_scale * col_scale, *bias) : sum * (row_scale * col_scale);
}

// float8_e4m3fn's largest value: the fp8 tier scales a row's largest magnitude to it.
constexpr float kFp8Max = 448.0f;

// The float8_e4m3fn value nearest x * inv (round half to even; 3 mantissa bits, subnormals in
// steps of 2^-9 below 2^-6), saturated to +-448: one code of a row whose inv = 448 / max |row|.
// Every step is exact in fp32 but the product and the rounding to the format.
APUS_HD inline float fp8_value(float x, float inv) {
  const float t = x * inv, a = fabsf(t);
  int e = int(f32_bits(a) >> 23 & 0xff) - 127;  // a's binade (-127 for zero and fp32 subnormals)
  e = e > -6 ? e : -6;
  float v = rintf(a * exp2i(3 - e)) * exp2i(e - 3);
  v = v > kFp8Max ? kFp8Max : v;
  return t < 0 ? -v : v;
}

// The float8_e4m3fn byte of a value of the format (fp8_value's): fp8_e4m3_to_f32's inverse.
APUS_HD inline uint8_t fp8_e4m3_code(float v) {
  const uint32_t u = f32_bits(v);
  const uint8_t sign = uint8_t(u >> 24 & 0x80);
  const float a = fabsf(v);
  if (a < 0.015625f) return uint8_t(sign | uint8_t(a * 512.0f));  // zero and subnormals: k * 2^-9
  return uint8_t(sign | (int(u >> 23 & 0xff) - 127 + 7) << 3 | (u >> 20 & 7));
}

// q[i] = clamp(nearbyint(x[i] * (127 / a)), -127, 127) with a = max |x[i]|, every step in fp32;
// returns the scale a / 127 (0 for an all-zero row, whose codes are 0), or NaN where the row holds
// a NaN or an infinity (its codes are then left unset).
float quantize_int8_row(const float* x, int64_t n, int8_t* q);

// out[j] = scaled_sum(float(acc[j]), row_scale, col_scale[j], bias + j or null).
void int8_products_row(const int32_t* acc, float row_scale, const float* col_scale, const float* bias, float* out,
                       int64_t n);

// q[i] = fp8_value(x[i], 448 / a) with a = max |x[i]|, in fp32; returns the scale a / 448 (0 for
// an all-zero row, whose values are 0), or NaN where the row holds a NaN or an infinity (q is
// then left unset). q may be x.
float quantize_fp8_row(const float* x, int64_t n, float* q);

// out[j] = scaled_sum(sums[j], row_scale, col_scale[j], bias + j or null); out may be sums.
void fp8_products_row(const float* sums, float row_scale, const float* col_scale, const float* bias, float* out,
                      int64_t n);

}  // namespace apus
