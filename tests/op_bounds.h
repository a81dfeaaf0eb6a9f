#pragma once
// How far a backend's op output may be from the reference backend's: what the op table
// (test_op_table.cpp) holds every backend to, and the CPU's own op tests (test_ops.cpp) use.
#include <algorithm>
#include <cmath>

#include "core/tensor.h"
#include "test_util.h"

namespace apus {

struct Agreement {
  double rel_l2 = 0;                  // ||cpu - ref|| / ||ref||
  double differing = 0;               // share of elements that are not bit-equal
  double worst_ulps = 0;              // largest difference in bf16 ulps of the reference value
  double worst_ulps_above_floor = 0;  // ... of the difference beyond kAccumulationFloor x RMS(ref)
};

// fp32 accumulation (a backend) and f64 (the reference) differ by up to about n 2^-24 of a sum's
// summed magnitudes: an absolute error, many bf16 ulps of an output that cancels to near zero
// (10 "ulps" of such a linear output, measured). 2^-13 of the output's RMS covers sums of a few
// thousand terms at the output's scale and is 2^-6 of one bf16 rounding of a typical element, so a
// dropped rounding rule (one ulp in 12-70 % of the elements) still fails the 1 % rule.
constexpr double kAccumulationFloor = 1.0 / 8192;

inline Agreement agreement(const Tensor& cpu_out, const Tensor& ref_out) {
  const auto a = to_f32_vector(cpu_out), b = to_f32_vector(ref_out);
  Agreement g;
  g.rel_l2 = test::rel_l2(a, b);
  double squares = 0;
  for (const float v : b) squares += double(v) * double(v);
  const double floor = kAccumulationFloor * std::sqrt(squares / double(std::max<size_t>(b.size(), 1)));
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    ++differ;
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(b[i]), 1e-30f)) - 7);
    const double diff = std::fabs(double(a[i]) - b[i]);
    g.worst_ulps = std::max(g.worst_ulps, diff / ulp);
    g.worst_ulps_above_floor = std::max(g.worst_ulps_above_floor, std::max(diff - floor, 0.0) / ulp);
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
  return inner_rounding ? g.rel_l2 < 5e-4 : g.worst_ulps_above_floor <= 2.0;
}

// What an op case's outputs are held to.
enum class Bound {
  rounding,        // within_bound in the output's dtype
  inner_rounding,  // within_bound with inner_rounding (above)
  exact,           // every element equal: pixels, whose rounding to u8 both backends do alike
  // rel L2 2e-7 in f32: RoPE tables, transcendentals of the same float angle, where libm's float
  // and double results agree to an ulp.
  tables,
};

inline bool holds(Bound bound, const Agreement& g, DType dt) {
  switch (bound) {
    case Bound::rounding:
      return within_bound(g, dt);
    case Bound::inner_rounding:
      return within_bound(g, dt, true);
    case Bound::exact:
      return g.differing == 0;
    case Bound::tables:
      return g.rel_l2 < 2e-7;
  }
  return false;
}

}  // namespace apus
