// The op layer's front end: each op's cost (conventions in docs/ROOFLINE.md), then the dispatch
// that the op list generates: counting mode returns, the Context's backend must run the op and
// hold every operand, the backend runs it.
#include "ops/ops.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/error.h"
#include "ops/adapters.h"
#include "ops/backend.h"

namespace apus::ops {

namespace {

double bytes(const Tensor& t) { return double(t.nbytes()); }
double elems(const Tensor& t) { return double(t.numel()); }

// FLOPs, weight bytes, fused and unfused activation bytes of each op, with the op's parameters.

OpCost linear_cost(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const double m = double(x.shape[0]), k = double(w.shape[1]), n = double(w.shape[0]);
  const double act = bytes(x) + bytes(y);
  OpCost cost{2 * m * k * n + (bias ? m * n : 0), bytes(w) + (bias ? bytes(*bias) : 0), act, act};
  if (w.encoding.products == Products::int8) cost.int8_ops = 2 * m * k * n;
  if (w.encoding.products == Products::fp8) cost.fp8_ops = 2 * m * k * n;
  if (c.cost && c.cost->row_parallel()) cost.tp_bytes = bytes(x) + bytes(y);
  return cost;
}

OpCost layer_norm_modulate_cost(Context&, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, float,
                                Rounding) {
  const double act = bytes(x) + bytes(y) + bytes(shift) + bytes(scale);
  return {(6 + 2) * elems(x), 0, act, act + 2 * bytes(y)};
}

OpCost rms_norm_cost(Context&, const Tensor& x, const Tensor& weight, Tensor& y, float, int64_t, Rounding) {
  const double act = bytes(x) + bytes(y);
  return {4 * elems(x), bytes(weight), act, act};
}

OpCost modulate_cost(Context&, const Tensor& x, const Tensor& shift, const Tensor& scale, Tensor& y, Rounding) {
  const double act = bytes(x) + bytes(y) + bytes(shift) + bytes(scale);
  return {2 * elems(x), 0, act, act + 2 * bytes(y)};
}

OpCost rope_cost(Context&, Tensor& x, const Tensor& cos, const Tensor& sin, int64_t, RopeStyle, Rounding) {
  const double act = 2 * bytes(x) + bytes(cos) + bytes(sin);
  return {4 * elems(x), 0, act, act};
}

OpCost attention_cost(Context&, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, int64_t head_dim, float,
                      const AttentionOptions& mask) {
  // Causal attention is counted at the full square, as the convention fixes.
  const double heads = double(q.shape[1] / head_dim), sq = double(q.shape[0]);
  double sk = double(k.shape[0]) / double(mask.batch);                  // each sample attends within itself
  if (mask.window > 0) sk = std::min(sk, double(2 * mask.window + 1));  // the band alone
  const double scores = heads * sq * sk;
  const double act = bytes(q) + bytes(k) + bytes(v) + bytes(o);
  const double interior = 2 * scores * (4 + double(dtype_size(q.dtype)));  // S in f32, P in act
  OpCost cost{(4 * double(head_dim) + 5) * scores, 0, act, act + interior};
  cost.ulysses_bytes = act;  // q, k, v scattered by head, o gathered back
  return cost;
}

OpCost differential_attention_cost(Context& c, const Tensor& q, const Tensor& k, const Tensor& q2, const Tensor& k2,
                                   const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                                   const AttentionOptions& mask) {
  // Two attentions over one V; the second's output and the subtraction are interior traffic.
  OpCost cost = attention_cost(c, q, k, v, o, head_dim, scale, mask);
  const OpCost second = attention_cost(c, q2, k2, v, o, head_dim, scale, mask);
  cost.flops += second.flops + elems(o);
  cost.bytes_fused += bytes(q2) + bytes(k2);
  cost.bytes_unfused += second.bytes_unfused - bytes(v) + 2 * bytes(o);
  cost.ulysses_bytes += bytes(q2) + bytes(k2);
  return cost;
}

OpCost dyt_cost(Context&, const Tensor& x, const Tensor& alpha, const Tensor& gamma, const Tensor& beta, Tensor& y,
                Rounding) {
  const double act = bytes(x) + bytes(y);
  return {5 * elems(x), bytes(alpha) + bytes(gamma) + bytes(beta), act, act};
}

OpCost glu_cost(Context&, const Tensor& a, const Tensor& b, Tensor& y, Activation, Rounding) {
  const double act = bytes(a) + bytes(b) + bytes(y);
  return {5 * elems(y), 0, act, act + 2 * bytes(y)};
}

OpCost silu_cost(Context&, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  return {4 * elems(x), 0, act, act};
}

OpCost add_gated_cost(Context&, Tensor& x, const Tensor& y, const Tensor* gate, Rounding) {
  const double act = 2 * bytes(x) + bytes(y) + (gate ? bytes(*gate) : 0);
  return {(gate ? 2 : 1) * elems(x), 0, act, act + (gate ? 2 * bytes(y) : 0)};
}

OpCost gate_sigmoid_cost(Context&, const Tensor& x, Tensor& y, Rounding) {
  const double act = bytes(x) + bytes(y);
  return {5 * elems(x), 0, act, act};
}

OpCost euler_update_cost(Context&, Tensor& x, const Tensor& velocity, float) {
  const double act = 2 * bytes(x) + bytes(velocity);
  return {2 * elems(x), 0, act, act + 2 * bytes(velocity)};
}

OpCost pingpong_update_cost(Context&, Tensor& x, const Tensor& velocity, const Tensor& noise, float, float) {
  const double act = 2 * bytes(x) + bytes(velocity) + bytes(noise);
  return {6 * elems(x), 0, act, act + 2 * bytes(x)};
}

OpCost blend_cost(Context&, const Tensor& a, const Tensor& b, const Tensor& w, Tensor& y) {
  const double act = bytes(a) + bytes(b) + bytes(w) + bytes(y);
  return {3 * elems(y), 0, act, act + 4 * bytes(y)};
}

OpCost guided_velocity_cost(Context&, const Tensor& x, const Tensor& cond, const Tensor& uncond, Tensor& y, float,
                            float, float, int64_t, int64_t) {
  const double act = bytes(x) + bytes(cond) + bytes(uncond) + bytes(y);
  return {16 * elems(x), 0, act, act + 6 * bytes(y)};
}

OpCost copy_cost(Context&, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  return {0, 0, act, act};
}

OpCost all_finite_cost(Context&, const Tensor& x) { return {elems(x), 0, bytes(x), bytes(x)}; }

OpCost nonfinite_flag_cost(Context&, const Tensor& x, Tensor&, int64_t) {
  return {elems(x), 0, bytes(x) + 4, bytes(x) + 4};
}

OpCost transpose_cost(Context&, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  return {0, 0, act, act};
}

OpCost conv2d_cost(Context&, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t, int64_t,
                   int64_t) {
  const double per_output = double(w.shape[1] * w.shape[2] * w.shape[3]);
  const double act = bytes(x) + bytes(y);
  return {2 * per_output * elems(y) + (bias ? elems(y) : 0), bytes(w) + (bias ? bytes(*bias) : 0), act, act};
}

OpCost group_norm_cost(Context&, const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& y, int64_t, float,
                       bool fuse_silu, Rounding) {
  const double act = bytes(x) + bytes(y);
  return {(6 + (fuse_silu ? 4 : 0)) * elems(x), bytes(weight) + bytes(bias), act, act + (fuse_silu ? 2 * bytes(y) : 0)};
}

OpCost upsample_nearest2x_cost(Context&, const Tensor& x, Tensor& y) {
  const double act = bytes(x) + bytes(y);
  return {0, 0, act, act};
}

OpCost embedding_cost(Context&, const Tensor& table, const Tensor& ids, Tensor& y) {
  // The rows read count as weights: each id reads one row of the table.
  return {0, double(dtype_bytes(table.dtype, ids.numel() * table.shape.back())), bytes(ids) + bytes(y),
          bytes(ids) + bytes(y)};
}

OpCost rope_tables_cost(Context&, const Tensor& positions, const std::vector<int64_t>&, double, RopeMath, Tensor& cos,
                        Tensor& sin) {
  const double act = bytes(positions) + bytes(cos) + bytes(sin);
  return {0, 0, act, act};
}

OpCost timestep_embedding_cost(Context&, float, Tensor& y) { return {0, 0, bytes(y), bytes(y)}; }

OpCost fourier_features_cost(Context&, float, const Tensor& freqs, Tensor& y) {
  return {0, 0, bytes(freqs) + bytes(y), bytes(freqs) + bytes(y)};
}

OpCost affine_cost(Context&, const Tensor& x, const Tensor& scale, const Tensor& shift, Tensor& y, Rounding rounding) {
  const double act = bytes(x) + bytes(y) + bytes(scale) + bytes(shift);
  return {2 * elems(x), 0, act, act + (rounding == Rounding::each_step ? 2 * bytes(y) : 0)};
}

OpCost permute_cost(Context&, const Tensor& x, Tensor& y, const std::vector<int>&) {
  const double act = bytes(x) + bytes(y);
  return {0, 0, act, act};
}

OpCost image_to_rgb8_cost(Context&, const Tensor& image, Tensor& rgb) {
  const double act = bytes(image) + bytes(rgb);
  return {3 * elems(image), 0, act, act};
}

// Records the cost; true when the op must also run.
bool account(Context& c, const OpCost& cost) {
  if (c.cost) c.cost->add(cost);
  return !c.count_only;
}

// What an op returns in counting mode: nothing, or for a predicate "yes".
template <typename R> R counted() { return R(true); }
template <> void counted<void>() {}

// Calls f on each tensor among an op's arguments (a Tensor, or a Tensor* when set).
template <typename F> void each_tensor(F&& f, const Tensor& t) { f(t); }
template <typename F> void each_tensor(F&& f, const Tensor* t) {
  if (t) f(*t);
}
template <typename F> void each_tensor(F&& f, const AttentionOptions& o) {
  if (o.key_valid) f(*o.key_valid);
}
template <typename F, typename Other> void each_tensor(F&&, const Other&) {}

// Refuses an op the backend does not run (one that implements part of the list).
void check_runs(const Backend& backend, OpId op) {
  APUS_CHECK(backend.supports(op), "backend ", backend.name(), " does not run op ", op_name(op));
}

// Refuses an operand that lives on another device than the backend the Context runs on.
struct OperandCheck {
  const Backend& backend;
  const char* op;
  template <typename... Args> void check(Context&, const Args&... args) const {
    auto one = [&](const Tensor& t) {
      APUS_CHECK(t.device == backend.device() && t.ordinal == backend.ordinal(), op, ": an operand ",
                 shape_str(t.shape), " lives on ", t.device == Device::cpu ? "cpu" : "cuda", ":", t.ordinal,
                 " but the context runs on the ", backend.name(), " backend");
    };
    (each_tensor(one, args), ...);
  }
};

// An op's tensor operands for its trace span: "bf16[1024,3072] bf16[3072,3072] ...".
template <typename... Args> std::string operands(Context&, const Args&... args) {
  std::string text;
  auto one = [&](const Tensor& t) {
    if (!text.empty()) text += ' ';
    text += std::string(dtype_name(t.dtype)) + shape_str(t.shape);
  };
  (each_tensor(one, args), ...);
  return text;
}

Backend& backend_of(Context& c) { return c.backend ? *c.backend : cpu_backend(); }

// What an op does after its backend has run (and in counting mode, after it was counted):
// nothing, except linear, which adds the context's adapters of its weight.
template <OpId op> struct After {
  template <typename... Args> static void run(Args&&...) {}
};
template <> struct After<OpId::linear> {
  static void run(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
    apply_adapters(c, x, w, bias, y);
  }
};

}  // namespace

#define APUS_FRONT_END(ret, name, params, args)                                      \
  ret name params {                                                                  \
    const OpCost apus_cost = name##_cost args;                                       \
    if (!account(c, apus_cost)) {                                                    \
      After<OpId::name>::run args;                                                   \
      return counted<ret>();                                                         \
    }                                                                                \
    if (c.stop && c.stop->load(std::memory_order_relaxed)) throw Cancelled();        \
    Backend& apus_backend = backend_of(c);                                           \
    check_runs(apus_backend, OpId::name);                                            \
    OperandCheck{apus_backend, #name}.check args;                                    \
    std::optional<TraceSpan> apus_span;                                              \
    /* a traced op on a device is waited for on both sides: its span is its time */  \
    if (c.trace) apus_backend.synchronize();                                         \
    if (c.trace) apus_span.emplace(c.trace, #name, "op", operands args, &apus_cost); \
    if constexpr (std::is_void_v<ret>) {                                             \
      apus_backend.name args;                                                        \
      if (c.trace) apus_backend.synchronize();                                       \
      apus_span.reset(); /* what runs after is spanned as its own ops */             \
      After<OpId::name>::run args;                                                   \
    } else {                                                                         \
      return apus_backend.name args;                                                 \
    }                                                                                \
  }
APUS_OPS(APUS_FRONT_END)
#undef APUS_FRONT_END

Tensor empty(Context& c, Shape shape, DType dtype) {
  if (c.count_only) return Tensor::shape_only(std::move(shape), dtype);
  return Tensor::allocate(backend_of(c), std::move(shape), dtype);
}

Tensor to_context(Context& c, const Tensor& host) {
  if (c.count_only || !host.data || host.device != Device::cpu) return host;
  return backend_of(c).upload(host);
}

void upload_into(Context& c, const Tensor& host, Tensor& to) { backend_of(c).upload_into(host, to); }

Tensor zeros(Context& c, Shape shape, DType dtype) {
  if (c.count_only) return Tensor::shape_only(std::move(shape), dtype);
  Tensor host = Tensor::heap(std::move(shape), dtype);
  std::memset(host.data, 0, host.nbytes());
  return to_context(c, host);
}

Tensor to_host(Context& c, const Tensor& t) {
  if (c.count_only || !t.data || t.device == Device::cpu) return t;
  return backend_of(c).download(t);
}

}  // namespace apus::ops
