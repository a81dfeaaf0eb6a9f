#include "ops/adapters.h"

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
  by_weight_[weight].push_back(std::move(f));
}

const std::vector<LowRank>* Adapters::find(const std::string& weight) const {
  const auto it = by_weight_.find(weight);
  return it == by_weight_.end() ? nullptr : &it->second;
}

void Adapters::upload(Backend& device) {
  for (auto& [weight, factors] : by_weight_)
    for (LowRank& f : factors)
      for (Factor* part : {&f.inner, &f.outer})
        for (Tensor* t : {&part->down, &part->up})
          if (t->defined()) *t = device.upload(*t);
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

void apply_adapters(Context& c, const Tensor& x, const Tensor& w, Tensor& y) {
  if (!c.adapters || !w.weight_name) return;
  const std::vector<LowRank>* factors = c.adapters->find(*w.weight_name);
  if (!factors) return;
  const Adapters* adapters = c.adapters;
  // The adapter's own products are plain linears: no adapters of their own.
  AdapterScope plain(c, nullptr);
  for (const LowRank& f : *factors) {
    APUS_CHECK(f.cols() == w.dim(1) && f.rows() == w.dim(0), f.source, ": '", *w.weight_name, "' is used as ",
               shape_str(w.shape), " where the adapter fits ", shape_str({f.rows(), f.cols()}));
    ArenaScope arena(*c.arena);
    Tensor term = Tensor::in(*c.arena, y.shape, c.act);
    if (f.kronecker()) apply_kronecker(c, x, f, term);
    else apply_factor(c, x, f.inner, term);
    const float scale = f.scale;
    const Tensor gate = host_filled(c, {y.dim(1)}, DType::f32, [&](Tensor& g) {
      for (int64_t i = 0; i < g.numel(); ++i) g.ptr<float>()[i] = scale;
    });
    add_gated(c, y, term, &gate, Rounding::each_step);
  }
  adapters->mark_applied(*w.weight_name);
}

}  // namespace ops
}  // namespace apus
