// Attention as the reference's CPU kernels compute it: Q·K^T and P·V through the GEMM library
// with fp32 accumulation, softmax in fp32, P rounded to the activation dtype before P·V.
// Heads and query blocks are spread over threads; each thread runs its GEMMs single-threaded.
// On AVX512-BF16 CPUs two direct kernels replace the GEMM tiles, with the same roundings: a band
// (SAME's |i - j| <= 17) forms each row's scores over its own keys only; full attention reads every
// head's keys and values re-laid once per call for vdpbf16ps, without head copies or GEMM calls.
// Where bf16 is widened to f32 (AVX2-only CPUs), attention without a band runs the widened GEMM's
// kernel over keys and values widened once per call.
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/dnnl_util.h"
#include "ops/cpu/rows.h"
#include "ops/cpu/vec.h"

namespace apus::cpu {

Knob attention_block_knob("cpu.attention_block",
                          "query rows per attention task; auto: 512 where the GEMM tiles take an attention without "
                          "a mask, band or causality, 128 elsewhere",
                          {"auto", "128", "32", "64", "256", "512"});
Knob band_attention_knob("cpu.band_attention",
                         "a band's attention (SAME's |i - j| <= w) by a direct AVX512-BF16 kernel over each row's own "
                         "keys, or by GEMM tiles over its query block's keys; auto: direct unless the CPU has AMX",
                         {"auto", "direct", "tiles"});
Knob attention_kernel_knob("cpu.attention",
                           "attention without a band by a direct AVX512-BF16 kernel (keys and values re-laid once per "
                           "call, scores and P.V by vdpbf16ps; where bf16 is widened, the widened GEMM's kernel over "
                           "keys and values widened once per call), or by GEMM tiles over head copies; auto: direct "
                           "unless the CPU has AMX",
                           {"auto", "direct", "tiles"});

namespace {

// AVX512-BF16 (CPUID leaf 7, subleaf 1, EAX bit 5) with the AVX-512 parts the band kernel uses.
bool avx512_bf16() {
  static const bool supported = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
  }();
  return supported;
}

// AMX-BF16 (CPUID leaf 7, EDX bit 22): oneDNN's GEMM tiles run on AMX there, and session 6
// measured them twice as fast as a direct band kernel (docs/SPEED.md).
bool amx_bf16() {
  static const bool present = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22));
  }();
  return present;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Copies every head of a [S, H*D] view into head-major [H, S, D].
void split_heads(const Tensor& x, int64_t d, Tensor& out) {
  const int64_t s = x.shape[0], h = x.shape[1] / d;
  const size_t es = dtype_size(x.dtype), row = size_t(d) * es;
  parallel_for(s, [&](int64_t r) {
    for (int64_t i = 0; i < h; ++i)
      std::memcpy(static_cast<char*>(out.data) + size_t(i * s + r) * row,
                  static_cast<const char*>(x.row(r)) + size_t(i) * row, row);
  });
}

// Sets the scores of padding keys (key_valid entry 0) to -inf; s and key_valid cover n keys.
void mask_padding(float* s, int64_t n, const int64_t* key_valid) {
  if (key_valid)
    for (int64_t j = 0; j < n; ++j)
      if (!key_valid[j]) s[j] = kNegInf;
}

void round_row_bf16(float* s, int64_t n) {
  for (int64_t j = 0; j < n; ++j) s[j] = round_bf16(s[j]);
}

// s <- softcap * tanh(scale * s / softcap) (or scale * s without a cap), rounded to bf16 after
// each step when round_steps: eager PyTorch's Q·K^T, * scale, / softcap, tanh, * softcap.
void shape_scores(float* s, int64_t n, float scale, float softcap, bool round_steps) {
  if (round_steps) round_row_bf16(s, n);
  for (int64_t j = 0; j < n; ++j) s[j] *= scale;
  if (round_steps) round_row_bf16(s, n);
  if (softcap <= 0) return;
  for (int64_t j = 0; j < n; ++j) s[j] /= softcap;
  if (round_steps) round_row_bf16(s, n);
  tanh_row(s, n);
  if (round_steps) round_row_bf16(s, n);
  for (int64_t j = 0; j < n; ++j) s[j] *= softcap;
  if (round_steps) round_row_bf16(s, n);
}

// What each attention row does with its scores s over the n keys it may see: shaped (capped,
// rounded step by step) when asked, padding keys masked, softmax into p (the activation dtype).
struct RowSoftmax {
  float scale, softcap;
  bool round_steps;
  DType dt;

  void operator()(float* s, int64_t n, const int64_t* key_valid, char* p) const {
    if (dt == DType::bf16) softmax_row_bf16(s, n, prepared(s, n, key_valid), reinterpret_cast<uint16_t*>(p));
    else softmax_row_f32(s, n, prepared(s, n, key_valid), reinterpret_cast<float*>(p));
  }
  // The same for bf16 rows of at most 48 keys (the direct band kernel's window), in registers.
  void short_row(float* s, int64_t n, const int64_t* key_valid, uint16_t* p) const;

 private:
  // Shapes and masks s; returns the scale the softmax's exp still applies (the plain case leaves
  // it to the softmax's fused exp).
  float prepared(float* s, int64_t n, const int64_t* key_valid) const {
    const bool transformed = softcap > 0 || round_steps;
    if (transformed) shape_scores(s, n, scale, softcap, round_steps);
    mask_padding(s, n, key_valid);
    return transformed ? 1.0f : scale;
  }
};

