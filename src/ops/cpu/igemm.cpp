// The int8 tier's integer product on CPUs without VNNI (issue 40): AVX2's vpmaddwd.
//
// oneDNN's AVX2 int8 GEMM multiplies u8 x s8 pairs by vpmaddubsw into saturating 16-bit sums, so
// the tier refused every CPU without VNNI (AMD Zen 2/3, Intel before Ice Lake). Here both operands
// are widened to int16 and vpmaddwd adds each pair's products into an int32 lane: with codes in
// [-127, 127] nothing saturates, every sum is exact, and the result equals oneDNN's VNNI GEMM bit
// for bit whatever the order. The weight is packed per call into panels of 16 columns, k in pairs
// ([k/2][16][2] int16); the rows once into micro-panels of 6 ([k/2][6] pairs); a 6x16 kernel keeps 12 int32
// accumulators in registers, as the widened f32 GEMM does (sgemm.cpp), with twice its products per
// instruction.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/cpu/cpu_ops.h"

namespace apus::cpu {

namespace {

constexpr int64_t kMR = 6, kNR = 16;  // the kernel's tile: 6 rows x 2 vectors of 8 int32
constexpr int64_t kKP = 256;          // pairs of k a block (a 16 KiB weight micro-panel)
constexpr int64_t kMC = 72;           // rows a task covers
constexpr int64_t kNC = 768;          // columns a task covers

// Eight int32 vectors (rows r) turned into their transpose: out[i] lane c = r[c] lane i.
__attribute__((target("avx2"))) void transpose_8x8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// Panel p of the codes w [n][k] (see pack_weight) at dst: sixteen codes of each of its 16 rows
// widened to eight int16 pairs, two 8x8 transposes of those pairs; the k past the last whole 16
// one code at a time. Scalar, this packing took 5 % of the int8 linear (perf).
__attribute__((target("avx2"))) void pack_panel(const int8_t* w, int64_t k, int64_t n, int64_t p, int16_t* dst) {
  const int64_t pairs = (k + 1) / 2, cols = std::min(kNR, n - p * kNR), whole = k / 16 * 16;
  std::fill_n(dst, pairs * 2 * kNR, int16_t(0));
  for (int64_t k0 = 0; k0 < whole; k0 += 16) {
    for (int64_t half = 0; half < 2; ++half) {
      __m256i r[8];
      for (int64_t c = 0; c < 8; ++c) {
        const int64_t col = half * 8 + c;
        r[c] =
            col < cols
                ? _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (p * kNR + col) * k + k0)))
                : _mm256_setzero_si256();
      }
      transpose_8x8(r);
      for (int64_t i = 0; i < 8; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + ((k0 / 2 + i) * kNR + half * 8) * 2), r[i]);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    const int8_t* row = w + (p * kNR + c) * k;
    for (int64_t i = whole; i < k; ++i) dst[(i / 2 * kNR + c) * 2 + i % 2] = row[i];
  }
}

// The codes w [n][k] as int16 panels of 16 columns: panel p at out + p * pairs * 32 holds
// [pair i][column c][2] = w[16p + c][2i], w[16p + c][2i + 1]; an odd k's last pair and the columns
// past n zero.
const int16_t* pack_weight(const int8_t* w, int64_t k, int64_t n) {
  const int64_t pairs = (k + 1) / 2, panels = (n + kNR - 1) / kNR;
  thread_local std::vector<int16_t> packed;
  int16_t* const out = line_aligned(packed, size_t(panels * pairs * 2 * kNR));
  parallel_for(panels, [&](int64_t p) { pack_panel(w, k, n, p, out + p * pairs * 2 * kNR); });
  return out;
}

// The codes a [m][k] as micro-panels of 6 rows, once for every column block: panel i at
// out + i * pairs * 6 holds [pair q][row r] = the int32 whose halves are the int16 codes
// a[6i + r][2q] (low) and a[6i + r][2q + 1]; rows past m and an odd k's last code zero.
const int32_t* pack_rows(const int8_t* a, int64_t m, int64_t k) {
  const int64_t pairs = (k + 1) / 2, panels = (m + kMR - 1) / kMR;
  thread_local std::vector<int32_t> packed;
  int32_t* const out = line_aligned(packed, size_t(panels * pairs * kMR));
  parallel_for(panels, [&](int64_t i) {
    int32_t* dst = out + i * pairs * kMR;
    for (int64_t r = 0; r < kMR; ++r) {
      const bool real = i * kMR + r < m;
      const int8_t* row = a + (real ? i * kMR + r : 0) * k;  // padding rows read nothing
      for (int64_t q = 0; q < pairs; ++q) {
        const int16_t lo = real ? row[2 * q] : 0, hi = real && 2 * q + 1 < k ? row[2 * q + 1] : 0;
        dst[q * kMR + r] = int32_t(uint32_t(uint16_t(lo)) | uint32_t(uint16_t(hi)) << 16);
      }
    }
  });
  return out;
}

