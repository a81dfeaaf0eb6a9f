#pragma once
// The op list: every op once, with its contract. ops.h declares the front end from it, each
// backend (src/ops/<name>/) declares and implements the same entries, and the Backend interface
// (ops/backend.h) and the op ids (ops::OpId) are generated from it. Adding an op is:
//   - one entry here, with its contract in the comment above the list;
//   - its cost function, <op>_cost in ops.cpp;
//   - one function per backend (a backend that cannot run it yet answers false for it in
//     Backend::supports, and the front end refuses it there by name);
//   - at least one row in the op table, tests/test_op_table.cpp, which runs it on every backend
//     against the ref backend (OpTableCoverage.EveryOpHasACase fails until the row is there).
//
// Contract for all ops: inputs are read in their stored dtype (f32, bf16, f16), arithmetic is
// fp32 (the reference backend: f64), outputs are rounded once to their dtype unless the op's
// Rounding argument says the reference rounds sub-steps too. Ops never allocate their outputs:
// callers pass them. Layout: 2-D activations are [rows, features] with features contiguous
// (column views via Tensor::cols are accepted wherever an argument is called a view); images are
// NCHW; attention heads are packed head-major inside the feature axis. A batch of B samples lies
// sample after sample along the rows (or along N): row-wise ops need nothing more, the others say
// how they see samples.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace apus {

struct Context;

namespace ops {

// Where the reference rounds. once: fp32 throughout, the output rounded once to its dtype.
// each_step: the sub-steps the op lists are each rounded to the output dtype, as the reference's
// eager ops round one by one (in f32 this is the same as once).
enum class Rounding { once, each_step };

enum class RopeStyle { interleaved, half };  // FLUX pairs (2j, 2j+1); Qwen pairs (j, j + D/2)

// The activation of a gated linear unit: SiLU (SwiGLU), GELU's tanh approximation (GeGLU,
// torch's gelu(approximate="tanh")) or sin(pi x) (Stable Audio's SAME decoder).
enum class Activation { silu, gelu_tanh, sin_pi };  // sin_pi: sin(pi x), SAME's sinusoidal FF

// How a RoPE table computes its angles: f32 as transformers' default rope (inverse frequencies
// and products in float32), f64 as diffusers' FLUX pos-embed (float64, cast to float32 at the end).
enum class RopeMath { f32, f64 };

// What an attention op masks and how it forms its scores. q, k, v and o hold `batch` samples one
// after another (sample b is rows b*S .. (b+1)*S of each); every sample attends only within
// itself. window > 0 lets query i see only keys j with |i - j| <= window (a band, computed
// without a score matrix wider than the band). softcap > 0 bends the scaled scores to softcap * tanh(s / softcap)
// before the mask (Gemma). rounding each_step rounds the scores as eager PyTorch does in the activation dtype: after
// Q·K^T, after the scale, and after each of the softcap's three steps.
struct AttentionOptions {
  bool causal = false;
  // i64 [batch * Sk] in the context's memory like the other operands (staged once per request),
  // 0 masks the key out; null: all keys valid.
  const Tensor* key_valid = nullptr;
  int64_t batch = 1;
  float softcap = 0;
  Rounding rounding = Rounding::once;
  int64_t window = 0;
};

}  // namespace ops

