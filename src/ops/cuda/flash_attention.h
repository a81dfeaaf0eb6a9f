#pragma once
// The flash attention kernel (flash_attention.cu): what it takes and its launch.
#include <cstdint>

#include "core/dtype.h"

namespace apus::cuda {

// Attention of bf16 rows, one term or the differential form's two (o = term 1 - term 2, each
// rounded first): q [batch * sq, hq * d], k and v [batch * sk, hk * d] (row strides in elements,
// each a multiple of 8, data 16-byte aligned), o like q.
struct FlashParams {
  const void *q[2], *k[2], *v;
  void* o;
  int64_t q_stride[2], k_stride[2], v_stride, o_stride;
  int terms;
  int64_t batch, sq, sk, hq, hk, d;
  int64_t window;  // keys within this distance of the row (sq == sk), or 0: every key
  float scale;
  bool causal;
  const int64_t* key_valid;  // [batch * sk] in device memory, or null
};

// Whether the kernel computes attention of this head width and dtype; `plain`: no softcap or
// step rounding.
bool flash_takes(int64_t head_dim, DType dt, bool plain);
void flash_attention(const FlashParams& p);

}  // namespace apus::cuda
