#pragma once
// Row conversion between stored dtypes and the fp32 the CPU kernels compute in.
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "core/parallel.h"
#include "core/quant_blocks.h"
#include "core/scaled_codes.h"
#include "core/tensor.h"
#include "ops/cpu/vec.h"

namespace apus::cpu {

inline void load_row(const Tensor& t, int64_t r, float* out, int64_t n) {
  const void* p = t.row(r);
  switch (t.dtype) {
    case DType::f32: {
      const float* s = static_cast<const float*>(p);
      for (int64_t i = 0; i < n; ++i) out[i] = s[i];
      return;
    }
    case DType::bf16:
      bf16_to_f32_row(static_cast<const uint16_t*>(p), out, n);
      return;
    case DType::f16:
      f16_to_f32_row(static_cast<const uint16_t*>(p), out, n);
      return;
    default:
      if (is_code_format(t.dtype)) {
        decode_code_row(t, r, out, n);
        return;
      }
      APUS_CHECK(is_block_quantized(t.dtype), "load_row: unsupported dtype ", dtype_name(t.dtype));
      dequantize_row(t.dtype, p, out, n);
  }
}

inline void store_row(Tensor& t, int64_t r, const float* in, int64_t n) {
  void* p = t.row(r);
  switch (t.dtype) {
    case DType::f32: {
      float* d = static_cast<float*>(p);
      for (int64_t i = 0; i < n; ++i) d[i] = in[i];
      return;
    }
    case DType::bf16:
      f32_to_bf16_row(in, static_cast<uint16_t*>(p), n);
      return;
    default:
      fail("store_row: unsupported dtype ", dtype_name(t.dtype));
  }
}

// Rounds in place as a store to `dt` and a load back would: round_bf16 without its NaN branch (a
// select), so the loop vectorises; every each_step rounding of every op runs through it.
inline void round_to(DType dt, float* v, int64_t n) {
  if (dt == DType::bf16) round_bf16_row(v, n);
}

// A small vector (norm weights, modulation, gates) as one [1, n] row; a one-row column view counts.
inline Tensor vector_row(const Tensor& t) {
  APUS_CHECK(t.contiguous() || (t.rank() == 2 && t.shape[0] == 1), "expected a vector, got a ", shape_str(t.shape),
             " view");
  Tensor v = t;
  v.shape = {1, t.numel()};
  v.stride0 = 0;
  return v;
}

// Per-sample vectors (modulation, gates) for `rows` rows of D features: [D] serves every row;
// [B, D] (rows of a tensor or a column view) gives sample b the rows b*rows/B .. (b+1)*rows/B.
// Returned as contiguous f32 [B, D] in the arena.
inline Tensor sample_vectors(Arena& arena, const Tensor& v, int64_t d, int64_t rows) {
  const int64_t b = v.rank() == 2 ? v.shape[0] : 1;
  APUS_CHECK(v.numel() == b * d && rows % b == 0, "per-sample vector ", shape_str(v.shape), " for ", rows, " rows of ",
             d);
  Tensor out = Tensor::in(arena, {b, d}, DType::f32);
  const Tensor src = b == 1 ? vector_row(v) : v;
  for (int64_t i = 0; i < b; ++i) load_row(src, i, out.ptr<float>() + i * d, d);
  return out;
}

// Any contiguous tensor as [rows, last dim], so row kernels spread over its rows.
inline Tensor as_rows(const Tensor& t) {
  return t.rank() == 2 ? t : t.reshape({t.numel() / t.shape.back(), t.shape.back()});
}
// An output viewed with the rows of its input: the same shape, or the same element count when
// both are contiguous.
inline Tensor same_rows(const Tensor& y, const Tensor& x_rows) {
  if (y.shape == x_rows.shape) return y;
  APUS_CHECK(y.numel() == x_rows.numel() && y.contiguous() && x_rows.contiguous(), "output ", shape_str(y.shape),
             " does not match input ", shape_str(x_rows.shape));
  return y.reshape(x_rows.shape);
}

}  // namespace apus::cpu

namespace apus::cpu {
// Returns t in dtype `dt`, converting into the arena when it differs (parity mode widens
// bf16 weights one layer at a time instead of holding an fp32 copy of the model).
Tensor as_dtype(Arena& arena, const Tensor& t, DType dt);
}  // namespace apus::cpu