// GCC 12's AVX-512 headers start vectors from _mm512_undefined_*, which -Wmaybe-uninitialized
// reports at every inlined call.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define APUS_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Columns of a value panel (key_pair_major's layout, pair_weighted_sum's width).
constexpr int64_t kValuePanel = 32;

// Lanes [0, n) of a vector of `width` (n may be 0 or past the width).
inline uint32_t lanes(int64_t n, int64_t width) {
  return n >= width ? uint32_t(~0u >> (32 - width)) : n <= 0 ? 0u : (1u << n) - 1u;
}

// Keys [0, n) of d bf16 elements (key j at k + j * k_stride) re-laid pair-major in panels of `panel`
// keys: key j's elements 2p and 2p + 1 at kt[(j / panel) * (d / 2) * panel + p * panel + j % panel],
// so one vdpbf16ps forms a pair's products for 16 keys and a panel's keys lie together. `cols`
// columns in all (a multiple of the panel, which is one of 16), those past n zeros. 16 keys x 16
// pairs at a time through a register transpose.
APUS_AVX512_BF16 void pair_major(const uint16_t* k, int64_t k_stride, int64_t n, int64_t d, uint32_t* kt, int64_t cols,
                                 int64_t panel) {
  const int64_t pairs = d / 2;
  for (int64_t j0 = 0; j0 < cols; j0 += 16)
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const __mmask16 m = lanes(pairs - p0, 16);
      __m512i r[16], t[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j0 + j < n ? _mm512_maskz_loadu_epi32(m, k + (j0 + j) * k_stride + 2 * p0) : _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      // r[4i + c] <- within each 128-bit lane L: column 4L + c of keys 4i .. 4i + 3.
      for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      for (int c = 0; c < 4; ++c) {
        const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44),
                      y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        const __m512i out[4] = {_mm512_shuffle_i32x4(x0, y0, 0x88), _mm512_shuffle_i32x4(x0, y0, 0xDD),
                                _mm512_shuffle_i32x4(x1, y1, 0x88), _mm512_shuffle_i32x4(x1, y1, 0xDD)};
        for (int l = 0; l < 4; ++l)
          if (p0 + 4 * l + c < pairs)
            _mm512_storeu_si512(kt + j0 / panel * pairs * panel + (p0 + 4 * l + c) * panel + j0 % panel, out[l]);
      }
    }
}

// The kernel under the scores and P·V: for R rows a_r of bf16 pairs (a_r at a + r * a_stride) and a
// panel of uint32 pair rows (row p at panel + p * ld), out_r[0 .. 16V) (+)= sum over p < pairs of
// a_r's pair p times panel row p's 16V columns, each vdpbf16ps adding both products of a pair to one
// fp32 lane as the GEMM library's bf16 kernels do. Each panel load serves R rows and no horizontal
// sums are needed. Scores: a = query rows over pair-major keys (V = 3: 48 keys; up to 13 band rows
// of 35 keys share one 48-key window); P·V: a = probability rows over key-pair-major values (V = 2).
template <int R, int V> APUS_AVX512_BF16 void pair_products(const uint16_t* a, int64_t a_stride, const uint32_t* panel,
                                                            int64_t ld, int64_t pairs, bool accumulate, float* out,
                                                            int64_t out_stride) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c)
      acc[r][c] = accumulate ? _mm512_loadu_ps(out + r * out_stride + 16 * c) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh cols[V];
    for (int c = 0; c < V; ++c) cols[c] = (__m512bh)_mm512_loadu_si512(panel + p * ld + 16 * c);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, a + r * a_stride + 2 * p, 4);
      const __m512bh ap = (__m512bh)_mm512_set1_epi32(int32_t(pair));
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], ap, cols[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(out + r * out_stride + 16 * c, acc[r][c]);
}

// Scores of R consecutive query rows (q_r at q + r * q_stride) over 48 keys of a pair-major kt
// from column j0: s[r * s_stride + j] = q_r · k_(j0 + j).
template <int R> APUS_AVX512_BF16 void key_scores(const uint16_t* q, int64_t q_stride, const uint32_t* kt, int64_t ld,
                                                  int64_t j0, int64_t d, float* s, int64_t s_stride) {
  pair_products<R, 3>(q, q_stride, kt + j0, ld, d / 2, false, s, s_stride);
}

