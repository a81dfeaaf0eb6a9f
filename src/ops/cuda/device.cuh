#pragma once
// Device-side helpers the CUDA kernels share: typed loads and stores, the reference's roundings,
// block-wide reductions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/dtype.h"

namespace apus::cuda {

__device__ inline float load(DType dt, const void* p, int64_t i) {
  switch (dt) {
    case DType::bf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ inline void store(DType dt, void* p, int64_t i, float v) {
  if (dt == DType::bf16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else static_cast<float*>(p)[i] = v;
}

// Factor i of a stored weight's block scales (core/scaled_codes.h): f32, bf16, f16 (int8 row
// scales), e8m0 (mxfp8's) or fp8 e4m3 (nvfp4's).
__device__ inline float factor_value(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::bf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::e8m0:
      return e8m0_to_f32(static_cast<const uint8_t*>(p)[i]);
    default:  // fp8_e4m3
      return fp8_e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);
  }
}

// x rounded to dt and back (a store and a load in the reference's eager ops).
__device__ inline float round_to(DType dt, float x) {
  return dt == DType::bf16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

// A block-wide sum or maximum (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ inline float block_reduce(float v, bool is_max) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    float s = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : (is_max ? -INFINITY : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
      const float w = __shfl_xor_sync(0xffffffffu, s, o);
      s = is_max ? fmaxf(s, w) : s + w;
    }
    if (threadIdx.x == 0) partial[0] = s;
  }
  __syncthreads();
  const float r = partial[0];
  __syncthreads();
  return r;
}

__device__ inline float block_sum(float v) { return block_reduce(v, false); }

// v rounded up to a multiple of `to` (padded widths for the tensor cores).
inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

constexpr int kThreads = 256;

// Blocks of kThreads for n work items (a grid-stride loop covers the rest past 65535 blocks).
inline unsigned blocks_for(int64_t n) {
  return unsigned(n <= 0 ? 1 : (n + kThreads - 1) / kThreads < 65535 ? (n + kThreads - 1) / kThreads : 65535);
}

// f(i) for every i < n (Index: int64_t, or uint32_t where n fits).
template <typename Index, typename F> __global__ void for_each_index(Index n, F f) {
  for (Index i = blockIdx.x * Index(blockDim.x) + threadIdx.x; i < n; i += Index(gridDim.x) * blockDim.x) f(i);
}

}  // namespace apus::cuda