// c[6][16] (row stride ldc) = (first ? 0 : c) + a · b over kp pairs: a [kp][6] pairs, b [kp][16][2].
// Named accumulators and one product register: 12 + 2 + 2 of the 16, which GCC keeps without
// spilling only when spelled out (an array of them spilled every sum to the stack).
__attribute__((target("avx2"))) void kernel_6x16(int64_t kp, const int32_t* a, const int16_t* b, int32_t* c,
                                                 int64_t ldc, bool first) {
  auto at = [&](int64_t r, int h) { return reinterpret_cast<__m256i*>(c + r * ldc + 8 * h); };
  __m256i c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (first) {
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_si256();
  } else {
    c00 = _mm256_loadu_si256(at(0, 0)), c01 = _mm256_loadu_si256(at(0, 1));
    c10 = _mm256_loadu_si256(at(1, 0)), c11 = _mm256_loadu_si256(at(1, 1));
    c20 = _mm256_loadu_si256(at(2, 0)), c21 = _mm256_loadu_si256(at(2, 1));
    c30 = _mm256_loadu_si256(at(3, 0)), c31 = _mm256_loadu_si256(at(3, 1));
    c40 = _mm256_loadu_si256(at(4, 0)), c41 = _mm256_loadu_si256(at(4, 1));
    c50 = _mm256_loadu_si256(at(5, 0)), c51 = _mm256_loadu_si256(at(5, 1));
  }
// Row r's pair times the two B vectors into its two accumulators (a macro: a lambda would not
// inherit the function's AVX2 target).
#define APUS_IGEMM_ROW(r, lo, hi)                        \
  do {                                                   \
    const __m256i x = _mm256_set1_epi32(a[r]);           \
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(x, b0)); \
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(x, b1)); \
  } while (0)
  for (int64_t q = 0; q < kp; ++q, a += kMR, b += 2 * kNR) {
    const __m256i b0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i b1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(b + kNR));
    APUS_IGEMM_ROW(0, c00, c01);
    APUS_IGEMM_ROW(1, c10, c11);
    APUS_IGEMM_ROW(2, c20, c21);
    APUS_IGEMM_ROW(3, c30, c31);
    APUS_IGEMM_ROW(4, c40, c41);
    APUS_IGEMM_ROW(5, c50, c51);
  }
#undef APUS_IGEMM_ROW
  _mm256_storeu_si256(at(0, 0), c00), _mm256_storeu_si256(at(0, 1), c01);
  _mm256_storeu_si256(at(1, 0), c10), _mm256_storeu_si256(at(1, 1), c11);
  _mm256_storeu_si256(at(2, 0), c20), _mm256_storeu_si256(at(2, 1), c21);
  _mm256_storeu_si256(at(3, 0), c30), _mm256_storeu_si256(at(3, 1), c31);
  _mm256_storeu_si256(at(4, 0), c40), _mm256_storeu_si256(at(4, 1), c41);
  _mm256_storeu_si256(at(5, 0), c50), _mm256_storeu_si256(at(5, 1), c51);
}

}  // namespace

void int8_gemm_avx2(const int8_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int32_t* c) {
  APUS_CHECK(sgemm_avx2_supported(), "the int8 tier's AVX2 product: this CPU has no AVX2");
  if (m == 0 || n == 0) return;
  const int16_t* panels = pack_weight(w, k, n);
  const int32_t* rows_packed = pack_rows(a, m, k);
  const int64_t mc = even_block(m, kMC, kMR), nc = even_block(n, kNC, kNR);
  const int64_t pairs = (k + 1) / 2, row_blocks = (m + mc - 1) / mc, col_blocks = (n + nc - 1) / nc;
  // Tasks column-block major, so a thread's consecutive tasks reuse the same weight panels.
  parallel_for(row_blocks * col_blocks, [&](int64_t task) {
    const int64_t r0 = task % row_blocks * mc, rows = std::min(mc, m - r0);
    const int64_t j0 = task / row_blocks * nc, cols = std::min(nc, n - j0);
    const int64_t col_panels = (cols + kNR - 1) / kNR, micro = (rows + kMR - 1) / kMR;
    thread_local std::vector<int32_t> tile_buf;
    int32_t* tile = line_aligned(tile_buf, size_t(kMC * kNC));  // [kMC][kNC]: the block's sums
    for (int64_t q0 = 0; q0 < std::max<int64_t>(pairs, 1); q0 += kKP) {
      const int64_t kp = std::max<int64_t>(0, std::min(kKP, pairs - q0));
      for (int64_t jp = 0; jp < col_panels; ++jp) {
        const int16_t* b = panels + ((j0 / kNR + jp) * pairs + q0) * 2 * kNR;
        for (int64_t ip = 0; ip < micro; ++ip)
          kernel_6x16(kp, rows_packed + ((r0 / kMR + ip) * pairs + q0) * kMR, b, tile + ip * kMR * kNC + jp * kNR, kNC,
                      q0 == 0);
      }
    }
    for (int64_t r = 0; r < rows; ++r) std::copy_n(tile + r * kNC, cols, c + (r0 + r) * n + j0);
  });
}

}  // namespace apus::cpu
