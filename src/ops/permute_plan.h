#pragma once
// The index arithmetic of ops::permute, shared by the backends: y's extents and, for each of y's
// axes, the stride in x that stepping it steps. Checks the operands as the op list's contract says.
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace apus {

struct PermutePlan {
  int rank = 0;
  int64_t dims[6] = {}, from[6] = {};
};

inline PermutePlan permute_plan(const Tensor& x, const Tensor& y, const std::vector<int>& perm) {
  const int rank = x.rank();
  APUS_CHECK(rank <= 6 && int(perm.size()) == rank && y.rank() == rank && x.dtype == y.dtype && x.contiguous() &&
                 y.contiguous(),
             "permute: x ", shape_str(x.shape), ", y ", shape_str(y.shape), ", ", perm.size(), " axes");
  PermutePlan plan;
  plan.rank = rank;
  int64_t x_stride[6] = {}, s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    x_stride[i] = s;
    s *= x.shape[size_t(i)];
  }
  bool seen[6] = {};
  for (int i = 0; i < rank; ++i) {
    const int p = perm[size_t(i)];
    APUS_CHECK(p >= 0 && p < rank && !seen[p] && y.shape[size_t(i)] == x.shape[size_t(p)],
               "permute: axis order and shapes do not agree: x ", shape_str(x.shape), ", y ", shape_str(y.shape));
    seen[p] = true;
    plan.dims[i] = y.shape[size_t(i)];
    plan.from[i] = x_stride[p];  // stepping y's axis i steps x's axis perm[i]
  }
  return plan;
}

}  // namespace apus
