// The quantised tiers' linear on the GPU (ops/op_list.h, linear with a weight of int8 or fp8
// products): x's rows quantised to codes, one GEMM of codes on the tensor cores (int8: i8 x i8 ->
// i32 on the integer cores, exact sums, the CPU's integers; fp8: e4m3 x e4m3 -> fp32, exact
// products summed in fp32), then the scales and the bias by the contract's fp32 steps. The
// per-element steps are core/tier_rows.h's, shared with the CPU, so the codes are the reference's
// bit for bit (and int8's outputs too). Built with -fmad=false (CMakeLists.txt) like the other
// decoders of stored weights.
#include <cfloat>
#include <cstdio>
#include <mutex>

#include "core/scaled_codes.h"
#include "core/tier_rows.h"
#include "core/variants.h"
#include "ops/backend.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"

namespace apus::cuda {

Knob fp8_scales_knob("cuda.fp8_scales",
                     "where the fp8 tier's row scales and bias are applied: a kernel over the GEMM's fp32 sums "
                     "(the contract's steps, an fp32 round trip of the output), or cuBLASLt's epilogue "
                     "(outer-vector scales, the output written once; where the shape allows, else the kernel)",
                     {"kernel", "epilogue"});

namespace {

// A tier's codes: int8's, or float8_e4m3fn's bytes.
struct Int8Codes {
  using Code = int8_t;
  static constexpr float kLargest = 127.0f;
  __device__ static Code code(float x, float inv) { return int8_code(x, inv); }
};
struct Fp8Codes {
  using Code = uint8_t;
  static constexpr float kLargest = kFp8Max;
  __device__ static Code code(float x, float inv) { return fp8_e4m3_code(fp8_value(x, inv)); }
};

// One block a row: scale max |x| / largest code and codes (quantize_int8_row's or
// quantize_fp8_row's steps), zeros past k to the padded width; a row holding a NaN or an infinity
// gets the scale NaN (its outputs NaN) and zeros.
template <class Codes> __global__ void quantize_rows_kernel(const void* x, DType dt, int64_t stride, int64_t k,
                                                            int64_t width, typename Codes::Code* codes, float* scales) {
  const int64_t r = blockIdx.x;
  float amax = 0, nonfinite = 0;
  for (int64_t c = threadIdx.x; c < k; c += blockDim.x) {
    const float a = fabsf(load(dt, x, r * stride + c));
    amax = a > amax ? a : amax;
    nonfinite += a <= FLT_MAX ? 0.0f : 1.0f;
  }
  amax = block_reduce(amax, true);
  nonfinite = block_sum(nonfinite);
  typename Codes::Code* row = codes + r * width;
  const bool zeros = nonfinite > 0 || amax == 0;
  const float inv = zeros ? 0.0f : Codes::kLargest / amax;
  for (int64_t c = threadIdx.x; c < width; c += blockDim.x)
    row[c] = zeros || c >= k ? 0 : Codes::code(load(dt, x, r * stride + c), inv);
  if (threadIdx.x == 0) scales[r] = nonfinite > 0 ? __int_as_float(0x7fc00000) : amax / Codes::kLargest;
}

// The weight's scale of output j: code_scale x its row's factor (quantize_int8_weight's, or a
// checkpoint's scale a row), as the CPU's tiers form it.
struct RowScales {
  float code_scale;
  const void* factors;  // null: code_scale alone
  DType factor_dt;
  int64_t row0;
  bool tiled;
};

__device__ float weight_scale(const RowScales& s, int64_t j) {
  return s.factors ? s.code_scale * factor_value(s.factor_dt, s.factors, block_factor_index(s.row0 + j, 0, 1, s.tiled))
                   : s.code_scale;
}

// y[r, j] from the sums (i32 or fp32): NaN for a row whose scale is NaN, else scaled_sum's steps
// with the bias read in its dtype and rounded to x's (the CPU's round_to).
template <class Sum> __global__ void outputs_kernel(const Sum* acc, int64_t acc_ld, const float* x_scales, RowScales ws,
                                                    const void* bias, DType bias_dt, DType act, void* y, DType y_dt,
                                                    int64_t y_stride, int64_t m, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < m * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / n, j = i % n;
    const float s = x_scales[r];
    float v = __int_as_float(0x7fc00000);
    if (!isnan(s)) {
      const float b = bias ? round_to(act, load(bias_dt, bias, j)) : 0.0f;
      v = scaled_sum(float(acc[r * acc_ld + j]), s, weight_scale(ws, j), bias ? &b : nullptr);
    }
    store(y_dt, y, r * y_stride + j, v);
  }
}

// The weight's codes (a byte each) as the tensor cores take them: rows of `width` (a multiple of
// 16) bytes on a 16-byte boundary, `rows` of them (a multiple of 4, or of 16 for fp8), zeros in the
// padding; the weight itself where it already is so.
Tensor gemm_ready_codes(Context& c, const Tensor& w, int64_t rows, int64_t width) {
  const int64_t n = w.shape[0], k = w.shape[1];
  if (rows == n && width == k && reinterpret_cast<uintptr_t>(w.data) % 16 == 0) return w;
  Tensor out = Tensor::in(*c.arena, {rows, width}, w.dtype);
  check(cudaMemsetAsync(out.data, 0, out.nbytes(), stream()), "clear padded codes");
  check(cudaMemcpy2DAsync(out.data, size_t(width), w.data, size_t(k), size_t(k), size_t(n), cudaMemcpyDeviceToDevice,
                          stream()),
        "pad the weight's codes");
  return out;
}

// s[j] = weight_scale(ws, j): the weight's scales as the vector cuBLASLt's epilogue reads.
__global__ void weight_scales_kernel(RowScales ws, float* s, int64_t n) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x)
    s[j] = weight_scale(ws, j);
}

