#pragma once
// The CPU backend: one function per op, same signatures as src/ops/ops.h, which records the
// cost and dispatches here. Files: linear (oneDNN matmul), conv (oneDNN), attention, norm,
// elementwise.
#include "ops/ops.h"

namespace apus::cpu {

using ops::AttentionMask;
using ops::RopeStyle;

// C[M,N] = A[M,K] · B (+ bias) through oneDNN; B is given by its strides (row-major [K,N] or a
// transposed [N,K] weight); all strides in elements; fp32 accumulation.
void gemm(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n,
          const Tensor* bias, Tensor& c, int64_t k, int64_t n);

// Kernel variant knobs, read at each call so a benchmark can A/B them in one process.
enum class ConvLayout { plain, blocked };
extern bool allow_native_bf16;  // off: take the f32 path an AVX2-only CPU takes
extern ConvLayout conv_layout;
extern int64_t attention_query_block;  // query rows per attention task

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);
void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale,
                         Tensor& y, float eps);
void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps,
              int64_t group, bool round_before_weight);
void rope(Context& c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
          RopeStyle style);
void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
               int64_t head_dim, float scale, const AttentionMask& mask);
void silu_mul(Context& c, const Tensor& a, const Tensor& b, Tensor& y);
void silu(Context& c, const Tensor& x, Tensor& y);
void add_gated(Context& c, Tensor& x, const Tensor& y, const Tensor* gate);
void euler_update(Context& c, Tensor& x, const Tensor& velocity, float step);
void copy(Context& c, const Tensor& x, Tensor& y);
bool all_finite(Context& c, const Tensor& x);
void transpose(Context& c, const Tensor& x, Tensor& y);
void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
            int64_t stride, int64_t pad);
void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                int64_t groups, float eps, bool fuse_silu);
void upsample_nearest2x(Context& c, const Tensor& x, Tensor& y);

}  // namespace apus::cpu