// Values [0, n) of d bf16 elements (value j at v + j * v_stride) re-laid key-pair-major in panels
// of P = kValuePanel columns: column c of values 2m and 2m + 1 at vt[(c / P) * pairs * P + m * P + c % P]
// (pairs = (n + 1) / 2), so one vdpbf16ps adds a pair of keys' weighted values to 16 columns and a
// panel's values lie together. A missing last odd value and the columns past d are zeros.
APUS_AVX512_BF16 void key_pair_major(const uint16_t* v, int64_t v_stride, int64_t n, int64_t d, uint32_t* vt) {
  // Lanes 2i and 2i + 1 of the first half take element i of each row, the second half's element 16 + i.
  alignas(64) static const uint16_t first[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(first), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t pairs = (n + 1) / 2;
  for (int64_t m = 0; m < pairs; ++m) {
    const uint16_t* a = v + 2 * m * v_stride;
    for (int64_t c = 0; c < d; c += kValuePanel) {
      const __mmask32 cols = lanes(d - c, 32);
      const __m512i x = _mm512_maskz_loadu_epi16(cols, a + c);
      const __m512i y = 2 * m + 1 < n ? _mm512_maskz_loadu_epi16(cols, a + v_stride + c) : _mm512_setzero_si512();
      uint32_t* out = vt + c / kValuePanel * pairs * kValuePanel + m * kValuePanel;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// out_r[0 .. 32) (+)= sum over key pairs m < pairs of (p_r[2m] v_2m + p_r[2m + 1] v_(2m + 1)) in
// fp32, over one 32-column panel of a key-pair-major vt, for R probability rows p_r (bf16 at
// p + r * p_stride, zeros past each row's keys); added to what out holds when `accumulate`.
template <int R> APUS_AVX512_BF16 void pair_weighted_sum(const uint16_t* p, int64_t p_stride, const uint32_t* panel,
                                                         int64_t pairs, bool accumulate, float* out,
                                                         int64_t out_stride) {
  pair_products<R, kValuePanel / 16>(p, p_stride, panel, kValuePanel, pairs, accumulate, out, out_stride);
}

// 16 bf16 values widened to fp32 (their bits shifted into the high half).
APUS_AVX512_BF16 inline __attribute__((always_inline)) __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// out = sum_j p_j v_j over n keys (v_j at v + j * v_stride, d wide), in fp32, 64 columns at a time.
APUS_AVX512_BF16 void band_weighted_sum(const uint16_t* p, const uint16_t* v, int64_t v_stride, int64_t n, int64_t d,
                                        float* out) {
  for (int64_t c = 0; c < d; c += 64) {
    const __mmask16 m0 = lanes(d - c, 16), m1 = lanes(d - c - 16, 16), m2 = lanes(d - c - 32, 16),
                    m3 = lanes(d - c - 48, 16);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vj = v + j * v_stride + c;
      const __m512 pj = _mm512_castsi512_ps(_mm512_set1_epi32(int32_t(uint32_t(p[j]) << 16)));
      a0 = _mm512_fmadd_ps(pj, widen_bf16(_mm256_maskz_loadu_epi16(m0, vj)), a0);
      a1 = _mm512_fmadd_ps(pj, widen_bf16(_mm256_maskz_loadu_epi16(m1, vj + 16)), a1);
      a2 = _mm512_fmadd_ps(pj, widen_bf16(_mm256_maskz_loadu_epi16(m2, vj + 32)), a2);
      a3 = _mm512_fmadd_ps(pj, widen_bf16(_mm256_maskz_loadu_epi16(m3, vj + 48)), a3);
    }
    _mm512_mask_storeu_ps(out + c, m0, a0);
    _mm512_mask_storeu_ps(out + c + 16, m1, a1);
    _mm512_mask_storeu_ps(out + c + 32, m2, a2);
    _mm512_mask_storeu_ps(out + c + 48, m3, a3);
  }
}

#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// exp_in_range (ops/cpu/vec.cpp) over 16 lanes, the same operations lane by lane: the same values.
APUS_AVX512_BF16 inline __attribute__((always_inline)) __m512 exp_in_range16(__m512 x) {
  using E = ExpConstants;
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(E::log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(E::ln2_low), _mm512_fmadd_ps(n, _mm512_set1_ps(E::ln2_high), x));
  __m512 p = _mm512_set1_ps(E::poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(E::poly[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// softmax_row_bf16 (ops/cpu/vec.cpp) of at most 48 scores held in three registers: the same max,
// exponentials and roundings (NaN rows, infinite maxima and rows without keys as it treats them),
// the sum in another order. One call a row and term in the band kernel, where the general row's
// three passes through memory were 40 % of the kernel.
APUS_AVX512_BF16 void softmax_short_bf16(const float* s, int64_t n, float scale, uint16_t* out) {
  const __mmask16 m[3] = {__mmask16(lanes(n, 16)), __mmask16(lanes(n - 16, 16)), __mmask16(lanes(n - 32, 16))};
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 v[3], mx = neg_inf;
  bool nan = false;
  for (int i = 0; i < 3; ++i) {
    v[i] = _mm512_mask_loadu_ps(neg_inf, m[i], s + 16 * i);
    nan = nan || _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q) != 0;
    mx = _mm512_max_ps(mx, v[i]);
  }
  const float top = _mm512_reduce_max_ps(mx);
  if (nan || top == INFINITY || top == -INFINITY) {
    // As torch's softmax: NaN, or an infinite maximum, makes the row NaN; no key seen, zeros.
    const uint16_t fill = top == -INFINITY && !nan ? 0 : 0x7fc0;
    std::fill(out, out + n, fill);
    return;
  }
  const __m512 shift = _mm512_set1_ps(top * scale), floor = _mm512_set1_ps(-87.0f);
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < 3; ++i) {
    const __m512 x = _mm512_fmsub_ps(v[i], _mm512_set1_ps(scale), shift);
    const __m512 e = exp_in_range16(_mm512_max_ps(x, floor));
    v[i] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ), e);  // exactly 0 below -87
    sum = _mm512_add_ps(sum, v[i]);
  }
  const float total = _mm512_reduce_add_ps(sum), inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int i = 0; i < 3; ++i)
    _mm256_mask_storeu_epi16(out + 16 * i, m[i], (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v[i], _mm512_set1_ps(inv))));
}

void RowSoftmax::short_row(float* s, int64_t n, const int64_t* key_valid, uint16_t* p) const {
  softmax_short_bf16(s, n, prepared(s, n, key_valid), p);
}

// A band's attention row by row: each query row's scores over its own 2w + 1 keys only, heads read
// in place from the projections (no head-major copies), no GEMM calls. The same roundings as the
// tiles: P in bf16 before P·V, each term's output rounded before the difference.
void attend_band_direct(const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks, const Tensor& v,
                        Tensor& o, int64_t d, const ops::AttentionOptions& mask, const RowSoftmax& softmax,
                        const int64_t* key_valid, int64_t block) {
  const int64_t terms = int64_t(qs.size()), batch = mask.batch, w = mask.window;
  const int64_t sq = qs[0]->shape[0] / batch, hq = qs[0]->shape[1] / d, hk = ks[0]->shape[1] / d;
  const int64_t blocks = (sq + block - 1) / block;
  // Query rows whose scores are formed together: their windows (2w + 1 keys, starting one key
  // apart) fit one 48-key window.
  constexpr int64_t kGroup = 8;
  APUS_CHECK(2 * w + kGroup <= 48, "attention: the direct band kernel takes windows up to ", (48 - kGroup) / 2,
             ", got ", w);
  parallel_for(
      batch * hq * blocks,
      [&](int64_t task) {
        const int64_t b = task / (hq * blocks), h = (task / blocks) % hq;
        const int64_t r0 = (task % blocks) * block, r1 = std::min(sq, r0 + block);
        const int64_t g = h / (hq / hk);
        // The keys any row of the block sees, pair-major per term; 48 columns of slack past the
        // last so every row group's 48-key window stays inside.
        const int64_t key_lo = std::max<int64_t>(0, r0 - w), key_hi = std::min(sq, r1 + w);
        const int64_t ld = (key_hi - key_lo + 15) / 16 * 16 + 48, term_kt = d / 2 * ld;
        uint32_t* kt = reinterpret_cast<uint32_t*>(thread_scratch(0, terms * term_kt));
        for (int64_t term = 0; term < terms; ++term)
          pair_major(static_cast<const uint16_t*>(ks[size_t(term)]->row(b * sq + key_lo)) + g * d,
                     ks[size_t(term)]->row_stride(), key_hi - key_lo, d, kt + term * term_kt, ld, ld);
        float* scores = thread_scratch(1, terms * kGroup * 48);
        char* probs = reinterpret_cast<char*>(thread_scratch(2, w + 1));  // 2w + 1 bf16
        float* outs[2] = {thread_scratch(3, 2 * d), nullptr};
        outs[1] = outs[0] + d;
        Tensor ob = o.rows(b * sq + r0, b * sq + r1).cols(h * d, (h + 1) * d);
        for (int64_t i0 = r0; i0 < r1; i0 += kGroup) {
          const int64_t rows = std::min(kGroup, r1 - i0), base = std::max<int64_t>(0, i0 - w);
          for (int64_t term = 0; term < terms; ++term) {
            const Tensor& q = *qs[size_t(term)];
            const uint16_t* q0 = static_cast<const uint16_t*>(q.row(b * sq + i0)) + h * d;
            const uint32_t* kterm = kt + term * term_kt;
            float* st = scores + term * kGroup * 48;
            if (rows == kGroup) key_scores<kGroup>(q0, q.row_stride(), kterm, ld, base - key_lo, d, st, 48);
            else
              for (int64_t r = 0; r < rows; ++r)
                key_scores<1>(q0 + r * q.row_stride(), 0, kterm, ld, base - key_lo, d, st + r * 48, 48);
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r;
            int64_t lo = std::max<int64_t>(0, i - w), hi = std::min(sq, i + w + 1);
            if (mask.causal) hi = std::min(hi, i + 1);
            const int64_t n = hi - lo;
            for (int64_t term = 0; term < terms; ++term) {
              float* srow = scores + term * kGroup * 48 + r * 48 + (lo - base);
              softmax.short_row(srow, n, key_valid ? key_valid + b * sq + lo : nullptr,
                                reinterpret_cast<uint16_t*>(probs));
              band_weighted_sum(reinterpret_cast<const uint16_t*>(probs),
                                static_cast<const uint16_t*>(v.row(b * sq + lo)) + g * d, v.row_stride(), n, d,
                                outs[term]);
            }
            if (terms > 1) {
              round_to(DType::bf16, outs[0], d);
              round_to(DType::bf16, outs[1], d);
              for (int64_t j = 0; j < d; ++j) outs[0][j] -= outs[1][j];
            }
            store_row(ob, i - r0, outs[0], d);
          }
        }
      },
      Schedule::dynamic);
}

// Attention without a band, directly: every key head's keys re-laid pair-major and its values
// key-pair-major once per call (in the arena, in panels that lie together), then per query block:
// the scores of all its rows a 48-key panel at a time (each panel loaded once for the block, each
// load serving eight rows), the row softmax into bf16 probabilities, and P·V a 32-column panel and
// a run of key pairs at a time (each run loaded once for the block), a pair of keys per vdpbf16ps.
// The tiles' roundings: P in bf16 before P·V, each term's output rounded before the difference.
void attend_direct(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks,
                   const Tensor& v, Tensor& o, int64_t d, const ops::AttentionOptions& mask, const RowSoftmax& softmax,
                   const int64_t* key_valid, int64_t block) {
  constexpr int64_t kGroup = 8, kKeyPanel = 48, kPairRun = 256;
  const int64_t terms = int64_t(qs.size()), batch = mask.batch;
  const int64_t sq = qs[0]->shape[0] / batch, sk = ks[0]->shape[0] / batch;
  const int64_t hq = qs[0]->shape[1] / d, hk = ks[0]->shape[1] / d, blocks = (sq + block - 1) / block;
  const int64_t ldk = (sk + kKeyPanel - 1) / kKeyPanel * kKeyPanel, col_panels = (d + kValuePanel - 1) / kValuePanel;
  const int64_t pairs_all = (sk + 1) / 2, ldv = col_panels * kValuePanel;
  const int64_t k_heads = batch * hk, k_size = d / 2 * ldk, v_size = pairs_all * ldv;
  uint32_t* kp = static_cast<uint32_t*>(Tensor::in(*c.arena, {terms * k_heads, k_size}, DType::f32).data);
  uint32_t* vp = static_cast<uint32_t*>(Tensor::in(*c.arena, {k_heads, v_size}, DType::f32).data);
  parallel_for(terms * k_heads, [&](int64_t t) {
    const Tensor& k = *ks[size_t(t / k_heads)];
    const int64_t b = t % k_heads / hk, g = t % hk;
    pair_major(static_cast<const uint16_t*>(k.row(b * sk)) + g * d, k.row_stride(), sk, d, kp + t * k_size, ldk,
               kKeyPanel);
  });
  parallel_for(k_heads, [&](int64_t t) {
    key_pair_major(static_cast<const uint16_t*>(v.row(t / hk * sk)) + t % hk * d, v.row_stride(), sk, d,
                   vp + t * v_size);
  });
  parallel_for(
      batch * hq * blocks,
      [&](int64_t task) {
        const int64_t b = task / (hq * blocks), h = (task / blocks) % hq;
        const int64_t r0 = (task % blocks) * block, rows = std::min(sq, r0 + block) - r0;
        const int64_t kv_head = b * hk + h / (hq / hk);
        const int64_t* valid = key_valid ? key_valid + b * sk : nullptr;
        // The keys a row sees, and those of a group of rows starting at row i.
        auto keys_of = [&](int64_t i) { return mask.causal ? std::min(sk, i + 1) : sk; };
        auto group_keys = [&](int64_t i) { return keys_of(i + std::min(kGroup, r0 + rows - i) - 1); };
        const int64_t pairs = (group_keys(r0 + rows - 1) + 1) / 2;  // the block's, for its probability rows
        float* scores = thread_scratch(0, terms * block * ldk);
        uint16_t* probs = reinterpret_cast<uint16_t*>(thread_scratch(1, terms * block * pairs));
        float* outs = thread_scratch(2, terms * block * ldv);
        for (int64_t term = 0; term < terms; ++term) {
          const Tensor& q = *qs[size_t(term)];
          const uint32_t* kt = kp + (term * k_heads + kv_head) * k_size;
          float* st = scores + term * block * ldk;
          for (int64_t j0 = 0; j0 < ldk; j0 += kKeyPanel) {
            const uint32_t* panel = kt + j0 * (d / 2);
            for (int64_t g0 = 0; g0 < rows; g0 += kGroup) {
              if (j0 >= group_keys(r0 + g0)) continue;
              const uint16_t* q0 = static_cast<const uint16_t*>(q.row(b * sq + r0 + g0)) + h * d;
              if (rows - g0 >= kGroup)
                key_scores<kGroup>(q0, q.row_stride(), panel, kKeyPanel, 0, d, st + g0 * ldk + j0, ldk);
              else
                for (int64_t r = g0; r < rows; ++r)
                  key_scores<1>(q0 + (r - g0) * q.row_stride(), 0, panel, kKeyPanel, 0, d, st + r * ldk + j0, ldk);
            }
          }
          uint16_t* pt = probs + term * block * 2 * pairs;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = keys_of(r0 + r);
            uint16_t* prow = pt + r * 2 * pairs;
            softmax(st + r * ldk, n, valid, reinterpret_cast<char*>(prow));
            std::fill(prow + n, prow + 2 * pairs, uint16_t(0));
          }
          const uint32_t* vt = vp + kv_head * v_size;
          float* ot = outs + term * block * ldv;
          for (int64_t cp = 0; cp < col_panels; ++cp)
            for (int64_t m0 = 0; m0 < pairs; m0 += kPairRun) {
              const uint32_t* run = vt + cp * pairs_all * kValuePanel + m0 * kValuePanel;
              for (int64_t g0 = 0; g0 < rows; g0 += kGroup) {
                const int64_t n = std::min((group_keys(r0 + g0) + 1) / 2, m0 + kPairRun) - m0;
                if (n <= 0) continue;
                const uint16_t* p0 = pt + g0 * 2 * pairs + 2 * m0;
                float* out = ot + g0 * ldv + cp * kValuePanel;
                if (rows - g0 >= kGroup) pair_weighted_sum<kGroup>(p0, 2 * pairs, run, n, m0 > 0, out, ldv);
                else
                  for (int64_t r = 0; r < rows - g0; ++r)
                    pair_weighted_sum<1>(p0 + r * 2 * pairs, 0, run, n, m0 > 0, out + r * ldv, 0);
              }
            }
        }
        Tensor ob = o.rows(b * sq + r0, b * sq + r0 + rows).cols(h * d, (h + 1) * d);
        for (int64_t r = 0; r < rows; ++r) {
          float* out = outs + r * ldv;
          if (terms > 1) {
            float* second = outs + (block + r) * ldv;
            round_to(DType::bf16, out, d);
            round_to(DType::bf16, second, d);
            for (int64_t j = 0; j < d; ++j) out[j] -= second[j];
          }
          store_row(ob, r, out, d);
        }
      },
      Schedule::dynamic);
}

