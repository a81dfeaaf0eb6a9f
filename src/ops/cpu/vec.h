#pragma once
// Row kernels the element-wise ops share, compiled for AVX-512, AVX2 and baseline x86-64 and
// chosen at run time (the binary itself is built without -march).
#include <cstdint>

namespace apus::cpu {

void bf16_to_f32_row(const uint16_t* in, float* out, int64_t n);
void f32_to_bf16_row(const float* in, uint16_t* out, int64_t n);
// v <- silu(v) = v / (1 + exp(-v))
void silu_row(float* v, int64_t n);
float sum_row(const float* v, int64_t n);
// sum of (v - mean)^2
float squared_deviation_row(const float* v, int64_t n, float mean);
// exp(x) for x <= 0 (softmax after subtracting the row maximum); 0 below -87 and at -inf
void exp_nonpositive_row(float* v, int64_t n);

}  // namespace apus::cpu
