#pragma once
// How far a backend's op output may be from the reference backend's: shared by the op tests of
// every backend (test_ops.cpp for the CPU, test_cuda_ops.cpp for CUDA).
#include <algorithm>
#include <cmath>

#include "core/tensor.h"
#include "test_util.h"

namespace apus {

struct Agreement {
  double rel_l2 = 0;          // ||cpu - ref|| / ||ref||
  double differing = 0;       // share of elements that are not bit-equal
  double worst_ulps = 0;      // largest difference in bf16 ulps of the reference value
};

inline Agreement agreement(const Tensor& cpu_out, const Tensor& ref_out) {
  const auto a = to_f32_vector(cpu_out), b = to_f32_vector(ref_out);
  Agreement g;
  g.rel_l2 = test::rel_l2(a, b);
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    ++differ;
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(b[i]), 1e-30f)) - 7);
    g.worst_ulps = std::max(g.worst_ulps, std::fabs(double(a[i]) - b[i]) / ulp);
  }
  g.differing = double(differ) / double(std::max<size_t>(a.size(), 1));
  return g;
}

// inner_rounding: the op rounds an intermediate that a sum then reads (attention's probabilities
// before P·V). A flip there moves an output by one ulp of that intermediate, which can be several
// ulps of an output that cancels to near zero; such outputs are held to a relative L2 far below
// one bf16 rounding (2^-9) instead of the per-element ulp count.
inline bool within_bound(const Agreement& g, DType dt, bool inner_rounding = false) {
  if (dt == DType::f32) return g.rel_l2 < 2e-6;
  if (g.differing > 0.01) return false;
  return inner_rounding ? g.rel_l2 < 5e-4 : g.worst_ulps <= 2.0;
}

}  // namespace apus