RowScales row_scales(const Tensor& w) {
  const BlockScales* s = w.encoding.block_scales.get();
  APUS_CHECK(!s || (s->per_row == 1 && s->factors.device == Device::cuda), "linear: a quantised tier's weight ",
             "scales must be one a row, in the device's memory");
  return {w.encoding.code_scale, s ? s->factors.data : nullptr, s ? s->factors.dtype : DType::f32,
          w.encoding.block_row0, s && s->tiled};
}

// x's rows as a tier's codes in the arena: `rows` rows (zeros past x's) of `width` (zeros past k),
// and x's row scales.
struct RowCodes {
  Tensor codes, scales;
};
template <class Codes>
RowCodes row_codes(Context& c, const Tensor& x, int64_t k, int64_t rows, int64_t width, DType codes_dt) {
  const int64_t m = x.shape[0];
  RowCodes r{Tensor::in(*c.arena, {rows, width}, codes_dt), Tensor::in(*c.arena, {m}, DType::f32)};
  if (rows > m)
    check(cudaMemsetAsync(r.codes.row(m), 0, size_t((rows - m) * width), stream()), "clear the padding rows' codes");
  quantize_rows_kernel<Codes><<<unsigned(m), kThreads, 0, stream()>>>(x.data, x.dtype, x.row_stride(), k, width,
                                                                      static_cast<typename Codes::Code*>(r.codes.data),
                                                                      r.scales.ptr<float>());
  check(cudaGetLastError(), "row quantisation launch");
  return r;
}

// y from a tier's GEMM sums (rows of `sums_ld`) by outputs_kernel.
template <class Sum> void write_outputs(const Sum* sums, int64_t sums_ld, const RowCodes& x_codes, const RowScales& ws,
                                        const Tensor* bias, DType act, Tensor& y) {
  const int64_t m = y.shape[0], n = y.shape[1];
  outputs_kernel<<<blocks_for(m * n), kThreads, 0, stream()>>>(
      sums, sums_ld, x_codes.scales.ptr<float>(), ws, bias ? bias->data : nullptr, bias ? bias->dtype : DType::f32, act,
      y.data, y.dtype, y.row_stride(), m, n);
  check(cudaGetLastError(), "tier outputs launch");
}

}  // namespace

void linear_int8(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  APUS_CHECK(w.dtype == DType::i8 && w.contiguous() && k <= kInt8MaxDot && (!bias || bias->numel() == n),
             "linear: an int8 tier weight must be contiguous i8 with rows of at most ", kInt8MaxDot, ", got ",
             dtype_name(w.dtype), " ", shape_str(w.shape));
  const RowScales ws = row_scales(w);
  if (m == 0) return;
  ArenaScope scope(*c.arena);
  const int64_t width = round_up(k, 16), rows = round_up(n, 4);
  const RowCodes x_codes = row_codes<Int8Codes>(c, x, k, m, width, DType::i8);
  const Tensor wc = gemm_ready_codes(c, w, rows, width);
  Tensor acc = Tensor::in(*c.arena, {m, rows}, DType::i32);
  gemm({x_codes.codes.data, DType::i8, width}, {wc.data, DType::i8, width}, true, {acc.data, DType::i32, rows}, m, rows,
       width, 1, 1.0f);
  write_outputs(acc.ptr<int32_t>(), rows, x_codes, ws, bias, x.dtype, y);
}

