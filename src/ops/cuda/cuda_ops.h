#pragma once
// The CUDA backend's ops (src/ops/cuda/*.cu), one function per op of the list.
#include <cuda_runtime.h>

#include "core/error.h"
#include "core/scaled_codes.h"
#include "ops/ops.h"

namespace apus::cuda {

APUS_DECLARE_OPS

// Throws an apus::Error naming the call and CUDA's message when `e` is an error.
void check(cudaError_t e, const char* what);
// The stream every op of this backend is queued on.
cudaStream_t stream();

// A row-major matrix on the device: rows `ld` elements apart, `batch_stride` elements between
// the matrices of a batch.
struct Operand {
  const void* p;
  DType dt;
  int64_t ld;
  int64_t batch_stride = 0;
};
// c[i] = alpha * a[i] · b[i]^T (b [N, K], b_transposed) or alpha * a[i] · b[i] (b [K, N]), plus
// bias[N] when given, for i < batch, through cuBLASLt: fp32 accumulation, c rounded once to its
// dtype (f32 or the inputs'). i8 a and b give exact i32 sums (b_transposed, alpha 1, no bias; the
// integer kernels want M and K multiples of 4, leading dimensions too, 16-byte aligned rows best).
void gemm(const Operand& a, const Operand& b, bool b_transposed, const Operand& c, int64_t m, int64_t n, int64_t k,
          int64_t batch, float alpha, const void* bias = nullptr);

// Row scales of an fp8 product, f32 vectors in device memory: output (i, j) times a_rows[i] and
// b_rows[j].
struct OuterScales {
  const float* a_rows;
  const float* b_rows;
};
// c [M, N] = (a · b^T) scaled by rows, plus bias[N] (in c's dtype) when given: a [M, K] and b [N, K]
// e4m3 codes, c bf16 or f32, through cuBLASLt's outer-vector scaling (Hopper's fp8 kernels; K and
// N multiples of 16, 16-byte aligned rows). False where cuBLASLt has no algorithm for it, nothing
// run: the caller takes another route.
bool scaled_fp8_gemm(const Operand& a, const Operand& b, const OuterScales& scales, const Operand& c, int64_t m,
                     int64_t n, int64_t k, const void* bias);

// Queue marks (graphs.cu, Backend::mark_queue): an event recorded in this thread's stream, and a
// wait for it.
int mark_queue();
void wait_for_mark(int slot);

// A step's graph (graphs.cu, Backend::begin_graph): recorded from this thread's stream, launched
// as one graph, or dropped. host_source gives the host bytes a copy queued now may read: the bytes
// themselves, or while recording a pinned copy kept until the graph has run.
bool begin_graph();
void launch_graph();
void abandon_graph() noexcept;
const void* host_source(const void* host, size_t bytes);
// Refuses a wait for the device (a download, a synchronisation) while this thread records a
// step's graph, naming `what`: the capture would be lost with a CUDA error that says less.
void refuse_wait_in_graph(const char* what);

// The int8 tier's linear (ops/op_list.h: w of int8 products): x's rows as codes, an exact
// integer GEMM, the scales and bias as the contract's fp32 steps, every output the reference's.
void linear_int8(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);
// The fp8 tier's linear (w of fp8 products): x's rows as float8_e4m3fn codes, cuBLASLt's fp8 GEMM
// into fp32 (exact products), the scales and bias as the contract's fp32 steps; refused, naming
// the need, on a GPU without fp8 tensor cores (before Ada).
void linear_fp8(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y);

// A weight stored as GGML blocks or as codes with scales (core/ggml_blocks.h, core/scaled_codes.h),
// its rows decoded to out's dtype (bf16 or f32) as the CPU decodes them: every row, or row ids[i]
// as out's row i (ids: i32 on the device, already checked against the weight's rows).
void decode_stored(const Tensor& w, const Tensor* ids, Tensor& out);

// conv2d through cuDNN (cudnn_conv.cu): whether it takes a conv (symmetric padding, bf16 or f32,
// the bias in x's dtype), and the conv itself, y [N, Co, OH, OW] already shaped.
bool cudnn_conv_takes(const Tensor& x, const Tensor* bias, int64_t pad, int64_t pad_end);
void conv2d_by_cudnn(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y, int64_t stride,
                     int64_t pad);

}  // namespace apus::cuda
