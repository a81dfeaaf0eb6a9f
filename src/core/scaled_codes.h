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

// Where factor j of row r lies among a weight's factors, per_row a row. Tiled: comfy-kitchen's
// to_blocked, 128x4 tiles in row-major tile order, each tile's rows r = 32a + b stored as [b][a][j].
APUS_HD inline int64_t block_factor_index(int64_t r, int64_t j, int64_t per_row, bool tiled) {
  if (!tiled) return r * per_row + j;
  const int64_t col_tiles = (per_row + 3) / 4;
  return ((r / 128) * col_tiles + j / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4;
}

// fp4 code c of a packed row: the high nibble is the even element (comfy-kitchen's hi_first).
APUS_HD inline uint8_t fp4_code(const uint8_t* row, int64_t c) {
  return (c & 1) ? row[c >> 1] & 0xf : row[c >> 1] >> 4;
}

// Code c of a row of a code format as fp32, unscaled: what the GPU decodes element by element (the
// host decodes rows through tables of the same values).
APUS_HD inline float code_value(DType t, const uint8_t* row, int64_t c) {
  switch (t) {
    case DType::fp8_e4m3:
      return fp8_e4m3_to_f32(row[c]);
    case DType::fp8_e5m2:
      return fp8_e5m2_to_f32(row[c]);
    case DType::i8:
      return float(int8_t(row[c]));
    default:  // fp4_e2m1
      return fp4_e2m1_to_f32(fp4_code(row, c));
  }
}

// Row r (counted in t; its block_row0 added) of a code-format tensor, its first n values as fp32.
void decode_code_row(const Tensor& t, int64_t r, float* out, int64_t n);
// Element (r, c) alone: for the reference backend and element access, not hot loops.
float decode_code_element(const Tensor& t, int64_t r, int64_t c);

}  // namespace apus
