#include "ops/adapters.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/backend.h"
#include "ops/ops.h"

namespace apus {

namespace {

void check_factor(const Factor& f, const std::string& source) {
  const bool pair = f.down.defined();
  APUS_CHECK(f.up.rank() == 2 && (!pair || (f.down.rank() == 2 && f.down.dim(0) == f.up.dim(1))), source,
             pair ? ": down " + shape_str(f.down.shape) + " and up " + shape_str(f.up.shape) +
                        " are no low-rank pair (expected [r, in] and [out, r])"
                  : ": factor " + shape_str(f.up.shape) + " is no matrix");
}

}  // namespace

void Adapters::add(const std::string& weight, const Shape& weight_shape, LowRank f) {
  APUS_CHECK(weight_shape.size() == 2, f.source, ": adapts '", weight, "' of shape ", shape_str(weight_shape),
             ", which is no linear's weight");
  check_factor(f.inner, f.source);
  if (f.kronecker()) check_factor(f.outer, f.source);
  APUS_CHECK(f.cols() == weight_shape[1] && f.rows() == weight_shape[0], f.source, ": a change of shape ",
             shape_str({f.rows(), f.cols()}), " does not fit '", weight, "' ", shape_str(weight_shape));
  std::vector<LowRank>& stacked = by_weight_[weight];
  APUS_CHECK(!f.decomposed() || (!f.kronecker() && f.inner.down.defined() && f.magnitude.numel() == f.rows()), f.source,
             ": a DoRA is a low-rank pair with one magnitude per output row");
  APUS_CHECK(!f.decomposed() || stacked.empty(), f.source, ": a DoRA adapter of '", weight, "' follows ",
             stacked.empty() ? "" : stacked.front().source,
             " on the same weight; apus applies a DoRA as a weight's first adapter only");
  stacked.push_back(std::move(f));
}

const std::vector<LowRank>* Adapters::find(const std::string& weight) const {
  const auto it = by_weight_.find(weight);
  return it == by_weight_.end() ? nullptr : &it->second;
}

void Adapters::keep_rows(const std::string& weight, const std::vector<Share>& rows) {
  const auto it = by_weight_.find(weight);
  if (it == by_weight_.end()) return;
  int64_t held = 0;
  for (const Share& r : rows) held += r.count;
  if (held == 0) {  // no rows here (a rank without heads): nothing of the weight to change, no linear runs it
    by_weight_.erase(it);
    return;
  }
  for (LowRank& f : it->second) {
    if (f.kronecker()) {
      APUS_CHECK(f.kept.empty(), f.source, ": a LoKr's rows cut twice");
      f.kept = rows;
      continue;
    }
    f.inner.up = rows_copy(f.inner.up, rows);
    if (f.decomposed()) f.magnitude = rows_copy(f.magnitude, rows);
  }
}

void Adapters::upload(Backend& device) {
  for (auto& [weight, factors] : by_weight_)
    for (LowRank& f : factors)
      for (Factor* part : {&f.inner, &f.outer})
        for (Tensor* t : {&part->down, &part->up})
          if (t->defined()) *t = device.upload(*t);
}

const Adapters::Gain& Adapters::gain(Context& c, const LowRank& f, const Tensor& w, const Tensor* bias) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto cached = gains_.find(&f);
  if (cached != gains_.end()) return cached->second;
  const int64_t out = w.dim(0), in = w.dim(1), r = f.inner.down.dim(0);
  if (c.count_only) {
    static const Gain counted{Tensor::shape_only({out}, DType::f32), Tensor::shape_only({out}, DType::f32)};
    return counted;
  }
  // ||W_o + sΔ_o||² = ||W_o||² + 2s B_o·(A W^T)_o + s² B_o (A A^T) B_o^T, all in fp32: A W^T as one
  // GEMM of the weight as the linear reads it, the rest on the host (r is small).
  const Tensor a = to_dtype(ops::to_host(c, f.inner.down), DType::f32),
               b = to_dtype(ops::to_host(c, f.inner.up), DType::f32);
  Tensor aw;
  {
    ArenaScope arena(*c.arena);
    const AdapterScope plain(c, nullptr);
    const Tensor a_dev = ops::to_context(c, a);
    Tensor product = Tensor::in(*c.arena, {r, out}, DType::f32);
    ops::linear(c, a_dev, w, nullptr, product);
    aw = to_dtype(ops::to_host(c, product), DType::f32);
  }
  const Tensor wh = to_dtype(ops::to_host(c, w), DType::f32);
  std::vector<double> gram(size_t(r * r));  // A A^T
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < r; ++j) {
      float acc = 0;
      for (int64_t k = 0; k < in; ++k) acc += a.ptr<float>()[i * in + k] * a.ptr<float>()[j * in + k];
      gram[size_t(i * r + j)] = acc;
    }
  const Tensor bias_h = bias ? to_dtype(ops::to_host(c, *bias), DType::f32) : Tensor();
  Tensor scale = Tensor::heap({out}, DType::f32), shift = Tensor::heap({out}, DType::f32);
  const double s = f.scale;
  for (int64_t o = 0; o < out; ++o) {
    const float* row = wh.ptr<float>() + o * in;
    const float* bo = b.ptr<float>() + o * r;
    float w2 = 0;
    for (int64_t k = 0; k < in; ++k) w2 += row[k] * row[k];
    double cross = 0, delta2 = 0;
    for (int64_t i = 0; i < r; ++i) {
      cross += double(bo[i]) * aw.ptr<float>()[i * out + o];
      for (int64_t j = 0; j < r; ++j) delta2 += double(bo[i]) * gram[size_t(i * r + j)] * bo[j];
    }
    const double norm = std::sqrt(std::max(0.0, double(w2) + 2 * s * cross + s * s * delta2));
    const float gain = float(double(load_f32(f.magnitude, o)) / (norm + 1e-12));
    scale.ptr<float>()[o] = gain;
    shift.ptr<float>()[o] = bias ? (1 - gain) * bias_h.ptr<float>()[o] : 0.0f;
  }
  return gains_.emplace(&f, Gain{ops::to_context(c, scale), ops::to_context(c, shift)}).first->second;
}

