// The widened GEMM (issue 40): f32 products for CPUs without bf16 dot products, on AVX2 and FMA.
//
// oneDNN's sgemm sums in an order that depends on the call's shape and thread split, so the
// widened path ran it single-threaded on 64-row tiles (a row's bits must not depend on the rows
// that came with it); each tile call packed the whole weight again, and the linear ran at 0.5-0.65x
// OpenBLAS's sgemm held to the same AVX2 kernels. Here, as BLIS arranges it: the weight is widened
// and packed once per call into panels of 16 columns, rows into micro-panels of 6, and a 6x16
// kernel keeps 12 accumulators in registers over blocks of 256 of the inner dimension. Each output
// is one FMA chain over k in order, carried through memory between blocks, then plus the bias:
// the same bits whatever the number of rows, their split into blocks or the threads.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/cpu/cpu_ops.h"
#include "ops/cpu/rows.h"
#include "ops/cpu/vec.h"

namespace apus::cpu {

namespace {

constexpr int64_t kMR = 6, kNR = kWidenedPanel;  // the kernel's tile: 6 rows x 2 vectors of 8
constexpr int64_t kKC = 256;                     // inner block: a 16 KiB weight micro-panel stays in L1
constexpr int64_t kMC = 72;                      // rows a task packs (12 micro-panels, 72 KiB at kKC)
constexpr int64_t kNC = 768;                     // columns a task covers (48 panels)

// The weight [k, n] as f32 panels of 16 columns (pack_widened_panel's), in the calling thread's buffer,
// kept from call to call: a fresh one each call cost page faults and zeroing (47 MB for SA3's
// feed-forward, ~7 % of the call).
const float* pack_weight(const void* b, DType bt, int64_t sk, int64_t sn, int64_t k, int64_t n) {
  const int64_t panels = (n + kNR - 1) / kNR;
  thread_local std::vector<float> packed;
  float* const out = line_aligned(packed, size_t(panels * k * kNR));  // the caller's: a worker's `packed` is its own
  parallel_for(panels, [&](int64_t p) { pack_widened_panel(b, bt, sk, sn, k, n, p, out + p * k * kNR); });
  return out;
}

// Rows [r0, r0 + rows) of a, inner elements [p0, p0 + kc), as micro-panels of 6 rows: [panel][kc][6],
// rows past `rows` zero.
void pack_rows(const Tensor& a, int64_t r0, int64_t rows, int64_t p0, int64_t kc, float* out) {
  thread_local std::vector<float> line_buf;
  line_buf.resize(size_t(kc));
  float* line = line_buf.data();
  const int64_t padded = (rows + kMR - 1) / kMR * kMR;
  for (int64_t r = 0; r < padded; ++r) {
    float* dst = out + (r / kMR) * kc * kMR + r % kMR;
    if (r < rows) {
      widen_row(static_cast<const char*>(a.row(r0 + r)) + dtype_bytes(a.dtype, p0), a.dtype, line, kc);
      for (int64_t i = 0; i < kc; ++i) dst[i * kMR] = line[i];
    } else {
      for (int64_t i = 0; i < kc; ++i) dst[i * kMR] = 0.0f;
    }
  }
}

// c[6][16] (row stride ldc) = (first ? 0 : c) + a · b over kc: a [kc][6], b [kc][16], FMAs in order of k.
__attribute__((target("avx2,fma"))) void kernel_6x16(int64_t kc, const float* a, const float* b, float* c, int64_t ldc,
                                                     bool first) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (first) {
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  } else {
    c00 = _mm256_loadu_ps(c), c01 = _mm256_loadu_ps(c + 8);
    c10 = _mm256_loadu_ps(c + ldc), c11 = _mm256_loadu_ps(c + ldc + 8);
    c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
    c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
    c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
    c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
  }
// One step of k: a row's broadcast times the two B vectors into each row's two accumulators (a
// macro: a lambda would not inherit the function's AVX2 target).
#define APUS_SGEMM_STEP(ap, bp)                                            \
  do {                                                                     \
    const __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps((bp) + 8); \
    __m256 x = _mm256_broadcast_ss(ap);                                    \
    c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);  \
    x = _mm256_broadcast_ss((ap) + 1);                                     \
    c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);  \
    x = _mm256_broadcast_ss((ap) + 2);                                     \
    c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);  \
    x = _mm256_broadcast_ss((ap) + 3);                                     \
    c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);  \
    x = _mm256_broadcast_ss((ap) + 4);                                     \
    c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);  \
    x = _mm256_broadcast_ss((ap) + 5);                                     \
    c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);  \
  } while (0)
  int64_t p = 0;
  for (; p + 4 <= kc; p += 4, a += 4 * kMR, b += 4 * kNR) {  // four steps a trip: less loop overhead
    _mm_prefetch(reinterpret_cast<const char*>(b + 8 * kNR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 10 * kNR), _MM_HINT_T0);
    APUS_SGEMM_STEP(a, b);
    APUS_SGEMM_STEP(a + kMR, b + kNR);
    APUS_SGEMM_STEP(a + 2 * kMR, b + 2 * kNR);
    APUS_SGEMM_STEP(a + 3 * kMR, b + 3 * kNR);
  }
  for (; p < kc; ++p, a += kMR, b += kNR) APUS_SGEMM_STEP(a, b);
