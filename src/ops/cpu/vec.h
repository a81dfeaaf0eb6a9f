#pragma once
// Row kernels the element-wise ops share, compiled for AVX-512, AVX2 and baseline x86-64 and
// chosen at run time (the binary itself is built without -march).
#include <cstdint>

namespace apus::cpu {

// The constants of the row kernels' exp (vec.cpp's exp_in_range: x = n ln2 + r with ln2 in two
// parts, a degree-6 polynomial in r, times 2^n), shared with the AVX-512 band softmax
// (attention.cpp), which must compute the same values lane by lane.
struct ExpConstants {
  static constexpr float log2e = 1.44269504088896341f;
  static constexpr float ln2_high = -0.693145751953125f, ln2_low = -1.428606765330187045e-06f;
  // The polynomial's coefficients, highest power first.
  static constexpr float poly[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
};

void bf16_to_f32_row(const uint16_t* in, float* out, int64_t n);
void f32_to_bf16_row(const float* in, uint16_t* out, int64_t n);
// Whether every value is finite (no NaN, no Inf).
bool finite_row(const float* v, int64_t n);
// v <- silu(v) = v / (1 + exp(-v))
void silu_row(float* v, int64_t n);
// v <- gelu_tanh(v) = v/2 (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), torch's approximate="tanh"
// (computed as v / (1 + exp(-2 sqrt(2/pi) (v + 0.044715 v^3))), the same function)
void gelu_tanh_row(float* v, int64_t n);
// v <- tanh(v)
void tanh_row(float* v, int64_t n);
// v <- sin(v), within 2 ulp of the correctly rounded value (Cody-Waite reduction by pi and an odd
// polynomial; |v| > 8192, where the three-part pi runs out of bits, and non-finite values go to libm).
void sin_row(float* v, int64_t n);
// v <- v rounded to bf16 (nearest, ties to even), kept in f32; NaN stays NaN.
void round_bf16_row(float* v, int64_t n);
// DynamicTanh over a row: v <- gamma[i % group] * tanh(alpha * v) + beta[i % group], each eager
// op's result rounded to bf16 when round_bf16 (alpha * v, the tanh, the product).
void dyt_row(float* v, int64_t n, float alpha, const float* gamma, const float* beta, int64_t group, bool round_bf16);
// RoPE over one row of n channels in heads of head_dim: in each head the pairs (j, j + half)
// (interleaved: (2j, 2j + 1)), j < half, turn by cos[j], sin[j]; rounded: each product and sum
// rounded to bf16, cos and sin too (Qwen's eager rotate_half in bf16).
void rope_row(float* v, int64_t n, int64_t head_dim, const float* cos, const float* sin, int64_t half, bool interleaved,
              bool rounded);
float sum_row(const float* v, int64_t n);
// sum of (v - mean)^2
float squared_deviation_row(const float* v, int64_t n, float mean);
// out = softmax(scale * s) over a row whose masked entries hold -inf (a fully masked row gives
// zeros); s is scratch. Three passes: max, exp and sum, normalise and store.
void softmax_row_f32(float* s, int64_t n, float scale, float* out);
void softmax_row_bf16(float* s, int64_t n, float scale, uint16_t* out);

}  // namespace apus::cpu
