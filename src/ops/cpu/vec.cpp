#include "ops/cpu/vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/clones.h"
#include "core/dtype.h"

namespace apus::cpu {

namespace {

// exp by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial (a few ulp over the
// clamped range, tests/test_ops.cpp bounds it); unlike libm's expf the compiler vectorises it.
// ln2 is split in two (Cody-Waite): n * high is exact, so it must be subtracted first and the
// low part after; the other order loses the low bits of r for large |n|. Helpers are forced inline so
// each target clone compiles them for its own ISA (an outlined copy would be baseline x86-64,
// with fma as a libm call).
// exp(x) for x already in [-87, 88], where the exponent bits below stay in range: x = n ln2 + r
// (ln2 in two parts), a degree-6 polynomial in r, times 2^n.
__attribute__((always_inline)) inline float exp_in_range(float x) {
  using E = ExpConstants;
  const float n = std::nearbyint(x * E::log2e);
  const float r = std::fma(n, E::ln2_low, std::fma(n, E::ln2_high, x));
  // Spelled out: a loop here keeps the callers' loops from vectorising.
  float p = E::poly[0];
  p = std::fma(p, r, E::poly[1]);
  p = std::fma(p, r, E::poly[2]);
  p = std::fma(p, r, E::poly[3]);
  p = std::fma(p, r, E::poly[4]);
  p = std::fma(p, r, E::poly[5]);
  p = std::fma(p, r, E::poly[6]);
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

__attribute__((always_inline)) inline float exp_poly(float in) {
  // Clamped into exp_in_range's range; NaN is clamped too (a NaN to int conversion is undefined)
  // and handed back unchanged at the end, so it still propagates.
  const float x = in > 88.0f ? 88.0f : (in >= -87.0f ? in : -87.0f);
  return in == in ? exp_in_range(x) : in;
}

// tanh(x) = 1 - 2 / (exp(2x) + 1); exact at the ends (exp saturates to 0 or inf), NaN stays NaN.
// Near 0 that identity cancels (its absolute error ~1e-7 is a large relative one: 187 bf16 ulps
// of a DyT output found by the op test), so |x| < 1/4 takes tanh's odd Taylor polynomial to x^9
// (the next term is 1e-8 relative there).
__attribute__((always_inline)) inline float tanh_poly(float x) {
  const float x2 = x * x;
  float p = 62.0f / 2835;
  p = std::fma(p, x2, -17.0f / 315);
  p = std::fma(p, x2, 2.0f / 15);
  p = std::fma(p, x2, -1.0f / 3);
  const float small = std::fma(x * x2, p, x);
  const float large = 1.0f - 2.0f / (exp_poly(2.0f * x) + 1.0f);
  return std::fabs(x) < 0.25f ? small : large;
}

}  // namespace

APUS_CLONES void bf16_to_f32_row(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = uint32_t(in[i]) << 16;
    std::memcpy(&out[i], &u, 4);
  }
}

APUS_CLONES void f32_to_bf16_row(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &in[i], 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    out[i] = uint16_t(nan ? ((u >> 16) | 0x40u) : rounded);
  }
}

APUS_CLONES bool finite_row(const float* v, int64_t n) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    bad |= (u & 0x7f800000u) == 0x7f800000u;
  }
  return !bad;
}

APUS_CLONES void silu_row(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] / (1.0f + exp_poly(-v[i]));
}

// x/2 (1 + tanh(u)) written as x / (1 + exp(-2u)): the same function without the cancellation of
// 1 + tanh(u) for u << 0, which costs the plain form ~45 ulp on the tiny outputs there. Where
// torch's float tanh(u) rounds to -1 (2u < -18) its result is exactly 0, and so is this one.
APUS_CLONES void gelu_tanh_row(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    v[i] = 2.0f * u < -18.0f ? 0.0f * x : x / (1.0f + exp_poly(-2.0f * u));
  }
}

APUS_CLONES void tanh_row(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = tanh_poly(v[i]);
}

namespace {

__attribute__((always_inline)) inline float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t nan = (u & 0xffff0000u) | 0x00400000u;
  u = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace

APUS_CLONES void round_bf16_row(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = bf16_round(v[i]);
}

APUS_CLONES void rope_row(float* v, int64_t n, int64_t head_dim, const float* cos, const float* sin, int64_t half,
                          bool interleaved, bool rounded) {
  // One loop per case, each a plain vector loop (the pairs of one j never alias).
  for (int64_t h = 0; h < n; h += head_dim) {
    float* p = v + h;
    if (rounded) {
      const int64_t step = interleaved ? 2 : 1, other = interleaved ? 1 : half;
      for (int64_t j = 0; j < half; ++j) {
        const float cb = bf16_round(cos[j]), sb = bf16_round(sin[j]);
        const float x0 = p[j * step], x1 = p[j * step + other];
        p[j * step] = bf16_round(bf16_round(x0 * cb) + bf16_round(-x1 * sb));
        p[j * step + other] = bf16_round(bf16_round(x1 * cb) + bf16_round(x0 * sb));
      }
    } else if (interleaved) {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x0 = p[2 * j], x1 = p[2 * j + 1];
        p[2 * j] = x0 * cos[j] - x1 * sin[j];
        p[2 * j + 1] = x1 * cos[j] + x0 * sin[j];
      }
    } else {
      float* q = p + half;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x0 = p[j], x1 = q[j];
        p[j] = x0 * cos[j] - x1 * sin[j];
        q[j] = x1 * cos[j] + x0 * sin[j];
      }
    }
  }
}

