#pragma once
// Tensor parallelism (issue 43, Parallel::tensor): a transformer's block linears held as each
// rank's share of their output features (q, k and v by whole attention heads, the others by
// features), each rank loading only its rows (WeightLoader::get_rows), every rank running every
// token. Attention runs on the rank's own heads; where the next op needs every feature (a
// projection's input, the residual stream) the shares are all-gathered (ColumnExchange). An
// output feature is the same arithmetic at any share (its reduction runs over all the inputs),
// so the result is one process's bit for bit. Against Megatron's pairs of a column- and a
// row-split linear (one all-reduce of partial sums per pair), the second linear's input is
// gathered too (1.5x the bytes over the wire for a double block, 2.5x for a single block's wide
// linear2: ~2.2x for klein, `apus roofline --chips N`) and no sum changes its order.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"
#include "core/share.h"
#include "models/common/feature_split.h"

namespace apus {

class TensorSplit {
 public:
  TensorSplit() = default;  // whole weights
  // A transformer of `heads` heads of head_dim, residual width `hidden` and MLP width `mlp` over
  // `ranks` (null or one rank: whole).
  TensorSplit(const ProcessGroup* ranks, int64_t heads, int64_t head_dim, int64_t hidden, int64_t mlp)
      : ranks_(ranks && ranks->size() > 1 ? ranks : nullptr), heads_{heads, head_dim}, hidden_{hidden}, mlp_{mlp} {
    if (!ranks_) return;
    APUS_CHECK(ranks_->size() <= hidden && ranks_->size() <= mlp, "parallel tensor over ", ranks_->size(),
               " ranks: the transformer's widths (", hidden, ", MLP ", mlp, ") give some rank no features");
  }
  bool splits() const { return ranks_ != nullptr; }
  const ProcessGroup* ranks() const { return ranks_; }

  // The column groups: whole heads of q, k, v and the attention's output; the residual stream's
  // features; the MLP's features.
  ColumnGroup heads() const { return heads_; }
  ColumnGroup hidden() const { return hidden_; }
  ColumnGroup mlp() const { return mlp_; }
  // This rank's columns of a group (all of them without a split).
  int64_t cols(const ColumnGroup& g) const { return share(g).count * g.unit; }
  // A block linear's weight or bias of `shape`: its rows `rows` (this rank's, as rows() gives them)
  // under a split, else the whole tensor.
  Tensor fetch(const WeightLoader& w, const std::string& name, const Shape& shape,
               const std::vector<Share>& rows) const {
    return splits() ? w.get_rows(name, shape, rows) : w.get(name, shape);
  }
  // The same with the rows looked up by name in `held` (a model's held_rows: empty without a split).
  Tensor fetch(const WeightLoader& w, const std::map<std::string, std::vector<Share>>& held, const std::string& name,
               const Shape& shape) const {
    return splits() ? w.get_rows(name, shape, held.at(name)) : w.get(name, shape);
  }
  // y [rows, hidden] = x · w^T (+ bias), a linear whose input is whole on every rank and whose
  // weight holds this rank's share of the residual stream's features: each rank computes its
  // features (a row-parallel linear to the cost model) and they are gathered into y.
  void project(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, const char* what) const {
    Columns out(c, *this, y, {hidden()});
    {
      RowParallel row(c);
      ops::linear(c, x, w, bias, out.mine());
    }
    out.gather(what);
  }
  // This rank's rows of a weight whose output features are `g`'s, starting at row `base` (a
  // fused weight's part): the loader's ranges.
  Share rows(const ColumnGroup& g, int64_t base = 0) const {
    const Share s = share(g);
    return {base + s.first * g.unit, s.count * g.unit};
  }

  // Where this rank computes its columns of y's groups: y itself without a split, else the
  // exchange's buffer; gather() then fills y (nothing to do without a split).
  class Columns {
   public:
    Columns(Context& c, const TensorSplit& split, Tensor& y, std::vector<ColumnGroup> groups) : y_(y) {
      if (split.splits()) exchange_.emplace(c, *split.ranks_, y.shape[0], y.dtype, std::move(groups));
    }
    Tensor& mine() { return exchange_ ? exchange_->mine() : y_; }
    void gather(const char* what) {
      if (exchange_) exchange_->gather(y_, what);
    }

   private:
    Tensor& y_;
    std::optional<ColumnExchange> exchange_;
  };

 private:
  const ProcessGroup* ranks_ = nullptr;
  ColumnGroup heads_{0}, hidden_{0}, mlp_{0};
  Share share(const ColumnGroup& g) const {
    return ranks_ ? share_of(g.units, ranks_->rank(), ranks_->size()) : Share{0, g.units};
  }
};

}  // namespace apus
