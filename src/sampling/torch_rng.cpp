#include "sampling/torch_rng.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/clones.h"
#include "core/dtype.h"
#include "core/parallel.h"

// Exactness notes (all verified against torch 2.9.1, see tests/test_torch_rng.cpp):
// * Every std::fma below stands where torch's GCC build (-mfma, -ffp-contract=fast) fused an
//   intrinsic multiply into the following add; each of those fusions changes results, so
//   they are spelled out instead of left to the compiler.
// * The remaining products either feed no add, are exact, or are followed by "+ 0" where
//   fusion cannot change the rounded value, so builds that allow contraction
//   (-march=native, aarch64) still produce the same bits.

namespace apus {
namespace {

constexpr double kPi = 3.14159265358979323846;

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// torch turns the 32-bit draw into a uniform on [0, 1) by keeping as many low bits as the
// target type has significand digits, so the value is exact in that type.
float uniform_f32(uint32_t r) { return float(r & 0xFFFFFFu) * (1.0f / 16777216.0f); }
float uniform_bf16(uint32_t r) { return float(r & 0xFFu) * (1.0f / 256.0f); }

// Natural log of the Cephes/avx_mathfun kernel torch uses on x86 for float32 randn.
// Only called with x in [2^-24, 1], so the denormal clamp and the NaN-for-x<=0 mask of the
// vector original can never trigger and are left out.
inline __attribute__((always_inline)) float cephes_logf(float x) {
  // Split x = m * 2^e with m in [0.5, 1).
  const uint32_t bits = float_bits(x);
  float e = float(int32_t(bits >> 23) - 0x7f) + 1.0f;
  x = bits_float((bits & ~0x7f800000u) | 0x3f000000u);
  // Recentre m around 1 so the polynomial sees |x| < 0.2929.
  const bool below = x < 0.707106781186547524f;
  const float addback = below ? x : 0.0f;
  x = x - 1.0f;
  e = e - (below ? 1.0f : 0.0f);
  x = x + addback;

  const float z = x * x;
  float y = 7.0376836292E-2f;
  y = std::fma(y, x, -1.1514610310E-1f);
  y = std::fma(y, x, 1.1676998740E-1f);
  y = std::fma(y, x, -1.2420140846E-1f);
  y = std::fma(y, x, 1.4249322787E-1f);
  y = std::fma(y, x, -1.6668057665E-1f);
  y = std::fma(y, x, 2.0000714765E-1f);
  y = std::fma(y, x, -2.4999993993E-1f);
  y = std::fma(y, x, 3.3333331174E-1f);
  y = y * x;
  // ln2 is split in two parts (q2 has few bits so e*q2 is exact); torch fused the
  // polynomial's y*z into the e*q1 correction, and the z/2 term into the result of that.
  const float e_q1 = e * -2.12194440e-4f;
  y = std::fma(y, z, e_q1);
  y = std::fma(-z, 0.5f, y);
  x = x + y;
  return std::fma(e, 0.693359375f, x);
}

// sin and cos together, as avx_mathfun's sincos256_ps, for theta in [0, 2*pi).
inline __attribute__((always_inline)) void cephes_sincosf(float xin, float* s_out, float* c_out) {
  uint32_t sign_sin = float_bits(xin) & 0x80000000u;
  float x = bits_float(float_bits(xin) & 0x7fffffffu);

  // Octant index j, rounded up to even (Cephes), taken from a truncating conversion.
  int32_t j = int32_t(x * 1.27323954473516f);
  j = (j + 1) & ~1;
  const float y = float(j);
  const uint32_t swap_sin = uint32_t(j & 4) << 29;
  const bool sin_uses_sin_poly = (j & 2) == 0;
  const uint32_t sign_cos = uint32_t(~(j - 2) & 4) << 29;
  sign_sin ^= swap_sin;

  // Extended-precision reduction x - j*pi/4 with pi/4 split in three parts.
  x = std::fma(y, -0.78515625f, x);
  x = std::fma(y, -2.4187564849853515625e-4f, x);
  x = std::fma(y, -3.77489497744594108e-8f, x);

  const float z = x * x;
  float yc = 2.443315711809948E-005f;
  yc = std::fma(yc, z, -1.388731625493765E-003f);
  yc = std::fma(yc, z, 4.166664568298827E-002f);
  yc = yc * z;
  yc = std::fma(yc, z, -(z * 0.5f));
  yc = yc + 1.0f;

  float ys = -1.9515295891E-4f;
  ys = std::fma(ys, z, 8.3321608736E-3f);
  ys = std::fma(ys, z, -1.6666654611E-1f);
  ys = ys * z;
  ys = std::fma(ys, x, x);

  // The original blends the two polynomials with masks and adds; adding the zeroed lane is
  // kept because it turns a -0 result into +0 exactly as the vector code does.
  const float sin_part = sin_uses_sin_poly ? ys : 0.0f;
  const float cos_part = sin_uses_sin_poly ? 0.0f : yc;
  const float ys_rest = ys - sin_part;
  const float yc_rest = yc - cos_part;
  const float s = cos_part + sin_part;
  const float c = yc_rest + ys_rest;
  *s_out = bits_float(float_bits(s) ^ sign_sin);
  *c_out = bits_float(float_bits(c) ^ sign_cos);
}

// One Box-Muller block of torch's x86 float32 kernel: lanes j and j+8 share (u1, u2).
// "+ 0.0f" mirrors the fmadd with mean 0 (it maps -0 to +0); the scale by std 1 is exact.
inline __attribute__((always_inline)) void box_muller16_avx2(float* d) {
  const float two_pi = float(2.0 * kPi);  // rounded to float before the multiply
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - d[j];  // (0, 1] for the log
    const float u2 = d[j + 8];
    const float radius = std::sqrt(-2.0f * cephes_logf(u1));
    float s, c;
    cephes_sincosf(two_pi * u2, &s, &c);
    d[j] = radius * c + 0.0f;
    d[j + 8] = radius * s + 0.0f;
  }
}

// `blocks` consecutive blocks of 16 through the x86 kernel, compiled per instruction set: its
// std::fma is one instruction where the CPU has FMA, and a libm call on baseline x86-64 (29 ns a
// value, which made SAME's decoder noise 1.7 s of a 2.5 s request on an H200 host).
APUS_CLONES void box_muller_blocks_avx2(float* d, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) box_muller16_avx2(d + 16 * b);
}