// Attention without a band where bf16 is widened (CPUs without bf16 dot products): the widened
// GEMM's kernel (sgemm.cpp) over every key head's keys and values widened to f32 panels once per
// call (the tiles widened them again for each query block), then per query block the scores of
// all its rows, the row softmax into the activation dtype, and P·V over the block's keys. The
// tiles' roundings: P in the activation dtype before P·V, each term's output rounded before the
// difference; each score and output one FMA chain in order, whatever the block.
void attend_widened(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks,
                    const Tensor& v, Tensor& o, int64_t d, const ops::AttentionOptions& mask, const RowSoftmax& softmax,
                    const int64_t* key_valid, int64_t block) {
  constexpr int64_t kPanel = kWidenedPanel, kRowsPadding = 6;  // the kernel's columns and rows
  const int64_t terms = int64_t(qs.size()), batch = mask.batch;
  const int64_t sq = qs[0]->shape[0] / batch, sk = ks[0]->shape[0] / batch;
  const int64_t hq = qs[0]->shape[1] / d, hk = ks[0]->shape[1] / d, blocks = (sq + block - 1) / block;
  const int64_t key_panels = (sk + kPanel - 1) / kPanel, ldk = key_panels * kPanel;
  const int64_t value_panels = (d + kPanel - 1) / kPanel, ldv = value_panels * kPanel;
  const int64_t k_heads = batch * hk, k_size = key_panels * d * kPanel, v_size = value_panels * sk * kPanel;
  const DType dt = v.dtype;
  const size_t es = dtype_size(dt);
  float* kp = static_cast<float*>(Tensor::in(*c.arena, {terms * k_heads, k_size}, DType::f32).data);
  float* vp = static_cast<float*>(Tensor::in(*c.arena, {k_heads, v_size}, DType::f32).data);
  // Head g of sample b in a [rows, H*D] tensor, from its first row.
  auto head = [&](const Tensor& x, int64_t b, int64_t g) {
    return static_cast<const char*>(x.row(b * sk)) + size_t(g * d) * es;
  };
  parallel_for(terms * k_heads * key_panels, [&](int64_t t) {  // K^T: [d, keys]
    const int64_t kh = t / key_panels, p = t % key_panels;
    const Tensor& k = *ks[size_t(kh / k_heads)];
    pack_widened_panel(head(k, kh % k_heads / hk, kh % hk), dt, 1, k.row_stride(), d, sk, p,
                       kp + kh * k_size + p * d * kPanel);
  });
  parallel_for(k_heads * value_panels, [&](int64_t t) {  // V: [keys, d]
    const int64_t kh = t / value_panels, p = t % value_panels;
    pack_widened_panel(head(v, kh / hk, kh % hk), dt, v.row_stride(), 1, sk, d, p, vp + kh * v_size + p * sk * kPanel);
  });
  parallel_for(
      batch * hq * blocks,
      [&](int64_t task) {
        const int64_t b = task / (hq * blocks), h = (task / blocks) % hq;
        const int64_t r0 = (task % blocks) * block, rows = std::min(sq, r0 + block) - r0;
        const int64_t padded = (rows + kRowsPadding - 1) / kRowsPadding * kRowsPadding;
        const int64_t kv_head = b * hk + h / (hq / hk);
        const int64_t keys = mask.causal ? std::min(sk, r0 + rows) : sk;  // the block's
        const int64_t* valid = key_valid ? key_valid + b * sk : nullptr;
        float* scores = thread_scratch(0, padded * ldk);
        Tensor probs;  // each term's probability rows over the block's keys
        probs.dtype = dt;
        probs.shape = {terms * rows, keys};
        probs.data = thread_scratch(1, (terms * rows * keys * int64_t(es) + 3) / 4);
        float* outs = thread_scratch(2, terms * padded * ldv);
        for (int64_t term = 0; term < terms; ++term) {
          const Tensor qb = qs[size_t(term)]->rows(b * sq + r0, b * sq + r0 + rows).cols(h * d, (h + 1) * d);
          widened_panel_products(qb, kp + (term * k_heads + kv_head) * k_size, d * kPanel, d,
                                 (keys + kPanel - 1) / kPanel, scores, ldk);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = mask.causal ? std::min(sk, r0 + r + 1) : sk;
            char* prow = static_cast<char*>(probs.row(term * rows + r));
            softmax(scores + r * ldk, n, valid, prow);
            std::memset(prow + size_t(n) * es, 0, size_t(keys - n) * es);
          }
          widened_panel_products(probs.rows(term * rows, (term + 1) * rows), vp + kv_head * v_size, sk * kPanel, keys,
                                 value_panels, outs + term * padded * ldv, ldv);
        }
        Tensor ob = o.rows(b * sq + r0, b * sq + r0 + rows).cols(h * d, (h + 1) * d);
        for (int64_t r = 0; r < rows; ++r) {
          float* out = outs + r * ldv;
          if (terms > 1) {
            float* second = outs + (padded + r) * ldv;
            round_to(dt, out, d);
            round_to(dt, second, d);
            for (int64_t j = 0; j < d; ++j) out[j] -= second[j];
          }
          store_row(ob, r, out, d);
        }
      },
      Schedule::dynamic);
}

