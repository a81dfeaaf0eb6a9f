#pragma once
// Weights stored as codes with scales, as fp8, int8 and fp4 checkpoints hold them (BFL's fp8
// files, ComfyUI's quantised layouts): element (r, c) is
//     code(r, c) × (code_scale × factor(r, c / block))
// with the bracket computed first, in fp32, as comfy-kitchen's dequantisation computes it (nvfp4's
// per_tensor_scale × block_scale, then the codes), and code × code_scale without block factors
// (per-tensor fp8 and int8). One multiply per element either way, so fp32 decodes equal
// comfy-kitchen's fp32 dequantisation bit for bit.
#include <cstdint>

#include "core/tensor.h"

namespace apus {

// fp8_e4m3, fp8_e5m2, i8, fp4_e2m1: the dtypes whose elements are codes Tensor's scales apply to.
bool is_code_format(DType t);
// A stored weight the linears expand panel by panel (GGML blocks and the code formats).
inline bool is_stored_quantized(DType t) { return is_block_quantized(t) || is_code_format(t); }

// Per-block factors of a weight, one per `block` elements along a row: [rows, cols / block] row
// major, or in cuBLAS's 128x4 tiles when `tiled` (how ComfyUI stores mxfp8's and nvfp4's scales:
// comfy-kitchen's to_blocked).
struct BlockScales {
  Tensor factors;  // f32, bf16, f16 (int8 row scales), e8m0 (mxfp8), fp8_e4m3 (nvfp4)
  int64_t block = 0;
  int64_t per_row = 0;  // factors per row: cols / block
  bool tiled = false;
  float at(int64_t r, int64_t j) const;
};

// Row r (counted in t; its block_row0 added) of a code-format tensor, its first n values as fp32.
void decode_code_row(const Tensor& t, int64_t r, float* out, int64_t n);
// Element (r, c) alone: for the reference backend and element access, not hot loops.
float decode_code_element(const Tensor& t, int64_t r, int64_t c);

}  // namespace apus
