// Weights stored as GGUF's blocks or as codes with scales (fp8, int8 and nvfp4 checkpoints) on the
// GPU: held as stored and decoded where an op reads them, by the decoders the CPU uses
// (core/ggml_blocks.h, core/scaled_codes.h), so both backends multiply by the same numbers.
// Built with -fmad=false (CMakeLists.txt): gguf-py's d * q + m is two roundings, not one.
#include "core/ggml_blocks.h"
#include "core/scaled_codes.h"
#include "core/variants.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"

namespace apus::cuda {

Knob stored_decode_knob("cuda.stored_decode",
                        "GGML blocks decoded on the GPU by one thread a block writing straight to memory, or "
                        "staged: decoded into shared memory, then written out by the whole thread block in order",
                        {"direct", "staged"});

namespace {

// Row i of the decoded result is the weight's row ids[i] (ids null: row i).
__device__ int64_t stored_row(const int32_t* ids, int64_t i) { return ids ? ids[i] : i; }

// One thread a block: GGML's blocks are decoded whole (their scales are shared by the block).
template <DType T> __global__ void decode_blocks_kernel(const uint8_t* w, size_t row_bytes, size_t block_bytes,
                                                        int64_t per_block, int64_t blocks_per_row, const int32_t* ids,
                                                        int64_t blocks, void* out, DType dt, int64_t cols) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < blocks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / blocks_per_row, j = i % blocks_per_row;
    const uint8_t* b = w + size_t(stored_row(ids, r)) * row_bytes + size_t(j) * block_bytes;
    const int64_t first = r * cols + j * per_block;
    ggml::decode_block<T>(b, [=](int e, float v) { store(dt, out, first + e, v); });
  }
}

// Elements of shared memory the staged kernel takes a thread block: its threads' blocks, each row
// one float longer than a block (so the threads' rows start in different banks).
constexpr int kStagedFloats = 8448;

// Staged: each thread decodes its block into its row of shared memory, then the thread block
// writes its blocks' elements, which are consecutive in the output, in order (coalesced stores
// where the direct kernel's threads each write their own 64 or 512 bytes).
template <DType T> __global__ void decode_blocks_staged_kernel(const uint8_t* w, size_t row_bytes, size_t block_bytes,
                                                               int per_block, int64_t blocks_per_row,
                                                               const int32_t* ids, int64_t blocks, void* out,
                                                               DType dt) {
  __shared__ float staged[kStagedFloats];
  const int pitch = per_block + 1;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x, i = first + threadIdx.x;
  if (i < blocks) {
    const int64_t r = i / blocks_per_row, j = i % blocks_per_row;
    const uint8_t* b = w + size_t(stored_row(ids, r)) * row_bytes + size_t(j) * block_bytes;
    float* mine = staged + threadIdx.x * pitch;
    ggml::decode_block<T>(b, [=](int e, float v) { mine[e] = v; });
  }
  __syncthreads();
  const int64_t count = (min(blocks, first + int64_t(blockDim.x)) - first) * per_block;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x)
    store(dt, out, first * per_block + e, staged[(e / per_block) * pitch + e % per_block]);
}

// A code-format weight as its kernel reads it: the codes, and their scale per tensor or the
// factors per block (core/scaled_codes.h) in the device's memory.
struct Codes {
  const uint8_t* data;
  DType dt;
  size_t row_bytes;
  float code_scale;
  const void* factors;  // null: code_scale alone
  DType factor_dt;
  int64_t block, per_row, row0;
  bool tiled;
};

// One thread an element: code x (code_scale x factor), the bracket first, as decode_code_row.
__global__ void decode_codes_kernel(Codes w, const int32_t* ids, int64_t rows, int64_t cols, void* out, DType dt) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = stored_row(ids, i / cols), c = i % cols;
    const float code = code_value(w.dt, w.data + size_t(r) * w.row_bytes, c);
    const float scale =
        w.factors ? w.code_scale * factor_value(w.factor_dt, w.factors,
                                                block_factor_index(w.row0 + r, c / w.block, w.per_row, w.tiled))
                  : w.code_scale;
    store(dt, out, i, code * scale);
  }
}

}  // namespace

void decode_stored(const Tensor& w, const Tensor* ids, Tensor& out) {
  const int64_t cols = w.shape.back(), rows = ids ? ids->numel() : w.numel() / cols;
  APUS_CHECK(is_stored_quantized(w.dtype) && w.contiguous() && w.device == Device::cuda && out.contiguous() &&
                 out.numel() == rows * cols && (out.dtype == DType::bf16 || out.dtype == DType::f32) &&
                 (!ids || ids->dtype == DType::i32),
             "decode_stored: a ", dtype_name(w.dtype), " ", shape_str(w.shape), " weight into a ",
             dtype_name(out.dtype), " ", shape_str(out.shape));
  if (rows * cols == 0) return;
  const int32_t* row_ids = ids ? ids->ptr<int32_t>() : nullptr;
  const auto* data = w.ptr<uint8_t>();
  const size_t row_bytes = dtype_bytes(w.dtype, cols);
  const bool staged = stored_decode_knob.value() == 1;
  const bool blocks = ggml::with_block_format(w.dtype, [&](auto format) {
    constexpr DType t = decltype(format)::dtype;
    const int64_t per = dtype_block(t), count = rows * (cols / per);
    if (staged) {
      // As many threads as blocks whose padded rows fit the shared array: 256 of 32, 32 of 256.
      const int threads = int(kStagedFloats / (per + 1)) / 32 * 32;
      decode_blocks_staged_kernel<t><<<unsigned((count + threads - 1) / threads), unsigned(threads), 0, stream()>>>(
          data, row_bytes, dtype_block_bytes(t), int(per), cols / per, row_ids, count, out.data, out.dtype);
    } else {
      decode_blocks_kernel<t><<<blocks_for(count), kThreads, 0, stream()>>>(
          data, row_bytes, dtype_block_bytes(t), per, cols / per, row_ids, count, out.data, out.dtype, cols);
    }
  });
  if (blocks) {
    stored_decode_knob.took(staged ? 1 : 0);
  } else {
    const WeightEncoding& e = w.encoding;
    const BlockScales* s = e.block_scales.get();
    APUS_CHECK(!s || (s->factors.device == Device::cuda && s->block > 0), "decode_stored: a ", dtype_name(w.dtype),
               " weight's block scales are not in the device's memory");
    const Codes codes{data,
                      w.dtype,
                      row_bytes,
                      e.code_scale,
                      s ? s->factors.data : nullptr,
                      s ? s->factors.dtype : DType::f32,
                      s ? s->block : 1,
                      s ? s->per_row : 0,
                      e.block_row0,
                      s && s->tiled};
    decode_codes_kernel<<<blocks_for(rows * cols), kThreads, 0, stream()>>>(codes, row_ids, rows, cols, out.data,
                                                                            out.dtype);
  }
  check(cudaGetLastError(), "stored weight decode launch");
}

}  // namespace apus::cuda