void Adapters::mark_applied(const std::string& weight) const {
  std::lock_guard<std::mutex> lock(mutex_);
  applied_.insert(weight);
}

std::vector<std::string> Adapters::unapplied() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> missing;
  for (const auto& [weight, factors] : by_weight_)
    if (!applied_.count(weight)) missing.push_back(weight);
  return missing;
}

AdapterScope::AdapterScope(Context& c, const Adapters* adapters) : c_(c), previous_(c.adapters) {
  c.adapters = adapters && !adapters->empty() ? adapters : nullptr;
}

AdapterScope::~AdapterScope() { c_.adapters = previous_; }

namespace ops {

namespace {

// y [m, f.rows()] = x [m, f.cols()] · f^T, rounded to the activation dtype after each product.
void apply_factor(Context& c, const Tensor& x, const Factor& f, Tensor& y) {
  if (!f.down.defined()) return linear(c, x, f.up, nullptr, y);
  Tensor low = Tensor::in(*c.arena, {x.dim(0), f.down.dim(0)}, c.act);
  linear(c, x, f.down, nullptr, low);
  linear(c, low, f.up, nullptr, y);
}

// term [n, a·p] = x [n, c·q] · kron(outer [a, c], inner [p, q])^T without forming the product:
// each row of x as a [c, q] matrix X gives outer · X · inner^T.
void apply_kronecker(Context& c, const Tensor& x, const LowRank& f, Tensor& term) {
  const int64_t n = x.dim(0), a = f.outer.rows(), cc = f.outer.cols(), p = f.inner.rows(), q = f.inner.cols();
  Tensor dense = x;
  if (!x.contiguous()) {
    dense = Tensor::in(*c.arena, x.shape, x.dtype);
    copy(c, x, dense);
  }
  Tensor by_inner = Tensor::in(*c.arena, {n * cc, p}, c.act);
  apply_factor(c, dense.reshape({n * cc, q}), f.inner, by_inner);
  Tensor swapped = Tensor::in(*c.arena, {n, p, cc}, c.act);
  permute(c, by_inner.reshape({n, cc, p}), swapped, {0, 2, 1});
  Tensor by_outer = Tensor::in(*c.arena, {n * p, a}, c.act);
  apply_factor(c, swapped.reshape({n * p, cc}), f.outer, by_outer);
  Tensor out = term.reshape({n, a, p});
  permute(c, by_outer.reshape({n, p, a}), out, {0, 2, 1});
}

}  // namespace

void apply_adapters(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  if (!c.adapters || !w.weight_name) return;
  const std::vector<LowRank>* factors = c.adapters->find(*w.weight_name);
  if (!factors) return;
  const Adapters* adapters = c.adapters;
  // The adapter's own products are plain linears: no adapters of their own.
  AdapterScope plain(c, nullptr);
  for (const LowRank& f : *factors) {
    APUS_CHECK(f.cols() == w.dim(1) && f.held_rows() == w.dim(0), f.source, ": '", *w.weight_name, "' is used as ",
               shape_str(w.shape), " where the adapter fits ", shape_str({f.held_rows(), f.cols()}));
    ArenaScope arena(*c.arena);
    Tensor term = Tensor::in(*c.arena, y.shape, c.act);
    if (f.kronecker() && !f.kept.empty()) {
      // The rows the weight holds of the whole term, its columns here.
      Tensor whole = Tensor::in(*c.arena, {y.dim(0), f.rows()}, c.act);
      apply_kronecker(c, x, f, whole);
      int64_t at = 0;
      for (const Share& s : f.kept) {
        Tensor to = term.cols(at, at + s.count);
        if (s.count > 0) copy(c, whole.cols(s.first, s.first + s.count), to);
        at += s.count;
      }
    } else if (f.kronecker()) {
      apply_kronecker(c, x, f, term);
    } else {
      apply_factor(c, x, f.inner, term);
    }
    const float scale = f.scale;
    const Tensor gate = host_filled(c, {y.dim(1)}, DType::f32, [&](Tensor& g) {
      for (int64_t i = 0; i < g.numel(); ++i) g.ptr<float>()[i] = scale;
    });
    add_gated(c, y, term, &gate, Rounding::each_step);
    if (f.decomposed()) {
      const Adapters::Gain& g = adapters->gain(c, f, w, bias);
      affine(c, y, g.scale, g.shift, y, Rounding::once);
    }
  }
  adapters->mark_applied(*w.weight_name);
}

}  // namespace ops
}  // namespace apus
