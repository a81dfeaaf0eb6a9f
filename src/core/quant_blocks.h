#pragma once
// GGML's block-quantised weight formats (the ones GGUF files of klein, Qwen3 and SA3 carry): each
// block of 32 or 256 consecutive elements of a row stores its own scale(s) and packed integers.
// A block-quantised Tensor's shape counts elements; its rows are whole blocks.
//
// Dequantisation is gguf-py's (gguf.quants), operation for operation in fp32 and without fused
// multiply-adds, so the values equal its reference bit for bit.
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace apus {

// GGML's id for a dtype a GGUF file may store (F32 0, F16 1, Q4_0 2, ..., BF16 30); false when
// the id names a format apus does not read.
bool dtype_from_ggml(uint32_t ggml_type, DType& out);
// The GGML name of a type id ("Q4_K"), or "type N" for one apus does not know.
const char* ggml_type_name(uint32_t ggml_type);

// n elements (a multiple of dtype_block(t)) of a block-quantised row at `src` as fp32.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// The first of `blocks` consecutive blocks of format t at `src` whose f16 scale (or min) is NaN or
// infinite, or -1 when every block's are finite: a block format's scales are what turn its codes
// into values, and a non-finite one makes every element of its block NaN or infinite.
int64_t first_nonfinite_scale(DType t, const void* src, int64_t blocks);
// Element i of the block-quantised row at `row` (its block expanded): element access for tests and
// the reference backend, not for hot loops.
float dequantize_element(DType t, const void* row, int64_t i);

}  // namespace apus
