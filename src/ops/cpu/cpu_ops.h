#pragma once
// The CPU backend: every op of ops/op_list.h (backend.cpp puts them behind the Backend interface).
// Files: linear (oneDNN matmul), conv (oneDNN), attention, norm, elementwise.
#include <cstdint>
#include <vector>

#include "core/variants.h"
#include "ops/ops.h"

namespace apus::cpu {

// C[M,N] = A[M,K] · B (+ bias) through oneDNN; B is given by its strides (row-major [K,N] or a
// transposed [N,K] weight); all strides in elements; fp32 accumulation.
// n contiguous elements of a float dtype (bf16, f16, f32) as f32, by the vectorised row kernels.
void widen_row(const void* p, DType dt, float* out, int64_t n);

// The widened GEMM on AVX2 and FMA (sgemm.cpp): c = a · b + bias in f32, every output one FMA chain
// over k in order (a row's bits independent of the rows beside it and of the threads).
bool sgemm_avx2_supported();
void sgemm_avx2(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n,
                const Tensor* bias, Tensor& c, int64_t k, int64_t n);
void gemm(const Tensor& a, const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n, const Tensor* bias,
          Tensor& c, int64_t k, int64_t n);
// Its parts, for other products on the same kernel (attention's): a matrix [k, n] (element (i, j) at
// b + i * b_stride_k + j * b_stride_n) is laid out as f32 panels of kWidenedPanel columns, panel p
// as [k][kWidenedPanel] with the columns past n zero; then c (ld ldc, its rows padded to a multiple
// of 6 and its columns to the panel) = a · (`count` panels, panel q at panels + q * panel_stride,
// their first k rows), each output one FMA chain over k in order, single-threaded.
constexpr int64_t kWidenedPanel = 16;
// A thread's buffer of at least n elements from a cache line on, grown and never shrunk (a shrunk
// one is zeroed again when it grows): the kernels' 32-byte loads of a 64-byte panel row split
// across two lines otherwise (glibc's large blocks start 16 bytes past a page), 3-8 % of the GEMM
// on an AVX2-only EPYC (docs/SPEED.md, session 23).
template <typename T> T* line_aligned(std::vector<T>& buf, size_t n) {
  if (buf.size() < n + 64 / sizeof(T)) buf.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
}
// The size of blocks of at most `most` (a multiple of `unit`) covering n as evenly as whole units
// allow, as many blocks as `most` gives: a static split of the GEMMs' tasks over the threads then
// gives no thread a block's remainder (1024 columns as 512 + 512, not 768 + 256: a third of two
// threads idle on Stable Audio 3's 1024-wide linears; docs/SPEED.md, session 30).
inline int64_t even_block(int64_t n, int64_t most, int64_t unit) {
  const int64_t blocks = (n + most - 1) / most, size = (n + blocks - 1) / blocks;
  return (size + unit - 1) / unit * unit;
}
void pack_widened_panel(const void* b, DType b_type, int64_t b_stride_k, int64_t b_stride_n, int64_t k, int64_t n,
                        int64_t p, float* out);
void widened_panel_products(const Tensor& a, const float* panels, int64_t panel_stride, int64_t k, int64_t count,
                            float* c, int64_t ldc);

// Whether the int8 tier's products are exact here: oneDNN's on the VNNI instructions (AVX512-VNNI,
// AVX-VNNI; AMX-INT8 comes with the first), or apus's AVX2 kernel (igemm.cpp). Without VNNI
// oneDNN sums u8 x s8 pairs in saturating 16-bit lanes; without AVX2 either the tier is refused.
bool exact_int8_products();
// c[m][n] = a[m][k] · w[n][k]^T over int8 codes in [-127, 127], exact int32 sums (igemm.cpp).
void int8_gemm_avx2(const int8_t* a, int64_t m, int64_t k, const int8_t* w, int64_t n, int32_t* c);

// The CPU backend's variant knobs (core/variants.h), read at each call.
extern Knob native_bf16_knob;       // "on" (the CPU's bf16 instructions, when it has them) or "off" (f32, as AVX2)
extern Knob conv_layout_knob;       // "blocked" (oneDNN's own layout) or "plain" (NCHW)
extern Knob attention_block_knob;   // query rows per attention task
extern Knob band_attention_knob;    // "auto" (direct unless AMX), "direct" (AVX512-BF16, over each row's own keys) or
                                    // "tiles" (GEMM)
extern Knob attention_kernel_knob;  // the same choices for attention without a band
extern Knob int8_gemm_knob;         // the int8 tier's GEMM: "auto" (oneDNN on VNNI, else AVX2) or "avx2"
extern Knob
    linear_panel_mb_knob;        // MiB of expanded weights a stored format's panel holds: "32" (the default), "8", "2"
extern Knob linear_panels_knob;  // "whole", or "panels": weights in the activation dtype split as stored formats'

APUS_DECLARE_OPS

}  // namespace apus::cpu