// torch's generic float32 kernel (no AVX2): libm functions, angle formed in double.
void box_muller16_scalar(float* d) {
  for (int j = 0; j < 8; ++j) {
    const float u1 = 1.0f - d[j];
    const float u2 = d[j + 8];
    const float radius = std::sqrt(-2.0f * std::log(u1));
    const float theta = float(2.0 * kPi * double(u2));
    d[j] = radius * std::cos(theta) + 0.0f;
    d[j + 8] = radius * std::sin(theta) + 0.0f;
  }
}

// torch's generic kernel instantiated for BFloat16: every named intermediate is a bf16
// variable and c10's bf16 overloads of log/sqrt/cos/sin and of bf16*bf16 compute in float
// and round back, so each step rounds to bf16.  Only the angle is formed in double (double
// times bf16 yields double) and then narrowed double -> float -> bf16.
void box_muller16_bf16(uint16_t* d) {
  for (int j = 0; j < 8; ++j) {
    const float u1 = round_bf16(1.0f - bf16_to_f32(d[j]));
    const float u2 = bf16_to_f32(d[j + 8]);
    const float log_u1 = round_bf16(std::log(u1));
    const float radius = round_bf16(std::sqrt(round_bf16(-2.0f * log_u1)));
    const float theta = round_bf16(float(2.0 * kPi * double(u2)));
    const float c = round_bf16(std::cos(theta));
    const float s = round_bf16(std::sin(theta));
    // (radius * cos) * std + mean, each product/sum rounded; std = 1 is exact, mean = 0
    // still maps -0 (radius is -0 when u1 == 1) to +0.
    d[j] = f32_to_bf16(round_bf16(radius * c) + 0.0f);
    d[j + 8] = f32_to_bf16(round_bf16(radius * s) + 0.0f);
  }
}

constexpr int kShift = 397;  // MT19937's middle word
constexpr uint32_t kUpper = 0x80000000u, kLower = 0x7fffffffu, kMatrix = 0x9908b0dfu;

inline uint32_t twisted(uint32_t word, uint32_t next, uint32_t far) {
  const uint32_t y = (word & kUpper) | (next & kLower);
  return far ^ (y >> 1) ^ ((0u - (y & 1u)) & kMatrix);
}

// The twist in three runs so that each reads what it needs without a loop-carried dependence the
// vectoriser cannot see through: words 0..226 read the old words 397 on, 227..622 the new words
// 227 back, and the last one wraps to the new word 0.
APUS_CLONES void twist_words(uint32_t* mt) {
  constexpr int n = 624, first = n - kShift;
  for (int i = 0; i < first; ++i) mt[i] = twisted(mt[i], mt[i + 1], mt[i + kShift]);
  for (int i = first; i < n - 1; ++i) mt[i] = twisted(mt[i], mt[i + 1], mt[i - first]);
  mt[n - 1] = twisted(mt[n - 1], mt[0], mt[kShift - 1]);
}

APUS_CLONES void temper_words(const uint32_t* mt, uint32_t* out, int count) {
  for (int i = 0; i < count; ++i) out[i] = Mt19937::temper(mt[i]);
}

