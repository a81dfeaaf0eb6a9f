#pragma once
// A layer whose output features are dealt out over a split's ranks (issue 43): under cfg and
// Ulysses every rank holds the same input to the stages that run whole on each (klein's text
// encoder and VAE), so each rank computes its share of every linear's or convolution's output
// features and they are all-gathered: every rank then holds the whole output and runs the rest
// (norms, activations, sums, attention) whole. An output feature is the same arithmetic at any
// share (its reduction runs over the inputs), so the result is one process's bit for bit.
#include <cstdint>
#include <vector>

#include "apus/apus.h"
#include "core/share.h"
#include "models/common/exchange.h"
#include "ops/ops.h"

namespace apus {

struct FeatureSplit {
  const ProcessGroup* ranks = nullptr;  // null or one: every layer whole
  double gathered = 0;                  // the outputs' bytes, for the cost log, split or not
  bool splits() const { return ranks && ranks->size() > 1; }
};

// y viewed as [outer, features * inner] (a linear: [rows, features], inner 1; a convolution:
// [samples, channels * pixels]); compute(first, count, part) writes features [first, first +
// count) into `part` [outer, count * inner]. Without a split it writes all of them into y.
template <typename Compute> void split_features(Context& c, FeatureSplit* split, Tensor& y, int64_t outer,
                                                int64_t features, int64_t inner, const char* what, Compute&& compute) {
  if (split) split->gathered += double(y.nbytes());
  if (!split || !split->splits()) {
    Tensor whole = y.reshape({outer, features * inner});
    compute(int64_t(0), features, whole);
    return;
  }
  const ProcessGroup& ranks = *split->ranks;
  const int n = ranks.size(), me = ranks.rank();
  // Every rank's features, one rank after another: [rank][outer][its features * inner].
  std::vector<int64_t> at{0};
  std::vector<size_t> bytes;
  for (int r = 0; r < n; ++r) {
    at.push_back(at.back() + outer * share_of(features, r, n).count * inner);
    bytes.push_back(dtype_bytes(y.dtype, at.back() - at[size_t(r)]));
  }
  ArenaScope scope(*c.arena);
  Tensor flat = Tensor::in(*c.arena, {at.back()}, y.dtype);
  const Share mine = share_of(features, me, n);
  if (mine.count > 0) {
    Tensor part = flat.rows(at[size_t(me)], at[size_t(me) + 1]).reshape({outer, mine.count * inner});
    compute(mine.first, mine.count, part);
  }
  all_gather(c, ranks, flat.data, bytes, what);
  if (c.count_only) return;
  Tensor planes = y.reshape({outer, features * inner});
  for (int r = 0; r < n; ++r) {
    const Share s = share_of(features, r, n);
    if (s.count == 0) continue;
    Tensor to = planes.cols(s.first * inner, (s.first + s.count) * inner);
    ops::copy(c, flat.rows(at[size_t(r)], at[size_t(r) + 1]).reshape({outer, s.count * inner}), to);
  }
}

// ops::linear (no adapters' scope of its own), its output features over `split`'s ranks.
inline void linear(Context& c, FeatureSplit* split, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y,
                   const char* what) {
  split_features(c, split, y, y.shape[0], y.shape[1], 1, what, [&](int64_t first, int64_t count, Tensor& part) {
    if (count == y.shape[1]) return ops::linear(c, x, w, bias, part);
    const Tensor b = bias ? bias->rows(first, first + count) : Tensor{};
    ops::linear(c, x, w.rows(first, first + count), bias ? &b : nullptr, part);
  });
}

}  // namespace apus
