// Attention without materialised scores (knob cuda.attention=flash): one block of four warps per
// 64 query rows of one head, keys and values streamed through shared memory 64 at a time, the
// scores and P·V on bf16 tensor cores (WMMA 16x16x16, fp32 accumulation), the softmax online
// (running maximum and sum in fp32, the output rescaled as the maximum grows). Contract numerics
// otherwise: scores scaled in fp32, probabilities rounded to bf16 before P·V (here before the
// division by the row's sum, which the end applies in fp32), the output rounded once; a NaN score
// or an infinite maximum makes the row NaN, a row that sees no key is zero. bf16 heads of 64 or
// 128 without softcap, band or step rounding; the caller sends the rest to the other kernels.
// Written without a GPU at hand (session 21): the op table's target cuda_bf16_flash proves it on
// the next device before it becomes the default.
#include <mma.h>

#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"
#include "ops/cuda/flash_attention.h"

namespace apus::cuda {

namespace {

using namespace nvcuda;

constexpr int kRows = 64, kKeys = 64, kWarps = 4;

template <int D> struct Shared {
  __nv_bfloat16 q[kRows][D], k[kKeys][D], v[kKeys][D];
  float s[kWarps][16][kKeys];          // a warp's scores for the tile
  __nv_bfloat16 p[kWarps][16][kKeys];  // its probabilities, unnormalised
  float o[kWarps][16][D];              // its output rows so far
};

// Rows [row0, row0 + 64) of a [rows, cols] bf16 matrix (row stride `stride`, from column `col`)
// into shared memory, 16 bytes a thread at a time; rows past `rows` are zeros.
template <int D> __device__ void load_tile(__nv_bfloat16 (*dst)[D], const __nv_bfloat16* src, int64_t stride,
                                           int64_t row0, int64_t rows) {
  constexpr int kChunks = D / 8;  // 8 bf16 per 16 bytes
  for (int i = threadIdx.x; i < kRows * kChunks; i += blockDim.x) {
    const int r = i / kChunks, c = i % kChunks * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows) value = *reinterpret_cast<const uint4*>(src + (row0 + r) * stride + c);
    *reinterpret_cast<uint4*>(&dst[r][c]) = value;
  }
}

template <int D> __global__ void flash_kernel(FlashParams p) {
  extern __shared__ __align__(128) unsigned char raw[];
  Shared<D>& sh = *reinterpret_cast<Shared<D>*>(raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t q0 = int64_t(blockIdx.x) * kRows, h = blockIdx.y, b = blockIdx.z, g = h / (p.hq / p.hk);
  const auto* q = static_cast<const __nv_bfloat16*>(p.q) + b * p.sq * p.q_stride + h * D;
  const auto* k = static_cast<const __nv_bfloat16*>(p.k) + b * p.sk * p.k_stride + g * D;
  const auto* v = static_cast<const __nv_bfloat16*>(p.v) + b * p.sk * p.v_stride + g * D;
  const int64_t* valid = p.key_valid ? p.key_valid + b * p.sk : nullptr;
  load_tile<D>(sh.q, q, p.q_stride, q0, p.sq);
  for (int i = lane; i < 16 * D; i += 32) sh.o[warp][i / D][i % D] = 0.0f;
  // Each row of the warp's 16 is held by two lanes, each with half of the tile's keys (and half of
  // the row's output columns).
  const int r = lane / 2, half = lane % 2;
  const int64_t row = q0 + warp * 16 + r;
  float m = -INFINITY, l = 0.0f;
  bool poisoned = false;
  const int64_t key_end = p.causal ? min(p.sk, q0 + kRows) : p.sk;
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeys) {
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile<D>(sh.k, k, p.k_stride, k0, p.sk);
    load_tile<D>(sh.v, v, p.v_stride, k0, p.sk);
    __syncthreads();
    // S = Q K^T for the warp's 16 rows and the tile's 64 keys.
    for (int nt = 0; nt < kKeys / 16; ++nt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
      for (int kk = 0; kk < D / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> bt;
        wmma::load_matrix_sync(a, &sh.q[warp * 16][kk * 16], D);
        wmma::load_matrix_sync(bt, &sh.k[nt * 16][kk * 16], D);
        wmma::mma_sync(acc, a, bt, acc);
      }
      wmma::store_matrix_sync(&sh.s[warp][0][nt * 16], acc, kKeys, wmma::mem_row_major);
    }
    __syncwarp();
    // The online softmax of row r over this tile, half of its keys on each of the two lanes.
    float s[kKeys / 2], tile_max = -INFINITY;
    for (int j = 0; j < kKeys / 2; ++j) {
      const int64_t key = k0 + half * (kKeys / 2) + j;
      const bool seen = key < p.sk && (!valid || valid[key]) && (!p.causal || key <= row);
      s[j] = seen ? sh.s[warp][r][half * (kKeys / 2) + j] * p.scale : -INFINITY;
      poisoned = poisoned || isnan(s[j]) || s[j] == INFINITY;
      tile_max = fmaxf(tile_max, s[j]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
    for (int j = 0; j < kKeys / 2; ++j) {
      const float e = m_new == -INFINITY ? 0.0f : expf(s[j] - m_new);
      sum += e;
      sh.p[warp][r][half * (kKeys / 2) + j] = __float2bfloat16_rn(e);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c) sh.o[warp][r][c] *= alpha;
    __syncwarp();
    // O += P V for the warp's rows.
    for (int dt = 0; dt < D / 16; ++dt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, &sh.o[warp][0][dt * 16], D, wmma::mem_row_major);
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> bv;
        wmma::load_matrix_sync(a, &sh.p[warp][0][kk * 16], kKeys);
        wmma::load_matrix_sync(bv, &sh.v[kk * 16][dt * 16], D);
        wmma::mma_sync(acc, a, bv, acc);
      }
      wmma::store_matrix_sync(&sh.o[warp][0][dt * 16], acc, D, wmma::mem_row_major);
    }
    __syncwarp();
  }
  poisoned = poisoned || __shfl_xor_sync(0xffffffffu, int(poisoned), 1);
  if (row >= p.sq) return;
  auto* o = static_cast<__nv_bfloat16*>(p.o) + (b * p.sq + row) * p.o_stride + h * D;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c)
    o[c] = __float2bfloat16_rn(poisoned ? NAN : sh.o[warp][r][c] * inv);
}

template <int D> void launch(const FlashParams& p) {
  const size_t shared = sizeof(Shared<D>);
  check(cudaFuncSetAttribute(flash_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)),
        "flash attention shared memory");
  const dim3 grid(unsigned((p.sq + kRows - 1) / kRows), unsigned(p.hq), unsigned(p.batch));
  flash_kernel<D><<<grid, kWarps * 32, shared, stream()>>>(p);
  check(cudaGetLastError(), "flash attention launch");
}

}  // namespace

bool flash_takes(int64_t head_dim, DType dt, bool plain) {
  return plain && dt == DType::bf16 && (head_dim == 64 || head_dim == 128);
}

void flash_attention(const FlashParams& p) {
  if (p.d == 64) return launch<64>(p);
  launch<128>(p);
}

}  // namespace apus::cuda