// Whether a kernel knob (auto | direct | tiles) sends this call to a direct AVX512-BF16 kernel that
// can run it; records the choice taken. auto: direct unless the CPU has AMX, where oneDNN's tiles
// run on it. Widened bf16 (cpu.native_bf16 off, as an AVX2-only CPU runs) takes the tiles.
bool takes_direct(Knob& knob, bool runnable) {
  const int asked = knob.value();
  const bool direct = (asked == 1 || (asked == 0 && !amx_bf16())) && runnable && avx512_bf16() && native_bf16();
  knob.took(direct ? (asked == 0 ? 0 : 1) : asked == 0 ? 0 : 2);
  return direct;
}

// Whether attention without a band takes the widened direct kernel: bf16 widened (an AVX2-only
// CPU, or cpu.native_bf16 off), the kernel's AVX2 and FMA present, the knob auto or direct.
bool takes_widened_direct(const Tensor& q) {
  const int asked = attention_kernel_knob.value();
  const bool widened = q.dtype != DType::f32 && !native_bf16();
  const bool direct = asked != 2 && widened && sgemm_avx2_supported();
  if (direct) attention_kernel_knob.took(asked);
  return direct;
}

// softmax(q k^T * scale) v for each (q, k) term; two terms give the differential attention's
// o = round(o1) - round(o2): both softmaxes of a query block land in one probability buffer, one
// stacked P·V GEMM forms both outputs, and V is split into heads once.
void attend(Context& c, const std::vector<const Tensor*>& qs, const std::vector<const Tensor*>& ks, const Tensor& v,
            Tensor& o, int64_t head_dim, float scale, const ops::AttentionOptions& mask) {
  const Tensor& q = *qs[0];
  const Tensor& k = *ks[0];
  const int64_t terms = int64_t(qs.size());
  const int64_t batch = mask.batch, rows_q = q.shape[0], rows_k = k.shape[0], d = head_dim;
  const int64_t sq = rows_q / batch, sk = rows_k / batch;
  const int64_t hq = q.shape[1] / d, hk = k.shape[1] / d;
  APUS_CHECK(batch >= 1 && rows_q % batch == 0 && rows_k % batch == 0 && q.shape[1] % d == 0 && k.shape[1] % d == 0 &&
                 v.shape == k.shape && o.shape == q.shape && hk > 0 && hq % hk == 0 && q.dtype == k.dtype &&
                 k.dtype == v.dtype && o.dtype == q.dtype,
             "attention: q ", shape_str(q.shape), ", k ", shape_str(k.shape), ", v ", shape_str(v.shape), ", o ",
             shape_str(o.shape), ", head_dim ", d, ", batch ", batch);
  for (int64_t i = 1; i < terms; ++i)
    APUS_CHECK(qs[size_t(i)]->shape == q.shape && ks[size_t(i)]->shape == k.shape && qs[size_t(i)]->dtype == q.dtype &&
                   ks[size_t(i)]->dtype == k.dtype,
               "differential attention: q2 ", shape_str(qs[size_t(i)]->shape), ", k2 ", shape_str(ks[size_t(i)]->shape),
               " differ from q ", shape_str(q.shape), ", k ", shape_str(k.shape));
  APUS_CHECK(mask.window >= 0 && (mask.window == 0 || sq == sk), "attention: a band (window ", mask.window,
             ") needs as many queries as keys, got ", sq, " and ", sk);
  APUS_CHECK(!mask.key_valid || (mask.key_valid->dtype == DType::i64 && mask.key_valid->numel() == rows_k &&
                                 mask.key_valid->contiguous()),
             "attention: the key mask must be i64 [", rows_k, "] (one entry per key row)");
  const int64_t* key_valid = mask.key_valid ? mask.key_valid->ptr<int64_t>() : nullptr;
  ArenaScope scope(*c.arena);
  const DType dt = q.dtype;
  const int choice = attention_block_knob.value();
  attention_block_knob.took(choice);
  const bool automatic = choice == 0;
  int64_t block = std::min<int64_t>(sq, automatic ? 128 : std::stoll(attention_block_knob.choices()[size_t(choice)]));
  const bool round_steps = mask.rounding == ops::Rounding::each_step && dt == DType::bf16;
  const RowSoftmax softmax{scale, mask.softcap, round_steps, dt};
  const bool pairs_of_bf16 = dt == DType::bf16 && d % 2 == 0;
  if (mask.window > 0 && takes_direct(band_attention_knob, pairs_of_bf16 && 2 * mask.window + 8 <= 48))
    return attend_band_direct(qs, ks, v, o, d, mask, softmax, key_valid, block);
  if (mask.window == 0 && takes_widened_direct(q))
    return attend_widened(c, qs, ks, v, o, d, mask, softmax, key_valid, block);
  if (mask.window == 0 && takes_direct(attention_kernel_knob, pairs_of_bf16))
    return attend_direct(c, qs, ks, v, o, d, mask, softmax, key_valid, block);
  // The GEMM tiles: an unmasked attention's products in blocks of 512 query rows by default, fewer
  // and larger GEMMs (SA3's DiT attention 11-19 % faster than at 128, klein's 4608 tokens 7 %, on
  // an AMX Xeon: docs/SPEED.md session 34); a causal mask would waste a larger block's triangle.
  if (automatic && !mask.causal && mask.window == 0 && !key_valid) block = std::min<int64_t>(sq, 512);
  const int64_t blocks = (sq + block - 1) / block;
  std::vector<Tensor> qh, kh;
  for (int64_t i = 0; i < terms; ++i) {
    qh.push_back(Tensor::in(*c.arena, {hq, rows_q, d}, dt));
    kh.push_back(Tensor::in(*c.arena, {hk, rows_k, d}, dt));
    split_heads(*qs[size_t(i)], d, qh.back());
    split_heads(*ks[size_t(i)], d, kh.back());
  }
  Tensor vh = Tensor::in(*c.arena, {hk, rows_k, d}, dt);
  split_heads(v, d, vh);
  const int threads = omp_get_max_threads();
  // A band needs scores for its block's rows and the window on either side only.
  const int64_t max_keys = mask.window > 0 ? std::min(sk, block + 2 * mask.window) : sk;
  const int64_t stacked = terms * block;  // each thread's probability rows: the terms' blocks
  Tensor scores = Tensor::in(*c.arena, {threads * block, max_keys}, DType::f32);
  Tensor probs = Tensor::in(*c.arena, {threads * stacked, max_keys}, dt);
  // Two terms: both outputs in fp32 before each is rounded and the difference taken.
  Tensor outs = Tensor::in(*c.arena, {terms > 1 ? threads * stacked : 0, d}, DType::f32);
  const size_t es = dtype_size(dt);

  // Sample b's rows of head h sit at h * rows + b * s + r in the head-major copies.
  parallel_for(
      batch * hq * blocks,
      [&](int64_t task) {
        const int64_t b = task / (hq * blocks), h = (task / blocks) % hq;
        const int64_t r0 = (task % blocks) * block, nb = std::min(block, sq - r0);
        const int64_t g = h / (hq / hk);
        const int64_t t = omp_get_thread_num();
        const int64_t q0 = h * rows_q + b * sq + r0;
        Tensor sb = scores.rows(t * block, t * block + nb);
        // Keys the block can see: up to its last row (causal), within the band (window), else all.
        const int64_t w = mask.window;
        const int64_t key_lo = w > 0 ? std::max<int64_t>(0, r0 - w) : 0;
        int64_t key_hi = w > 0 ? std::min(sk, r0 + nb + w) : sk;
        if (mask.causal) key_hi = std::min(key_hi, r0 + nb);
        const int64_t nk = key_hi - key_lo;
        const size_t kv_offset = size_t((g * rows_k + b * sk + key_lo) * d) * es;
        const char* vbase = static_cast<const char*>(vh.data) + kv_offset;
        Tensor ob = o.rows(b * sq + r0, b * sq + r0 + nb).cols(h * d, (h + 1) * d);
        const int64_t* valid = key_valid ? key_valid + b * sk + key_lo : nullptr;
        Tensor sbn = sb.cols(0, nk);
        Tensor pall = probs.rows(t * stacked, t * stacked + terms * nb).cols(0, nk);
        for (int64_t term = 0; term < terms; ++term) {
          Tensor qb = qh[size_t(term)].reshape({hq * rows_q, d}).rows(q0, q0 + nb);
          const char* kbase = static_cast<const char*>(kh[size_t(term)].data) + kv_offset;
          Tensor pbn = pall.rows(term * nb, (term + 1) * nb);
          gemm(qb, kbase, dt, 1, d, nullptr, sbn, d, nk);  // Q · K^T
          for (int64_t i = 0; i < nb; ++i) {
            float* srow = static_cast<float*>(sbn.row(i));
            const int64_t qi = r0 + i;  // this row's position; the visible keys, relative to key_lo
            int64_t first = 0, end = nk;
            if (w > 0) {
              first = qi - w - key_lo;
              end = qi + w + 1 - key_lo;
            }
            if (mask.causal) end = std::min(end, qi + 1 - key_lo);
            // The softmax runs over the keys this row can see; the others get probability 0.
            const int64_t lo = std::clamp<int64_t>(first, 0, nk), hi = std::clamp<int64_t>(end, lo, nk);
            char* prow = static_cast<char*>(pbn.row(i));
            std::memset(prow, 0, size_t(lo) * es);
            std::memset(prow + size_t(hi) * es, 0, size_t(nk - hi) * es);
            softmax(srow + lo, hi - lo, valid ? valid + lo : nullptr, prow + size_t(lo) * es);
          }
        }
        if (terms == 1) {
          gemm(pall, vbase, dt, d, 1, nullptr, ob, nk, d);  // P · V
          return;
        }
        Tensor both = outs.rows(t * stacked, t * stacked + 2 * nb);
        // Each term's P · V its own GEMM of the shape attention's is: a GEMM's rows are not the
        // same bits at every row count on every CPU (oneDNN's AVX2 sgemm), and the difference
        // of two attentions must be exactly that.
        for (int64_t term = 0; term < terms; ++term) {
          Tensor out_term = both.rows(term * nb, (term + 1) * nb);
          gemm(pall.rows(term * nb, (term + 1) * nb), vbase, dt, d, 1, nullptr, out_term, nk, d);
        }
        for (int64_t i = 0; i < nb; ++i) {
          float* first = static_cast<float*>(both.row(i));
          const float* second = static_cast<const float*>(both.row(nb + i));
          round_to(dt, first, d);
          float* diff = thread_scratch(0, d);
          std::copy(second, second + d, diff);
          round_to(dt, diff, d);
          for (int64_t j = 0; j < d; ++j) first[j] -= diff[j];
          store_row(ob, i, first, d);
        }
      },
      Schedule::dynamic);
}

}  // namespace

void attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& o, int64_t head_dim, float scale,
               const ops::AttentionOptions& mask) {
  attend(c, {&q}, {&k}, v, o, head_dim, scale, mask);
}

void differential_attention(Context& c, const Tensor& q, const Tensor& k, const Tensor& q2, const Tensor& k2,
                            const Tensor& v, Tensor& o, int64_t head_dim, float scale,
                            const ops::AttentionOptions& mask) {
  attend(c, {&q, &q2}, {&k, &k2}, v, o, head_dim, scale, mask);
}

}  // namespace apus::cpu
