#pragma once
// The int8 tier's arithmetic (ops/op_list.h, linear with an int8_matmul weight): a row of n values
// as int8 codes with one fp32 scale, and an integer product's row back to fp32. Compiled per ISA;
// the reference backend spells the same operations out on its own (ops/ref/linear.cpp).
// The element steps are host/device functions, so the GPU's tier computes the same bits.
#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace apus {

// Largest row length whose int8 dot products fit int32: n * 127 * 127 < 2^31.
constexpr int64_t kInt8MaxDot = 133144;

// One code of a row whose inv = 127 / max |row|: clamp(nearbyint(x * inv), -127, 127) in fp32
// (round half to even). Shared with the GPU's row quantisation (ops/cuda/int8_linear.cu).
APUS_HD inline int8_t int8_code(float x, float inv) {
  const float c = rintf(x * inv);
  return int8_t(c > 127.0f ? 127.0f : (c < -127.0f ? -127.0f : c));
}

// One output of an integer product: fma(float(acc), row_scale * col_scale, bias) with the scales'
// product rounded first; without a bias the product alone.
APUS_HD inline float int8_product(int32_t acc, float row_scale, float col_scale, const float* bias) {
  return bias ? fmaf(float(acc), row_scale * col_scale, *bias) : float(acc) * (row_scale * col_scale);
}

// q[i] = clamp(nearbyint(x[i] * (127 / a)), -127, 127) with a = max |x[i]|, every step in fp32;
// returns the scale a / 127 (0 for an all-zero row, whose codes are 0), or NaN where the row holds
// a NaN or an infinity (its codes are then left unset).
float quantize_int8_row(const float* x, int64_t n, int8_t* q);

// out[j] = fma(float(acc[j]), row_scale * col_scale[j], bias[j] or 0), the product of the two
// scales rounded to fp32 first.
void int8_products_row(const int32_t* acc, float row_scale, const float* col_scale, const float* bias, float* out,
                       int64_t n);

}  // namespace apus
