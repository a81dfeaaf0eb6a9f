#pragma once
// The flash attention kernel (flash_attention.cu): what it takes and its launch.
#include <cstdint>

#include "core/dtype.h"

namespace apus::cuda {

// One attention term: bf16 rows of q [batch * sq, hq * d], k and v [batch * sk, hk * d] (row
// strides in elements, each a multiple of 8, data 16-byte aligned), o likewise.
struct FlashParams {
  const void *q, *k, *v;
  void* o;
  int64_t q_stride, k_stride, v_stride, o_stride;
  int64_t batch, sq, sk, hq, hk, d;
  float scale;
  bool causal;
  const int64_t* key_valid;  // [batch * sk] in device memory, or null
};

// Whether the kernel computes a term of this head width and dtype; `plain`: no band, softcap or
// step rounding.
bool flash_takes(int64_t head_dim, DType dt, bool plain);
void flash_attention(const FlashParams& p);

}  // namespace apus::cuda
