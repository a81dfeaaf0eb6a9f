#pragma once
// The op layer: every model stage is written only in terms of these calls, so a backend
// (src/ops/cpu today, src/ops/cuda next) plugs in below them and the cost counter hooks into
// them. Ops never allocate: callers pass outputs taken from the
// Context's arena. Inputs are read in their stored dtype, arithmetic is fp32, outputs are
// rounded once to their dtype: the activation dtype of the run (bf16, or f32 in parity mode).
//
// Layout conventions: 2-D activations are [rows, features] with features contiguous
// (column views via Tensor::cols are accepted wherever the argument is called a "view");
// images are NCHW with N = 1; attention heads are packed head-major inside the feature axis.
#include <cstdint>
#include <string>

#include "core/cost.h"
#include "core/tensor.h"

namespace apus {

struct Context {
  Arena* arena = nullptr;
  DType act = DType::bf16;  // activation dtype: bf16 (as the official pipeline) or f32 (parity)
  CostLog* cost = nullptr;  // when set, every op reports its cost under the current scope
  bool count_only = false;  // shapes only: ops report and return; tensors may hold no data
};

// Names a module for the cost log for as long as it lives.
class CostScope {
 public:
  CostScope(Context& c, const std::string& name) : log_(c.cost) {
    if (log_) log_->push(name);
  }
  ~CostScope() {
    if (log_) log_->pop();
  }
  CostScope(const CostScope&) = delete;
  CostScope& operator=(const CostScope&) = delete;

 private:
  CostLog* log_;
};

namespace ops {

// A tensor that outlives the arena (a stage's output, a table kept across steps); in counting
// mode its shape alone, so counting never allocates activation memory.
Tensor empty(Context& c, Shape shape, DType dtype);

// y[M,N] = x[M,K] · w[N,K]^T (+ bias[N]). x and y may be views. fp32 accumulation.
void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);

// y = LayerNorm(x) without affine, then y * (1 + scale) + shift (scale, shift: [D], any float dtype).
void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale,
                         Tensor& y, float eps);

// RMSNorm over each contiguous group of `group` features, times weight[group]; x, y may alias.
// Where a reference rounds the normalised value to the activation dtype before applying the
// weight (transformers' Qwen3RMSNorm) pass round_before_weight; torch.nn.RMSNorm does not.
void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps,
              int64_t group, bool round_before_weight);

enum class RopeStyle { interleaved, half };  // FLUX pairs (2j, 2j+1); Qwen pairs (j, j + D/2)
// Rotates every head of the view x[S, H*D] in place; cos/sin are f32 [S, D/2].
void rope(Context& c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
          RopeStyle style);

struct AttentionMask {
  bool causal = false;
  const int64_t* key_valid = nullptr;  // [Sk], 0 masks the key out; null: all keys valid
};
// o[Sq, Hq*D] = softmax(q k^T * scale + mask) v per head; kv heads shared by Hq/Hk query heads.
void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
               int64_t head_dim, float scale, const AttentionMask& mask);

// y = silu(a) * b, all [M, F] views.
void silu_mul(Context& c, const Tensor& a, const Tensor& b, Tensor& y);
// y = silu(x), any shape (contiguous) or view.
void silu(Context& c, const Tensor& x, Tensor& y);
// x += gate[D] * y  (gate null: x += y); x, y [M, D] views.
void add_gated(Context& c, Tensor& x, const Tensor& y, const Tensor* gate);
// x <- x + step * velocity with the reference scheduler's roundings (flow-match Euler).
void euler_update(Context& c, Tensor& x, const Tensor& velocity, float step);
// Whether every element of x is finite: the guard a pipeline runs on each stage's output.
// Counting mode reports true.
bool all_finite(Context& c, const Tensor& x);
// y = x converted to y's dtype (copy between views).
void copy(Context& c, const Tensor& x, Tensor& y);
// y[N, M] = x[M, N]^T, both contiguous and of one dtype: channel planes <-> token rows.
void transpose(Context& c, const Tensor& x, Tensor& y);

// Image ops on NCHW (N = 1).
void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
            int64_t stride, int64_t pad);
void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                int64_t groups, float eps, bool fuse_silu);
void upsample_nearest2x(Context& c, const Tensor& x, Tensor& y);

}  // namespace ops
}  // namespace apus
