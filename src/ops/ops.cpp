// The op layer's front: each op reports its cost (conventions in docs/ROOFLINE.md), returns
// early in counting mode, and otherwise runs on the backend of its tensors' device.
#include "ops/ops.h"

#include "core/error.h"
#include "ops/cpu/cpu_ops.h"

namespace apus::ops {

namespace {

double bytes(const Tensor& t) { return double(t.numel()) * double(dtype_size(t.dtype)); }
double elems(const Tensor& t) { return double(t.numel()); }

// Records the cost; true when the op must also run.
bool account(Context& c, const OpCost& cost) {
  if (c.cost) c.cost->add(cost);
  return !c.count_only;
}

void require_cpu(const Tensor& t, const char* op) {
  APUS_CHECK(t.device == Device::cpu, op, ": no backend for device ", int(t.device),
             " in this build");
}

}  // namespace

Tensor empty(Context& c, Shape shape, DType dtype) {
  return c.count_only ? Tensor::shape_only(std::move(shape), dtype) : Tensor::heap(std::move(shape), dtype);
}

void linear(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const double m = double(x.shape[0]), k = double(w.shape[1]), n = double(w.shape[0]);
  const double act = bytes(x) + bytes(y);
  if (!account(c, {2 * m * k * n + (bias ? m * n : 0), bytes(w) + (bias ? bytes(*bias) : 0), act, act}))
    return;
  require_cpu(x, "linear");
  cpu::linear(c, x, w, bias, y);
}

void layer_norm_modulate(Context& c, const Tensor& x, const Tensor& shift, const Tensor& scale,
                         Tensor& y, float eps) {
  const double act = bytes(x) + bytes(y) + bytes(shift) + bytes(scale);
  if (!account(c, {(6 + 2) * elems(x), 0, act, act + 2 * bytes(y)})) return;
  require_cpu(x, "layer_norm_modulate");
  cpu::layer_norm_modulate(c, x, shift, scale, y, eps);
}

void rms_norm(Context& c, const Tensor& x, const Tensor& weight, Tensor& y, float eps,
              int64_t group, bool round_before_weight) {
  const double act = bytes(x) + bytes(y);
  if (!account(c, {4 * elems(x), bytes(weight), act, act})) return;
  require_cpu(x, "rms_norm");
  cpu::rms_norm(c, x, weight, y, eps, group, round_before_weight);
}

void rope(Context& c, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t head_dim,
          RopeStyle style) {
  const double act = 2 * bytes(x) + bytes(cos) + bytes(sin);
  if (!account(c, {4 * elems(x), 0, act, act})) return;
  require_cpu(x, "rope");
  cpu::rope(c, x, cos, sin, head_dim, style);
}

void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o,
               int64_t head_dim, float scale, const AttentionMask& mask) {
  // Causal attention is counted at the full square, as the convention fixes.
  const double heads = double(q.shape[1] / head_dim), sq = double(q.shape[0]), sk = double(k.shape[0]);
  const double scores = heads * sq * sk;
  const double act = bytes(q) + bytes(k) + bytes(v) + bytes(o);
  const double interior = 2 * scores * (4 + double(dtype_size(q.dtype)));  // S in f32, P in act
  if (!account(c, {(4 * double(head_dim) + 5) * scores, 0, act, act + interior})) return;
  require_cpu(q, "attention");
  cpu::attention(c, q, k, v, o, head_dim, scale, mask);
}

void silu_mul(Context& c, const Tensor& a, const Tensor& b, Tensor& y) {
  const double act = bytes(a) + bytes(b) + bytes(y);
  if (!account(c, {5 * elems(y), 0, act, act + 2 * bytes(y)})) return;
  require_cpu(a, "silu_mul");
  cpu::silu_mul(c, a, b, y);
}

void silu(Context& c, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  if (!account(c, {4 * elems(x), 0, act, act})) return;
  require_cpu(x, "silu");
  cpu::silu(c, x, y);
}

void add_gated(Context& c, Tensor& x, const Tensor& y, const Tensor* gate) {
  const double act = 2 * bytes(x) + bytes(y) + (gate ? bytes(*gate) : 0);
  if (!account(c, {(gate ? 2 : 1) * elems(x), 0, act, act + (gate ? 2 * bytes(y) : 0)})) return;
  require_cpu(x, "add_gated");
  cpu::add_gated(c, x, y, gate);
}

void euler_update(Context& c, Tensor& x, const Tensor& velocity, float step) {
  const double act = 2 * bytes(x) + bytes(velocity);
  if (!account(c, {2 * elems(x), 0, act, act + 2 * bytes(velocity)})) return;
  require_cpu(x, "euler_update");
  cpu::euler_update(c, x, velocity, step);
}

void copy(Context& c, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  if (!account(c, {0, 0, act, act})) return;
  require_cpu(x, "copy");
  cpu::copy(c, x, y);
}

bool all_finite(Context& c, const Tensor& x) {
  if (!account(c, {elems(x), 0, bytes(x), bytes(x)})) return true;
  require_cpu(x, "all_finite");
  return cpu::all_finite(c, x);
}

void transpose(Context& c, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  if (!account(c, {0, 0, act, act})) return;
  require_cpu(x, "transpose");
  cpu::transpose(c, x, y);
}

void conv2d(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
            int64_t stride, int64_t pad) {
  const double per_output = double(w.shape[1] * w.shape[2] * w.shape[3]);
  const double act = bytes(x) + bytes(y);
  if (!account(c, {2 * per_output * elems(y) + (bias ? elems(y) : 0),
                   bytes(w) + (bias ? bytes(*bias) : 0), act, act}))
    return;
  require_cpu(x, "conv2d");
  cpu::conv2d(c, x, w, bias, y, stride, pad);
}

void group_norm(Context& c, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y,
                int64_t groups, float eps, bool fuse_silu) {
  const double act = bytes(x) + bytes(y);
  if (!account(c, {(6 + (fuse_silu ? 4 : 0)) * elems(x), bytes(weight) + bytes(bias), act,
                   act + (fuse_silu ? 2 * bytes(y) : 0)}))
    return;
  require_cpu(x, "group_norm");
  cpu::group_norm(c, x, weight, bias, y, groups, eps, fuse_silu);
}

void upsample_nearest2x(Context& c, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  if (!account(c, {0, 0, act, act})) return;
  require_cpu(x, "upsample_nearest2x");
  cpu::upsample_nearest2x(c, x, y);
}

}  // namespace apus::ops