// X(return type, name, (parameters), (arguments)); the first parameter is always the Context.
//
// linear: y[M,N] = x[M,K] · w[N,K]^T (+ bias[N]); x and y may be views; w and bias are converted
//   to x's dtype first (as torch_dtype converts weights), fp32 accumulation. A weight of int8
//   products (the int8 tier: i8 codes w with one scale s_w[j] = code_scale * factor per row)
//   multiplies in integers instead: each row of x becomes codes q (core/tier_rows.h: scale s_x =
//   max |x| / 127, q = clamp(nearbyint(x * (127 / max |x|)), -127, 127), fp32 steps), then
//   y[i,j] = fma(float(sum_k q[i,k] w[j,k]), s_x[i] * s_w[j], bias[j]) (the scales' product
//   rounded first; without a bias the product alone), rounded to y's dtype; a row of x holding a
//   NaN or an infinity gives a row of NaN. A weight of fp8 products (the fp8 tier: float8_e4m3fn
//   codes w, one scale a row as int8's) the same way with q = fp8_value(x, 448 / max |x|) (the
//   e4m3 value nearest, ties to even, saturated at +-448) and s_x = max |x| / 448, the sum of the
//   exact products q w in fp32 in any order (a rounding per term at most, as the plain linear's).
// layer_norm_modulate: y = LN(x) * (1 + scale) + shift, LN without affine; scale and shift are
//   [D] for every row or [B, D] per sample (sample b covers rows b*M/B .. (b+1)*M/B).
//   each_step rounds LN(x), (1 + scale), the product and the sum.
// rms_norm: RMSNorm over each contiguous group of `group` features, times weight[group]; x and y
//   may alias. each_step rounds the normalised value before the weight (transformers'
//   Qwen3RMSNorm); once is torch.nn.RMSNorm.
// modulate: y = x * (1 + scale) + shift, x and y [M, D] views, scale and shift as
//   layer_norm_modulate's; each_step rounds (1 + scale), the product and the sum.
// rope: rotates every head of the view x[B*S, H*D] in place; cos/sin are f32 [S, R/2], one
//   sample's positions serving every sample (row r uses table row r mod S). Only the first R
//   channels of each head turn (R <= D: partial RoPE), pairs (j, j + R/2) or (2j, 2j + 1). each_step
//   rounds cos and sin and each of the four products and two sums (Qwen's rotate_half in the
//   activation dtype); once computes in fp32 (FLUX).
// attention: o[Sq, Hq*D] = softmax(q k^T * scale + mask) v per head, kv heads shared by Hq/Hk
//   query heads; the probabilities are rounded to q's dtype before P·V, as SDPA's math does.
// differential_attention: o = attention(q, k, v) - attention(q2, k2, v), each term rounded to
//   o's dtype before the difference (two eager attentions subtracted), same options for both.
// glu: y = act(a) * b, all [M, F] views; each_step rounds act(a) first. sin_pi forms pi x in fp32
//   with pi rounded to fp32 (torch's scalar product), each_step rounding it to y's dtype too.
// dyt: DynamicTanh, y = gamma * tanh(alpha * x) + beta with alpha one value and gamma, beta [G]
//   applied to each group of G features (G = D: the whole row; G = head_dim: per head); x and y
//   [M, D] views, may alias. each_step rounds alpha * x, the tanh and the product (eager ops).
// silu: y = silu(x), any shape (contiguous) or view.
// add_gated: x += gate * y (gate null: x += y), x and y [M, D] views, gate [D] or [B, D] per
//   sample as layer_norm_modulate's; each_step rounds
//   gate * y before the add.
// gate_sigmoid: y = sigmoid(1 - x) (Stable Audio's branch gate), x and y [B, D] or [D];
//   each_step rounds 1 - x first.
// euler_update: x <- x + step * velocity with the flow-match scheduler's roundings: the step is
//   cast to the velocity's dtype and the product rounded to it, the sum rounded to x's dtype.
// pingpong_update: x <- (1 - t_next) (x - t velocity) + t_next noise, the ping-pong sampler's
//   step: each product, difference and sum rounded to x's dtype as the reference's eager ops;
//   velocity and noise are read in their dtypes. t_next = 0 leaves the denoised x - t velocity.
// blend: y = (1 - w) a + w b with w one weight per row (w f32 [M]) or one for all rows ([1]), as
//   the flow-match scheduler's scale_noise (w = sigma) and the inpainting pipelines' masked update
//   (w = the mask) compute it: w is cast to y's dtype, and 1 - w, both products and the sum are
//   each rounded to it (eager ops). a, b, y [M, D] views; y may alias a or b.
// guided_velocity: Stable Audio 3's classifier-free guidance with adaptive projected guidance,
//   per sample of x [B*T, C] (the sampler state, f32) from the conditional and unconditional
//   velocities: denoised d_c = x - sigma v_c, d_u = x - sigma v_u, diff = d_c - d_u; with apg > 0
//   diff's part orthogonal to d_c over the first `valid` frames (Frobenius norms over frames x
//   channels, padding frames zeroed) replaces it in proportion apg; v = (x - (d_c + (scale - 1)
//   guidance)) / sigma into y [B*T, C]. Each eager op rounded to y's dtype, reductions in fp32.
// copy: y = x converted to y's dtype (views, or any two contiguous tensors of one size).
// all_finite: whether x holds no NaN or Inf (a pipeline's guard between stages); counting mode
//   reports true.
// nonfinite_flag: flags[slot] = 1 where x holds a NaN or an Inf, else 0 (flags a contiguous i32
//   vector): all_finite's answer left where the op runs, so a pipeline can queue steps without
//   waiting for each and read their answers at once (pipeline/driver.h).
// transpose: y[N, M] = x[M, N]^T, both contiguous and of one dtype.
// conv2d: NCHW, square stride; `pad` zero rows / columns before (top, left), `pad_end` after
//   (bottom, right: diffusers' Downsample2D pads (0, 1, 0, 1)); w converted to x's dtype, bias
//   added in fp32.
// group_norm: GroupNorm with affine over NCHW, each sample on its own; fuse_silu applies SiLU
//   after it; each_step rounds the
//   normalised value before the SiLU (two eager ops in the reference).
// upsample_nearest2x: NCHW.
// embedding: y[S, D] = table[ids[s]] for i32 ids [S], converted to y's dtype; ids outside the
//   table are refused.
// rope_tables: cos, sin [S, D/2] f32 of positions [S, A] i64, axis a covering axes[a] of the head
//   dimension D (pairs j of an axis of size d turn at theta^(-2j/d)), angles from float(position).
// timestep_embedding: y [1, 2H] = [cos(t f_i), sin(t f_i)] with f_i = exp(-ln(10000) i / H),
//   in fp32, rounded once to y's dtype.
// fourier_features: y [1, 2H] = [cos(a_i), sin(a_i)] with a_i = ((t f_i) 2) pi in fp32 as torch
//   evaluates `t * freqs * 2.0 * math.pi`, freqs [H] (any float dtype); rounded once to y's dtype.
// affine: y[M, D] = x * scale[D] + shift[D]; each_step rounds the product first.
// permute: y = x with its axes reordered (y's axis i is x's axis perm[i]), both contiguous, rank
//   <= 6, one dtype; shapes give the view (y.numel() == x.numel()).
// image_to_rgb8: image [1, 3, H, W] in [-1, 1] to u8 [H, W, 3] as the pipeline's postprocess
//   does: x * 0.5 + 0.5 as two ops rounded to the image's dtype, clamped to [0, 1], then
//   (v * 255) rounded half to even in fp32; a non-finite pixel is refused.
#define APUS_OPS(X)                                                                                                    \
  X(void, linear, (Context & c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y), (c, x, w, bias, y))  \
  X(void, layer_norm_modulate,                                                                                         \
    (Context & c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, float eps,                     \
     ops::Rounding rounding),                                                                                          \
    (c, x, shift, scale, y, eps, rounding))                                                                            \
  X(void, rms_norm,                                                                                                    \
    (Context & c, const Tensor& x, const Tensor& weight, Tensor& y, float eps, int64_t group, ops::Rounding rounding), \
    (c, x, weight, y, eps, group, rounding))                                                                           \
  X(void, modulate,                                                                                                    \
    (Context & c, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, ops::Rounding rounding),       \
    (c, x, shift, scale, y, rounding))                                                                                 \
  X(void, rope,                                                                                                        \
    (Context & c, Tensor & x, const Tensor& cos, const Tensor& sin, int64_t head_dim, ops::RopeStyle style,            \
     ops::Rounding rounding),                                                                                          \
    (c, x, cos, sin, head_dim, style, rounding))                                                                       \
  X(void, attention,                                                                                                   \
    (Context & c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, int64_t head_dim, float scale,         \
     const ops::AttentionOptions& mask),                                                                               \
    (c, q, k, v, o, head_dim, scale, mask))                                                                            \
  X(void, differential_attention,                                                                                      \
    (Context & c, const Tensor& q, const Tensor& k, const Tensor& q2, const Tensor& k2, const Tensor& v, Tensor& o,    \
     int64_t head_dim, float scale, const ops::AttentionOptions& mask),                                                \
    (c, q, k, q2, k2, v, o, head_dim, scale, mask))                                                                    \
  X(void, glu,                                                                                                         \
    (Context & c, const Tensor& a, const Tensor& b, Tensor& y, ops::Activation act, ops::Rounding rounding),           \
    (c, a, b, y, act, rounding))                                                                                       \
  X(void, silu, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                                                  \
  X(void, dyt,                                                                                                         \
    (Context & c, const Tensor& x, const Tensor& alpha, const Tensor& gamma, const Tensor& beta, Tensor& y,            \
     ops::Rounding rounding),                                                                                          \
    (c, x, alpha, gamma, beta, y, rounding))                                                                           \
  X(void, add_gated, (Context & c, Tensor & x, const Tensor& y, const Tensor* gate, ops::Rounding rounding),           \
    (c, x, y, gate, rounding))                                                                                         \
  X(void, gate_sigmoid, (Context & c, const Tensor& x, Tensor& y, ops::Rounding rounding), (c, x, y, rounding))        \
  X(void, euler_update, (Context & c, Tensor & x, const Tensor& velocity, float step), (c, x, velocity, step))         \
  X(void, pingpong_update,                                                                                             \
    (Context & c, Tensor & x, const Tensor& velocity, const Tensor& noise, float t, float t_next),                     \
    (c, x, velocity, noise, t, t_next))                                                                                \
  X(void, blend, (Context & c, const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y), (c, a, b, w, y))         \
  X(void, guided_velocity,                                                                                             \
    (Context & c, const Tensor& x, const Tensor& cond, const Tensor& uncond, Tensor& y, float sigma, float scale,      \
     float apg, int64_t batch, int64_t valid),                                                                         \
    (c, x, cond, uncond, y, sigma, scale, apg, batch, valid))                                                          \
  X(void, copy, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                                                  \
  X(bool, all_finite, (Context & c, const Tensor& x), (c, x))                                                          \
  X(void, nonfinite_flag, (Context & c, const Tensor& x, Tensor& flags, int64_t slot), (c, x, flags, slot))            \
  X(void, transpose, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                                             \
  X(void, conv2d,                                                                                                      \
    (Context & c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride, int64_t pad,        \
     int64_t pad_end),                                                                                                 \
    (c, x, w, bias, y, stride, pad, pad_end))                                                                          \
  X(void, group_norm,                                                                                                  \
    (Context & c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, int64_t groups, float eps,     \
     bool fuse_silu, ops::Rounding rounding),                                                                          \
    (c, x, weight, bias, y, groups, eps, fuse_silu, rounding))                                                         \
  X(void, upsample_nearest2x, (Context & c, const Tensor& x, Tensor& y), (c, x, y))                                    \
  X(void, embedding, (Context & c, const Tensor& table, const Tensor& ids, Tensor& y), (c, table, ids, y))             \
  X(void, rope_tables,                                                                                                 \
    (Context & c, const Tensor& positions, const std::vector<int64_t>& axes, double theta, ops::RopeMath math,         \
     Tensor& cos, Tensor& sin),                                                                                        \
    (c, positions, axes, theta, math, cos, sin))                                                                       \
  X(void, timestep_embedding, (Context & c, float t, Tensor& y), (c, t, y))                                            \
  X(void, fourier_features, (Context & c, float t, const Tensor& freqs, Tensor& y), (c, t, freqs, y))                  \
  X(void, affine,                                                                                                      \
    (Context & c, const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& y, ops::Rounding rounding),       \
    (c, x, scale, shift, y, rounding))                                                                                 \
  X(void, permute, (Context & c, const Tensor& x, Tensor& y, const std::vector<int>& perm), (c, x, y, perm))           \
  X(void, image_to_rgb8, (Context & c, const Tensor& image, Tensor& rgb), (c, image, rgb))

namespace ops {

// The ops of the list by name: what Backend::supports is asked about, and what the op table
// (tests/test_op_table.cpp) checks it has a case for.
enum class OpId {
#define APUS_OP_ID(ret, name, params, args) name,
  APUS_OPS(APUS_OP_ID)
#undef APUS_OP_ID
};

inline constexpr const char* kOpNames[] = {
#define APUS_OP_NAME(ret, name, params, args) #name,
    APUS_OPS(APUS_OP_NAME)
#undef APUS_OP_NAME
};
inline constexpr size_t kOpCount = sizeof(kOpNames) / sizeof(kOpNames[0]);
inline const char* op_name(OpId op) { return kOpNames[size_t(op)]; }

}  // namespace ops

// nonfinite_flag's flags and slot, as every backend checks them.
inline void check_flag_slot(const Tensor& flags, int64_t slot) {
  APUS_CHECK(flags.dtype == DType::i32 && flags.contiguous() && slot >= 0 && slot < flags.numel(),
             "nonfinite_flag: expected a contiguous i32 vector and a slot inside it, got ", dtype_name(flags.dtype),
             " ", shape_str(flags.shape), " and slot ", slot);
}

// Declares every op of the list in the current namespace (a backend's own namespace).
#define APUS_DECLARE_OP(ret, name, params, args) ret name params;
#define APUS_DECLARE_OPS APUS_OPS(APUS_DECLARE_OP)

}  // namespace apus