namespace {

// The epilogue's route: x's codes (rows of k) times the weight's straight into y, each output
// times its row's and its column's scale plus the bias (in y's dtype) in cuBLASLt's epilogue. Only
// where cuBLASLt's fp8 kernels take the shapes as they are (k and n multiples of 16, y's rows on
// 16-byte boundaries); false where they do not or cuBLASLt has no algorithm, nothing written.
bool linear_fp8_in_epilogue(Context& c, const RowCodes& x_codes, const Tensor& w, const RowScales& ws,
                            const Tensor* bias, Tensor& y) {
  const int64_t m = y.shape[0], k = w.shape[1], n = w.shape[0];
  const size_t row_bytes = size_t(y.row_stride()) * dtype_size(y.dtype);
  if (k % 16 || n % 16 || row_bytes % 16 || reinterpret_cast<uintptr_t>(y.data) % 16 ||
      reinterpret_cast<uintptr_t>(w.data) % 16 || (bias && bias->dtype != y.dtype))
    return false;
  Tensor w_scales = Tensor::in(*c.arena, {n}, DType::f32);
  weight_scales_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(ws, w_scales.ptr<float>(), n);
  check(cudaGetLastError(), "fp8 weight scales launch");
  return scaled_fp8_gemm({x_codes.codes.data, DType::fp8_e4m3, k}, {w.data, DType::fp8_e4m3, k},
                         {x_codes.scales.ptr<float>(), w_scales.ptr<float>()}, {y.data, y.dtype, y.row_stride()}, m, n,
                         k, bias ? bias->data : nullptr);
}

}  // namespace

void linear_fp8(Context& c, const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& y) {
  const int64_t m = x.shape[0], k = w.shape[1], n = w.shape[0];
  APUS_CHECK(w.dtype == DType::fp8_e4m3 && w.contiguous() && (!bias || bias->numel() == n),
             "linear: an fp8 tier weight must be contiguous float8_e4m3fn, got ", dtype_name(w.dtype), " ",
             shape_str(w.shape));
  const std::string refusal = c.backend->refuses(Products::fp8);
  APUS_CHECK(refusal.empty(), refusal);
  const RowScales ws = row_scales(w);
  if (m == 0) return;
  ArenaScope scope(*c.arena);
  // cuBLASLt's fp8 kernels take both operands K-major with M, N and K multiples of 16; the
  // epilogue's route reads the same codes (k a multiple of 16 there), its M unpadded.
  const int64_t width = round_up(k, 16), rows = round_up(n, 16), m16 = round_up(m, 16);
  const RowCodes x_codes = row_codes<Fp8Codes>(c, x, k, m16, width, DType::fp8_e4m3);
  if (fp8_scales_knob.value() == 1) {
    if (linear_fp8_in_epilogue(c, x_codes, w, ws, bias, y)) {
      fp8_scales_knob.took(1);
      return;
    }
    static std::once_flag told;
    std::call_once(told, [&] {
      std::fprintf(stderr,
                   "apus: cuda.fp8_scales=epilogue: cuBLASLt's epilogue does not take a %lldx%lldx%lld "
                   "product into %s%s; such linears take the kernel\n",
                   (long long)m, (long long)n, (long long)k, dtype_name(y.dtype), bias ? " with a bias" : "");
    });
  }
  fp8_scales_knob.took(0);
  const Tensor wc = gemm_ready_codes(c, w, rows, width);
  Tensor sums = Tensor::in(*c.arena, {m16, rows}, DType::f32);
  gemm({x_codes.codes.data, DType::fp8_e4m3, width}, {wc.data, DType::fp8_e4m3, width}, true,
       {sums.data, DType::f32, rows}, m16, rows, width, 1, 1.0f);
  write_outputs(sums.ptr<float>(), rows, x_codes, ws, bias, x.dtype, y);
}

}  // namespace apus::cuda
