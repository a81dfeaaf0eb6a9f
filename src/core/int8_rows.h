#pragma once
// The int8 tier's arithmetic (ops/op_list.h, linear with an int8_matmul weight): a row of n values
// as int8 codes with one fp32 scale, and an integer product's row back to fp32. Compiled per ISA;
// the reference backend spells the same operations out on its own (ops/ref/linear.cpp).
#include <cstdint>

namespace apus {

// Largest row length whose int8 dot products fit int32: n * 127 * 127 < 2^31.
constexpr int64_t kInt8MaxDot = 133144;

// q[i] = clamp(nearbyint(x[i] * (127 / a)), -127, 127) with a = max |x[i]|, every step in fp32;
// returns the scale a / 127 (0 for an all-zero row, whose codes are 0), or NaN where the row holds
// a NaN or an infinity (its codes are then left unset).
float quantize_int8_row(const float* x, int64_t n, int8_t* q);

// out[j] = fma(float(acc[j]), row_scale * col_scale[j], bias[j] or 0), the product of the two
// scales rounded to fp32 first.
void int8_products_row(const int32_t* acc, float row_scale, const float* col_scale, const float* bias, float* out,
                       int64_t n);

}  // namespace apus