#undef APUS_SGEMM_STEP
  _mm256_storeu_ps(c, c00), _mm256_storeu_ps(c + 8, c01);
  _mm256_storeu_ps(c + ldc, c10), _mm256_storeu_ps(c + ldc + 8, c11);
  _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
  _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
  _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
  _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
}

}  // namespace

void pack_widened_panel(const void* b, DType bt, int64_t sk, int64_t sn, int64_t k, int64_t n, int64_t p, float* dst) {
  const size_t es = dtype_size(bt);
  const int64_t j0 = p * kNR, width = std::min(kNR, n - j0);
  auto at = [&](int64_t i, int64_t j) { return static_cast<const char*>(b) + size_t(i * sk + j * sn) * es; };
  if (sn == 1) {  // rows of [k][n] (a value matrix): each row's 16 columns are a panel row already
    for (int64_t i = 0; i < k; ++i) {
      widen_row(at(i, j0), bt, dst + i * kNR, width);
      std::fill(dst + i * kNR + width, dst + (i + 1) * kNR, 0.0f);
    }
    return;
  }
  // The panel's 16 columns widened side by side, then interleaved in order of k (the writes
  // sequential, 16 read streams).
  thread_local std::vector<float> lines;
  lines.resize(size_t(kNR * k));
  for (int64_t c = 0; c < kNR; ++c) {
    float* line = lines.data() + c * k;
    if (c >= width) std::fill_n(line, k, 0.0f);
    else if (sk == 1) widen_row(at(0, j0 + c), bt, line, k);  // row j of [n][k]: a linear's weight, keys
    else
      for (int64_t i = 0; i < k; ++i) widen_row(at(i, j0 + c), bt, line + i, 1);
  }
  for (int64_t i = 0; i < k; ++i)
    for (int64_t c = 0; c < kNR; ++c) dst[i * kNR + c] = lines[size_t(c * k + i)];
}

void widened_panel_products(const Tensor& a, const float* panels, int64_t panel_stride, int64_t k, int64_t count,
                            float* c, int64_t ldc) {
  const int64_t rows = a.shape[0], micro = (rows + kMR - 1) / kMR;
  // Buffers of this file's own (the caller may hold the shared thread_scratch rows).
  thread_local std::vector<float> packed_buf;
  float* rows_packed = line_aligned(packed_buf, size_t(micro * kMR * kKC));
  for (int64_t p0 = 0; p0 < std::max<int64_t>(k, 1); p0 += kKC) {
    const int64_t kc = std::min(kKC, k - p0);
    if (kc > 0) pack_rows(a, 0, rows, p0, kc, rows_packed);
    for (int64_t jp = 0; jp < count; ++jp) {
      const float* wp = panels + jp * panel_stride + p0 * kNR;
      for (int64_t ip = 0; ip < micro; ++ip)
        kernel_6x16(std::max<int64_t>(kc, 0), rows_packed + ip * kc * kMR, wp, c + ip * kMR * ldc + jp * kNR, ldc,
                    p0 == 0);
    }
  }
}

bool sgemm_avx2_supported() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

void sgemm_avx2(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n,
                const Tensor* bias, Tensor& c, int64_t k, int64_t n) {
  const int64_t m = a.shape[0];
  APUS_CHECK(sgemm_avx2_supported(), "sgemm: this CPU has no AVX2 and FMA");
  if (m == 0 || n == 0) return;
  const float* w = pack_weight(b, b_type, b_stride_k, b_stride_n, k, n);
  std::vector<float> bias_f32(size_t(n), 0.0f);
  if (bias) widen_row(bias->data, bias->dtype, bias_f32.data(), n);
  const int64_t mc = even_block(m, kMC, kMR), nc = even_block(n, kNC, kNR);
  const int64_t row_blocks = (m + mc - 1) / mc, col_blocks = (n + nc - 1) / nc;
  // Tasks column-block major, so a thread's consecutive tasks reuse the same weight panels.
  parallel_for(row_blocks * col_blocks, [&](int64_t task) {
    const int64_t r0 = task % row_blocks * mc, rows = std::min(mc, m - r0);
    const int64_t j0 = task / row_blocks * nc, cols = std::min(nc, n - j0);
    thread_local std::vector<float> acc_buf;
    thread_local std::vector<float> line_buf(static_cast<size_t>(kNC));
    float* acc = line_aligned(acc_buf, size_t(kMC * kNC));  // [kMC][kNC]: the block's sums
    widened_panel_products(a.rows(r0, r0 + rows), w + j0 * k, k * kNR, k, (cols + kNR - 1) / kNR, acc, kNC);
    float* line = line_buf.data();
    for (int64_t r = 0; r < rows; ++r) {
      Tensor out = c.rows(r0 + r, r0 + r + 1).cols(j0, j0 + cols);
      for (int64_t j = 0; j < cols; ++j) line[j] = acc[r * kNC + j] + bias_f32[size_t(j0 + j)];
      store_row(out, 0, line, cols);
    }
  });
}

}  // namespace apus::cpu
