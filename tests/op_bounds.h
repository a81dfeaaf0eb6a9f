#pragma once
// How far a backend's op output may be from the reference backend's: what the op table
// (test_op_table.cpp) holds every backend to, and the CPU's own op tests (test_ops.cpp) use.
#include <algorithm>
#include <cmath>
#include <vector>

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

// Attention through a fused softmax (FlashAttention's and cuDNN's SDPA: the kernels torch's SDPA
// runs on a GPU, so the official pipelines' own bf16 numerics there, cuda.attention=cudnn):
// exp(s - m) against a running maximum m is rounded to bf16 before P·V and the row's sum divides
// last, where the contract rounds exp(s - max) / sum. Each probability is still rounded once
// (relative error <= u = 2^-8), the sum perhaps formed from the rounded terms (as much again), the
// output rounded once: against the exact attention a (the reference in f32 on the same inputs)
// every element is within
//   2u |a| + (u + 2^-13) sum_j p_j |v_j|        (2^-13: fp32 sums over a few thousand keys)
// where sum_j p_j |v_j| is the exact attention of |v|; a difference of two such terms (the
// differential form, each rounded first) within both terms' allowances and u of the difference.
// That worst case cannot see probabilities rounded more coarsely (their errors average out over a
// row's keys), so the relative L2 distance from the exact output is held to the contract's own
// (the bf16 reference's) times 1.25 as well: both round the output once and each probability once,
// and the probabilities' share of the error is the output's over the square root of the keys a
// row sees (hundreds in the op table); probabilities rounded to 4 bits instead of 8 give ten times
// the distance (FusedSoftmaxBound in test_op_table.cpp).
constexpr double kProbabilityRounding = 1.0 / 256;

// One term's allowance at an element: its exact value a, the exact attention of |v| there m.
inline double fused_term_allowance(double a, double m) {
  return 2 * kProbabilityRounding * std::fabs(a) + (kProbabilityRounding + 1.0 / 8192) * m;
}

struct FusedAgreement {
  double worst = 0;            // largest |mine - exact| over its element's allowance
  double rel_l2 = 0;           // ||mine - exact|| / ||exact||
  double contract_rel_l2 = 0;  // ||contract - exact|| / ||exact||
};

// Elements whose exact value or allowance is not finite are left out (the caller compares those).
inline FusedAgreement fused_agreement(const Tensor& mine, const Tensor& contract, const Tensor& exact,
                                      const std::vector<double>& allowance) {
  const auto a = to_f32_vector(mine), c = to_f32_vector(contract), o = to_f32_vector(exact);
  FusedAgreement g;
  double mine_sq = 0, contract_sq = 0, exact_sq = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    if (!std::isfinite(o[i]) || !std::isfinite(allowance[i])) continue;
    g.worst = std::max(g.worst, std::fabs(double(a[i]) - o[i]) / (allowance[i] + 1e-30));
    mine_sq += (double(a[i]) - o[i]) * (double(a[i]) - o[i]);
    contract_sq += (double(c[i]) - o[i]) * (double(c[i]) - o[i]);
    exact_sq += double(o[i]) * o[i];
  }
  g.rel_l2 = std::sqrt(mine_sq / std::max(exact_sq, 1e-300));
  g.contract_rel_l2 = std::sqrt(contract_sq / std::max(exact_sq, 1e-300));
  return g;
}

inline bool holds_fused(const FusedAgreement& g) { return g.worst <= 1 && g.rel_l2 <= 1.25 * g.contract_rel_l2; }

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