APUS_CLONES void uniforms_f32(const uint32_t* r, float* out, int count) {
  for (int i = 0; i < count; ++i) out[i] = uniform_f32(r[i]);
}

}  // namespace

Mt19937::Mt19937(uint32_t seed) {
  state_[0] = seed;
  for (int i = 1; i < kWords; ++i) state_[i] = 1812433253u * (state_[i - 1] ^ (state_[i - 1] >> 30)) + uint32_t(i);
}

void Mt19937::twist() {
  twist_words(state_);
  next_ = 0;
}

void Mt19937::fill(uint32_t* out, int64_t n) {
  while (n > 0) {
    if (next_ == kWords) twist();
    const int count = int(std::min<int64_t>(n, kWords - next_));
    temper_words(state_ + next_, out, count);
    next_ += count;
    out += count;
    n -= count;
  }
}

TorchGenerator::TorchGenerator(uint64_t seed, TorchFloatKernel kernel)
    : seed_(seed), kernel_(kernel), engine_(uint32_t(seed & 0xFFFFFFFFu)) {}

uint32_t TorchGenerator::random32() { return uint32_t(engine_()); }

uint64_t TorchGenerator::random64() {
  // The first 32-bit draw becomes the high half.
  const uint64_t hi = random32();
  const uint64_t lo = random32();
  return (hi << 32) | lo;
}

double TorchGenerator::normal_double() {
  if (has_cached_normal_) {
    has_cached_normal_ = false;
    return cached_normal_;
  }
  constexpr uint64_t kMask53 = (uint64_t(1) << 53) - 1;
  constexpr double kInv53 = 1.0 / double(uint64_t(1) << 53);
  const double u1 = double(random64() & kMask53) * kInv53;
  const double u2 = double(random64() & kMask53) * kInv53;
  // log1p(-u2), not log(1 - u2): the two disagree in about 3% of samples.
  const double r = std::sqrt(-2.0 * std::log1p(-u2));
  const double theta = 2.0 * kPi * u1;
  // "+ 0.0" is torch's mean shift (x * std + mean with std 1, mean 0).
  cached_normal_ = r * std::sin(theta) + 0.0;
  has_cached_normal_ = true;
  return r * std::cos(theta) + 0.0;
}

// torch (normal_kernel): tensors under 16 elements draw one double normal per element and
// narrow it; larger contiguous ones fill all uniforms first, transform them in blocks of 16,
// and for a ragged end draw 16 fresh uniforms over the last 16 slots and transform those
// again (so the state advances by n + 16 draws, and the earlier values there are lost).
void TorchGenerator::randn(float* out, int64_t n) {
  if (n <= 0) return;
  if (n < 16) {
    for (int64_t i = 0; i < n; ++i) out[i] = float(normal_double());
    return;
  }
  auto blocks = [this](float* d, int64_t count) {
    if (kernel_ == TorchFloatKernel::avx2) return box_muller_blocks_avx2(d, count);
    for (int64_t b = 0; b < count; ++b) box_muller16_scalar(d + 16 * b);
  };
  uniforms(out, n);
  // The uniforms come from one sequential stream; their transform is block by block, so large
  // draws (SAME's decoder noise: millions a chunk) spread it over the threads.
  const int64_t count = n / 16, per_task = 4096;
  if (count <= per_task) {
    blocks(out, count);
  } else {
    parallel_for((count + per_task - 1) / per_task, [&](int64_t task) {
      const int64_t first = task * per_task;
      blocks(out + 16 * first, std::min(per_task, count - first));
    });
  }
  if (n % 16 != 0) {
    float* tail = out + n - 16;
    for (int i = 0; i < 16; ++i) tail[i] = uniform_f32(random32());
    blocks(tail, 1);
  }
}

void TorchGenerator::rand(float* out, int64_t n) { uniforms(out, n); }

void TorchGenerator::uniforms(float* out, int64_t n) {
  uint32_t draws[1024];
  for (int64_t i = 0; i < n; i += 1024) {
    const int count = int(std::min<int64_t>(1024, n - i));
    engine_.fill(draws, count);
    uniforms_f32(draws, out + i, count);
  }
}

void TorchGenerator::randn_bf16(uint16_t* out, int64_t n) {
  if (n <= 0) return;
  if (n < 16) {
    // c10::BFloat16 is constructed from float, so the double is narrowed twice.
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(float(normal_double()));
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(uniform_bf16(random32()));
  for (int64_t i = 0; i + 16 <= n; i += 16) box_muller16_bf16(out + i);
  if (n % 16 != 0) {
    uint16_t* tail = out + n - 16;
    for (int i = 0; i < 16; ++i) tail[i] = f32_to_bf16(uniform_bf16(random32()));
    box_muller16_bf16(tail);
  }
}

}  // namespace apus
