#pragma once
// A layer whose output features are dealt out over a split's ranks (issue 43): under cfg and
// Ulysses every rank holds the same input to the stages that run whole on each (klein's text
// encoder and VAE), so each rank computes its share of every linear's or convolution's output
// features and they are all-gathered: every rank then holds the whole output and runs the rest
// (norms, activations, sums, attention) whole. An output feature is the same arithmetic at any
// share (its reduction runs over the inputs), so the result is one process's bit for bit.
#include <cstdint>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"
#include "core/share.h"
#include "io/weights/weight_source.h"
#include "models/common/exchange.h"
#include "ops/ops.h"

namespace apus {

struct FeatureSplit {
  const ProcessGroup* ranks = nullptr;  // null or one: every layer whole
  // The weights (and biases) handed to linear() are this rank's share of their output features
  // already, loaded so (tensor parallelism: WeightLoader::get_rows), not whole.
  bool held = false;
  double gathered = 0;  // the outputs' bytes, for the cost log, split or not
  bool splits() const { return ranks && ranks->size() > 1; }
};

// A block of y's columns dealt out over a group's ranks: `units` units of `unit` columns each
// (a linear's features: units of 1; attention heads: units of head_dim), rank r holding
// share_of(units, r, n) of them.
struct ColumnGroup {
  int64_t units, unit = 1;
};

// y [outer, sum of the groups' units * unit] (its groups side by side) dealt out over a group's
// ranks: this rank writes its share of every group's columns (side by side) into mine(), then
// gather() (one all-gather) puts every rank's share in its place in y. The buffer is taken from
// c's arena: the caller's ArenaScope must outlast the exchange.
class ColumnExchange {
 public:
  ColumnExchange(Context& c, const ProcessGroup& ranks, int64_t outer, DType dtype, std::vector<ColumnGroup> groups)
      : c_(c), ranks_(ranks), groups_(std::move(groups)), outer_(outer) {
    at_.push_back(0);
    for (int r = 0; r < ranks.size(); ++r) {
      int64_t width = 0;
      for (const ColumnGroup& g : groups_) width += share_of(g.units, r, ranks.size()).count * g.unit;
      widths_.push_back(width);
      at_.push_back(at_.back() + outer * width);
      bytes_.push_back(dtype_bytes(dtype, outer * width));
    }
    flat_ = Tensor::in(*c.arena, {at_.back()}, dtype);
    mine_ = slot(ranks.rank());
  }
  // This rank's columns [outer, its width].
  Tensor& mine() { return mine_; }
  void gather(Tensor& y, const char* what) {
    all_gather(c_, ranks_, flat_.data, bytes_, what);
    if (c_.count_only) return;
    for (int r = 0; r < ranks_.size(); ++r) {
      const Tensor from = slot(r);
      int64_t col = 0, base = 0;
      for (const ColumnGroup& g : groups_) {
        const Share s = share_of(g.units, r, ranks_.size());
        if (s.count > 0) {
          Tensor to = y.cols(base + s.first * g.unit, base + (s.first + s.count) * g.unit);
          ops::copy(c_, from.cols(col, col + s.count * g.unit), to);
        }
        col += s.count * g.unit;
        base += g.units * g.unit;
      }
    }
  }

 private:
  Context& c_;
  const ProcessGroup& ranks_;
  std::vector<ColumnGroup> groups_;
  int64_t outer_;
  std::vector<int64_t> widths_;  // each rank's columns, all groups
  std::vector<int64_t> at_;      // where each rank's columns start in flat_: [rank][outer][its width]
  std::vector<size_t> bytes_;
  Tensor flat_, mine_;
  Tensor slot(int r) const {
    return flat_.rows(at_[size_t(r)], at_[size_t(r) + 1]).reshape({outer_, widths_[size_t(r)]});
  }
};

// y viewed as [outer, features * inner] (a linear: [rows, features], inner 1; a convolution:
// [samples, channels * pixels]); compute(first, count, part) writes features [first, first +
// count) into `part` [outer, count * inner]. Without a split it writes all of them into y.
template <typename Compute> void split_features(Context& c, FeatureSplit* split, Tensor& y, int64_t outer,
                                                int64_t features, int64_t inner, const char* what, Compute&& compute) {
  if (split) split->gathered += double(y.nbytes());
  Tensor planes = y.reshape({outer, features * inner});
  if (!split || !split->splits()) {
    compute(int64_t(0), features, planes);
    return;
  }
  const ProcessGroup& ranks = *split->ranks;
  const Share mine = share_of(features, ranks.rank(), ranks.size());
  ArenaScope scope(*c.arena);
  ColumnExchange exchange(c, ranks, outer, y.dtype, {{features, inner}});
  if (mine.count > 0) compute(mine.first, mine.count, exchange.mine());
  exchange.gather(planes, what);
}

// A linear's weight for a FeatureSplit over `held` (tensor parallelism: FeatureSplit::held): this
// rank's share of its output features; the whole weight without (null or one rank).
inline Tensor held_features(const WeightLoader& w, const ProcessGroup* held, const std::string& name,
                            const Shape& shape) {
  if (!held || held->size() == 1) return w.get(name, shape);
  return w.get_rows(name, shape, {share_of(shape[0], held->rank(), held->size())});
}

// ops::linear (no adapters' scope of its own), its output features over `split`'s ranks.
inline void linear(Context& c, FeatureSplit* split, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
                   const char* what) {
  split_features(c, split, y, y.shape[0], y.shape[1], 1, what, [&](int64_t first, int64_t count, Tensor& part) {
    if (count == y.shape[1] || split->held) {
      APUS_CHECK(w.shape[0] == count, "a linear of ", w.shape[0], " output features for a share of ", count);
      return ops::linear(c, x, w, bias, part);
    }
    const Tensor b = bias ? bias->rows(first, first + count) : Tensor{};
    ops::linear(c, x, w.rows(first, first + count), bias ? &b : nullptr, part);
  });
}

}  // namespace apus