APUS_CLONES void dyt_row(float* v, int64_t n, float alpha, const float* gamma, const float* beta, int64_t group,
                         bool round_bf16) {
  for (int64_t h = 0; h < n; h += group) {
    float* p = v + h;
    if (round_bf16) {
      for (int64_t i = 0; i < group; ++i)
        p[i] = bf16_round(bf16_round(bf16_round(tanh_poly(bf16_round(alpha * p[i]))) * gamma[i]) + beta[i]);
    } else {
      for (int64_t i = 0; i < group; ++i) p[i] = tanh_poly(alpha * p[i]) * gamma[i] + beta[i];
    }
  }
}

APUS_CLONES void sin_row(float* v, int64_t n) {
  int wide = 0;
#pragma omp simd reduction(| : wide)
  for (int64_t i = 0; i < n; ++i) wide |= !(std::fabs(v[i]) <= 8192.0f);
  if (wide) {
    // Far arguments (and NaN, Inf) the reduction below cannot carry: libm, which reduces exactly.
    for (int64_t i = 0; i < n; ++i) v[i] = std::sin(v[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    // x = k pi + r, |r| <= pi/2, with pi in three parts whose products with |k| < 2^12 are exact.
    const float k = std::nearbyint(x * 0.318309886183790671f);
    float r = std::fma(k, -3.140625f, x);
    r = std::fma(k, -9.67502593994140625e-4f, r);
    r = std::fma(k, -1.509957990978376432e-7f, r);
    const float r2 = r * r;
    // sin's Taylor series to r^15 (the next term is under 1e-11 at pi/2).
    float p = -1.0f / 1307674368000.0f;
    p = std::fma(p, r2, 1.0f / 6227020800.0f);
    p = std::fma(p, r2, -1.0f / 39916800.0f);
    p = std::fma(p, r2, 1.0f / 362880.0f);
    p = std::fma(p, r2, -1.0f / 5040.0f);
    p = std::fma(p, r2, 1.0f / 120.0f);
    p = std::fma(p, r2, -1.0f / 6.0f);
    const float s = std::fma(r * r2, p, r);
    v[i] = int32_t(k) & 1 ? -s : s;  // (-1)^k
  }
}

APUS_CLONES float sum_row(const float* v, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += v[i];
  return s;
}

APUS_CLONES float squared_deviation_row(const float* v, int64_t n, float mean) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += (v[i] - mean) * (v[i] - mean);
  return s;
}

namespace {

// exp(x) for a softmax's shifted scores, x <= 0 up to rounding (-inf for masked keys): exp_poly's
// value without its upper clamp, exactly 0 below -87 (where exp leaves float's normal range) as the
// reference's underflow gives, NaN handed on. One max, two compares and blends instead of
// exp_poly's two-sided clamp and the caller's test, which compiled to mask-register shuffles.
__attribute__((always_inline)) inline float exp_shifted(float x) {
  const float e = exp_in_range(x > -87.0f ? x : -87.0f);  // vmaxps: -inf and NaN become -87
  const float kept = x < -87.0f ? 0.0f : e;
  return x == x ? kept : x;
}

// Returns the normaliser; leaves exp(scale * (s - max)) in s.
__attribute__((always_inline)) inline float exp_and_sum(float* s, int64_t n, float scale) {
  // A vector max reduction: one running max is a chain of dependent vmaxss (2/3 of the whole
  // attention at 452 keys), and 16 lanes in an array compiled to scalar loads and compares.
  float mx = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    mx = s[i] > mx ? s[i] : mx;
    nan |= s[i] != s[i];
  }
  if (mx == -INFINITY && !nan) {  // no key seen (all padding): a zero row
    std::fill(s, s + n, 0.0f);
    return 0.0f;
  }
  if (nan || mx == INFINITY) {
    // As torch's softmax: a NaN score, or an infinite maximum (exp(inf - inf)), makes the row NaN
    // (the max above skips NaN, and the exp's clamps would turn it finite).
    std::fill(s, s + n, NAN);
    return NAN;
  }
  const float shift = mx * scale;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_shifted(std::fma(s[i], scale, -shift));
    sum += s[i];
  }
  return sum > 0.0f ? 1.0f / sum : 0.0f;
}

}  // namespace

APUS_CLONES void softmax_row_f32(float* s, int64_t n, float scale, float* out) {
  const float inv = exp_and_sum(s, n, scale);
  for (int64_t i = 0; i < n; ++i) out[i] = s[i] * inv;
}

APUS_CLONES void softmax_row_bf16(float* s, int64_t n, float scale, uint16_t* out) {
  const float inv = exp_and_sum(s, n, scale);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    const float v = s[i] * inv;
    std::memcpy(&u, &v, 4);
    out[i] = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // finite, or a NaN that stays quiet
  }
}

}  // namespace apus::cpu
