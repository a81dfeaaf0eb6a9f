#pragma once
// The op list: every op once, with its contract. ops.h declares the front end from it, each
// backend (src/ops/<name>/) declares and implements the same entries, and the Backend interface
// (ops/backend.h) is generated from it, so adding an op is one line here plus one function per
// backend.
//
// Contract for all ops: inputs are read in their stored dtype (f32, bf16, f16), arithmetic is
// fp32 (the reference backend: f64), outputs are rounded once to their dtype unless the op's
// Rounding argument says the reference rounds sub-steps too. Ops never allocate their outputs:
// callers pass them. Layout: 2-D activations are [rows, features] with features contiguous
// (column views via Tensor::cols are accepted wherever an argument is called a view); images are
// NCHW with N = 1; attention heads are packed head-major inside the feature axis.
#include <cstdint>

#include "core/tensor.h"

namespace apus {

struct Context;

namespace ops {

// Where the reference rounds. once: fp32 throughout, the output rounded once to its dtype.
// each_step: the sub-steps the op lists are each rounded to the output dtype, as the reference's
// eager ops round one by one (in f32 this is the same as once).
enum class Rounding { once, each_step };

enum class RopeStyle { interleaved, half };  // FLUX pairs (2j, 2j+1); Qwen pairs (j, j + D/2)

struct AttentionMask {
  bool causal = false;
  const int64_t* key_valid = nullptr;  // [Sk], 0 masks the key out; null: all keys valid
};

}  // namespace ops

// X(return type, name, (parameters), (arguments)); the first parameter is always the Context.
//
// linear: y[M,N] = x[M,K] · w[N,K]^T (+ bias[N]); x and y may be views; w and bias are converted
//   to x's dtype first (as torch_dtype converts weights), fp32 accumulation.
// layer_norm_modulate: y = LN(x) * (1 + scale) + shift, LN without affine; scale, shift [D].
//   each_step rounds LN(x), (1 + scale), the product and the sum.
// rms_norm: RMSNorm over each contiguous group of `group` features, times weight[group]; x and y
//   may alias. each_step rounds the normalised value before the weight (transformers'
//   Qwen3RMSNorm); once is torch.nn.RMSNorm.
// rope: rotates every head of the view x[S, H*D] in place; cos/sin are f32 [S, D/2]. each_step
//   rounds cos and sin and each of the four products and two sums (Qwen's rotate_half in the
//   activation dtype); once computes in fp32 (FLUX).
// attention: o[Sq, Hq*D] = softmax(q k^T * scale + mask) v per head, kv heads shared by Hq/Hk
//   query heads; the probabilities are rounded to q's dtype before P·V, as SDPA's math does.
// silu_mul: y = silu(a) * b, all [M, F] views; each_step rounds silu(a) first.
// silu: y = silu(x), any shape (contiguous) or view.
// add_gated: x += gate[D] * y (gate null: x += y), x and y [M, D] views; each_step rounds
//   gate * y before the add.
// euler_update: x <- x + step * velocity with the flow-match scheduler's roundings: the step is
//   cast to the velocity's dtype and the product rounded to it, the sum rounded to x's dtype.
// copy: y = x converted to y's dtype (views, or any two contiguous tensors of one size).
// all_finite: whether x holds no NaN or Inf (a pipeline's guard between stages); counting mode
//   reports true.
// transpose: y[N, M] = x[M, N]^T, both contiguous and of one dtype.
// conv2d: NCHW, N = 1, square stride and padding; w converted to x's dtype, bias added in fp32.
// group_norm: GroupNorm with affine; fuse_silu applies SiLU after it; each_step rounds the
//   normalised value before the SiLU (two eager ops in the reference).
// upsample_nearest2x: NCHW, N = 1.
#define APUS_OPS(X)                                                                              \
  X(void, linear, (Context & c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y), \
    (c, x, w, bias, y))                                                                          \
  X(void, layer_norm_modulate,                                                                   \
    (Context & c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y,          \
     float eps, ops::Rounding rounding),                                                         \
    (c, x, shift, scale, y, eps, rounding))                                                      \
  X(void, rms_norm,                                                                              \
    (Context & c, const Tensor& x, const Tensor& weight, Tensor& y, float eps, int64_t group,    \
     ops::Rounding rounding),                                                                    \
    (c, x, weight, y, eps, group, rounding))                                                     \
  X(void, rope,                                                                                  \
    (Context & c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,             \
     ops::RopeStyle style, ops::Rounding rounding),                                              \
    (c, x, cos, sin, head_dim, style, rounding))                                                 \
  X(void, attention,                                                                             \
    (Context & c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,                  \
     int64_t head_dim, float scale, const ops::AttentionMask& mask),                             \
    (c, q, k, v, o, head_dim, scale, mask))                                                      \
  X(void, silu_mul,                                                                              \
    (Context & c, const Tensor& a, const Tensor& b, Tensor& y, ops::Rounding rounding),          \
    (c, a, b, y, rounding))                                                                      \
  X(void, silu, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                            \
  X(void, add_gated,                                                                             \
    (Context & c, Tensor& x, const Tensor& y, const Tensor* gate, ops::Rounding rounding),       \
    (c, x, y, gate, rounding))                                                                   \
  X(void, euler_update, (Context & c, Tensor& x, const Tensor& velocity, float step),            \
    (c, x, velocity, step))                                                                      \
  X(void, copy, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                            \
  X(bool, all_finite, (Context & c, const Tensor& x), (c, x))                                    \
  X(void, transpose, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                       \
  X(void, conv2d,                                                                                \
    (Context & c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,               \
     int64_t stride, int64_t pad),                                                               \
    (c, x, w, bias, y, stride, pad))                                                             \
  X(void, group_norm,                                                                            \
    (Context & c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,          \
     int64_t groups, float eps, bool fuse_silu, ops::Rounding rounding),                         \
    (c, x, weight, bias, y, groups, eps, fuse_silu, rounding))                                   \
  X(void, upsample_nearest2x, (Context & c, const Tensor& x, Tensor& y), (c, x, y))

// Declares every op of the list in the current namespace (a backend's own namespace).
#define APUS_DECLARE_OP(ret, name, params, args) ret name params;
#define APUS_DECLARE_OPS APUS_OPS(APUS_DECLARE_OP)

}  // namespace apus
