#include "ops/adapters.h"

#include "core/error.h"
#include "ops/backend.h"
#include "ops/ops.h"

namespace apus {

void Adapters::add(const std::string& weight, const Shape& weight_shape, LowRank f) {
  APUS_CHECK(weight_shape.size() == 2, f.source, ": adapts '", weight, "' of shape ", shape_str(weight_shape),
             ", which is no linear's weight");
  APUS_CHECK(f.down.rank() == 2 && f.up.rank() == 2 && f.down.dim(0) == f.up.dim(1), f.source, ": down ",
             shape_str(f.down.shape), " and up ", shape_str(f.up.shape), " are no low-rank pair (expected [r, in] and [out, r])");
  APUS_CHECK(f.down.dim(1) == weight_shape[1] && f.up.dim(0) == weight_shape[0], f.source, ": down ",
             shape_str(f.down.shape), " and up ", shape_str(f.up.shape), " do not fit '", weight, "' ",
             shape_str(weight_shape), " (expected [r, ", weight_shape[1], "] and [", weight_shape[0], ", r])");
  by_weight_[weight].push_back(std::move(f));
}

const std::vector<LowRank>* Adapters::find(const std::string& weight) const {
  const auto it = by_weight_.find(weight);
  return it == by_weight_.end() ? nullptr : &it->second;
}

void Adapters::upload(Backend& device) {
  for (auto& [weight, factors] : by_weight_)
    for (LowRank& f : factors) {
      f.down = device.upload(f.down);
      f.up = device.upload(f.up);
    }
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

void apply_adapters(Context& c, const Tensor& x, const Tensor& w, Tensor& y) {
  if (!c.adapters || !w.weight_name) return;
  const std::vector<LowRank>* factors = c.adapters->find(*w.weight_name);
  if (!factors) return;
  const Adapters* adapters = c.adapters;
  // The adapter's own products are plain linears: no adapters of their own.
  AdapterScope plain(c, nullptr);
  for (const LowRank& f : *factors) {
    APUS_CHECK(f.down.dim(1) == w.dim(1) && f.up.dim(0) == w.dim(0), f.source, ": '", *w.weight_name,
               "' is used as ", shape_str(w.shape), " where the adapter fits ", shape_str({f.up.dim(0), f.down.dim(1)}));
    ArenaScope arena(*c.arena);
    Tensor low = Tensor::in(*c.arena, {x.dim(0), f.down.dim(0)}, c.act);
    Tensor term = Tensor::in(*c.arena, y.shape, c.act);
    linear(c, x, f.down, nullptr, low);
    linear(c, low, f.up, nullptr, term);
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
