#pragma once
// Row conversion between stored dtypes and the fp32 the CPU kernels compute in.
#include <cstdint>

#include "core/error.h"
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
    case DType::bf16: bf16_to_f32_row(static_cast<const uint16_t*>(p), out, n); return;
    default: fail("load_row: unsupported dtype ", dtype_name(t.dtype));
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
    case DType::bf16: f32_to_bf16_row(in, static_cast<uint16_t*>(p), n); return;
    default: fail("store_row: unsupported dtype ", dtype_name(t.dtype));
  }
}

// Rounds in place as a store to `dt` and a load back would.
inline void round_to(DType dt, float* v, int64_t n) {
  if (dt == DType::bf16)
    for (int64_t i = 0; i < n; ++i) v[i] = round_bf16(v[i]);
}

// A whole (small) vector as fp32, for modulation, gates and norm weights.
inline void load_vec(const Tensor& t, float* out) {
  Tensor flat = t;
  flat.shape = {1, t.numel()};
  flat.stride0 = 0;
  load_row(flat, 0, out, t.numel());
}

inline int64_t rows_of(const Tensor& t) { return t.rank() == 2 ? t.shape[0] : t.numel() / t.shape.back(); }

}  // namespace apus::cpu

namespace apus::cpu {
// Returns t in dtype `dt`, converting into the arena when it differs (parity mode widens
// bf16 weights one layer at a time instead of holding an fp32 copy of the model).
Tensor as_dtype(Arena& arena, const Tensor& t, DType dt);
}  // namespace apus::cpu
