#pragma once
// The CPU backend: every op of ops/op_list.h (backend.cpp puts them behind the Backend interface).
// Files: linear (oneDNN matmul), conv (oneDNN), attention, norm, elementwise.
#include "ops/ops.h"

namespace apus::cpu {


// C[M,N] = A[M,K] · B (+ bias) through oneDNN; B is given by its strides (row-major [K,N] or a
// transposed [N,K] weight); all strides in elements; fp32 accumulation.
void gemm(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n,
          const Tensor* bias, Tensor& c, int64_t k, int64_t n);

// Kernel variant knobs, read at each call so a benchmark can A/B them in one process.
enum class ConvLayout { plain, blocked };
extern bool allow_native_bf16;  // off: take the f32 path an AVX2-only CPU takes
extern ConvLayout conv_layout;
extern int64_t attention_query_block;  // query rows per attention task

APUS_DECLARE_OPS

}  // namespace apus::cpu
