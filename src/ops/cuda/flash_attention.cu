// Attention without materialised scores (knob cuda.attention=flash), with the contract's numerics
// exactly: a first pass over the keys finds each row's maximum score and the sum of its
// exponentials (fp32, the sum rescaled as the maximum grows), a second pass computes the scores
// again, rounds each probability exp(s - max) / sum to bf16 as the reference does, and sums P·V in
// fp32. Two passes cost a third more tensor-core work than a one-pass online softmax, whose
// probabilities would be rounded before normalisation (another rounding than the contract's, in
// half of the outputs); the scores never reach memory either way, which is what the products
// path pays for (session 22: the first one-pass kernel, WMMA through shared memory, ran 3.7x
// slower than the products on klein and rounded off the contract).
//
// A block of four warps takes 64 query rows of one head; each warp 16 rows, held in registers as
// mma.sync m16n8k16 fragments (bf16 in, fp32 accumulators). Keys and values stream through shared
// memory 64 at a time, two tiles in flight (cp.async: the next tile loads while this one is
// computed; rows padded by 8 elements, so the fragment loads hit 32 distinct banks); the
// probabilities go from the score accumulators straight into P·V's A fragments, and V's B
// fragments come from ldmatrix.trans. Causal, band and padding masks skip whole key tiles where
// they can, tiles every row sees entirely take no per-key test, and the rest is masked per key
// from a 64-bit mask of the tile's keys; the differential form runs both terms in one block,
// each rounded before the difference. A NaN score or an infinite maximum makes the row NaN; a row
// that sees no key is zero.
#include "core/variants.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/device.cuh"
#include "ops/cuda/flash_attention.h"

namespace apus::cuda {

Knob flash_code_knob("cuda.flash_code",
                     "the flash kernel's element code: masks and live rows by branches, K's fragments by 32-bit "
                     "shared loads (proven on the H200, session 22), or by selects and ldmatrix (prepared without "
                     "a device)",
                     {"branches", "lean"});

namespace {

enum FlashCode { kBranches, kLean };

constexpr int kRows = 64, kKeys = 64, kWarps = 4, kStages = 2;

template <int D> struct Tiles {
  static constexpr int kPitch = D + 8;  // elements per shared row: 16 bytes of padding
  __nv_bfloat16 q[kRows][kPitch], k[kStages][kKeys][kPitch], v[kStages][kKeys][kPitch];
  int64_t valid[kStages][kKeys];  // the key mask's entries for each tile in flight
};

// d += a b for one m16n8k16 tile: a the 16x16 row-major fragment, b the 16x8 column fragment.
// Not volatile: the compiler may interleave independent products (a volatile asm keeps program
// order, which left each accumulator's chain of dependent products waiting on the last).
__device__ inline void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory: lane t names row t % 8 of matrix t / 8 and receives
// row t / 4, columns 2 (t % 4) and the next, of each.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const auto at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}

// The same, transposed: lane t receives rows 2 (t % 4) and the next, column t / 4.
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const auto at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}

// An asynchronous copy of `bytes` (16 or 8) from global to shared memory; zeros where !present
// (nothing is read then).
template <int Bytes> __device__ inline void copy_async(void* dst, const void* src, bool present) {
  const auto at = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src), "r"(present ? 16 : 0));
  else asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(at), "l"(src), "r"(present ? 8 : 0));
}
__device__ inline void commit_copies() { asm volatile("cp.async.commit_group;\n"); }
// Waits until at most N committed groups of copies are still in flight.
template <int N> __device__ inline void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ inline uint32_t pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ inline uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Rows [row0, row0 + 64) of a bf16 matrix (row stride `stride`) into shared memory, asynchronously;
// rows past `rows` are zeros.
template <int D> __device__ void copy_tile(__nv_bfloat16 (*dst)[D + 8], const __nv_bfloat16* src, int64_t stride,
                                           int64_t row0, int64_t rows) {
  constexpr int kChunks = D / 8;  // 16 bytes each
  for (int i = threadIdx.x; i < kRows * kChunks; i += blockDim.x) {
    const int r = i / kChunks, c = i % kChunks * 8;
    const bool present = row0 + r < rows;
    copy_async<16>(&dst[r][c], present ? src + (row0 + r) * stride + c : src, present);
  }
}

// What one thread of a warp holds: two query rows (lane / 4 and 8 below it in the warp's 16),
// for each 8-key slice of a tile two adjacent keys of each row.
struct Lane {
  int lane, group, col;  // col: the first of the thread's two columns in an 8-wide slice
  int64_t rows[2];
};

// Which keys of the tile from k0 each of a thread's rows sees.
struct TileMask {
  uint64_t keys;  // bit j: key k0 + j exists and is not padding
  bool open;      // every row of the block sees every key of the tile: no per-key test
  int rel[2];     // each row's index less k0, clamped (causal and band tests in 32 bits)
};

template <int D, bool Lean> struct Block {
  const FlashParams& p;
  Tiles<D>& sh;
  Lane t;
  int64_t b, h, g, q0, tile_lo, tile_hi;
  const int64_t* valid;

  // The next tile's keys (and values) into stage `stage`, asynchronously.
  __device__ void issue(int stage, const __nv_bfloat16* k, int64_t k_stride, const __nv_bfloat16* v, int64_t k0) {
    copy_tile<D>(sh.k[stage], k, k_stride, k0, p.sk);
    if (v) copy_tile<D>(sh.v[stage], v, p.v_stride, k0, p.sk);
    if (valid)
      for (int j = threadIdx.x; j < kKeys; j += blockDim.x)
        copy_async<8>(&sh.valid[stage][j], valid + min(k0 + j, p.sk - 1), k0 + j < p.sk);
    commit_copies();
  }

  __device__ TileMask mask(int stage, int64_t k0) const {
    TileMask m;
    m.keys = k0 + kKeys <= p.sk ? ~uint64_t(0) : (uint64_t(1) << (p.sk - k0)) - 1;
    if (valid) {
      const uint32_t lo = __ballot_sync(0xffffffffu, sh.valid[stage][t.lane] != 0);
      const uint32_t hi = __ballot_sync(0xffffffffu, sh.valid[stage][32 + t.lane] != 0);
      m.keys &= uint64_t(hi) << 32 | lo;
    }
    const int64_t last_row = q0 + kRows - 1, last_key = k0 + kKeys - 1;
    m.open = m.keys == ~uint64_t(0) && (!p.causal || last_key <= q0) &&
             (p.window <= 0 || (last_row - k0 <= p.window && last_key - q0 <= p.window));
    for (int r = 0; r < 2; ++r) m.rel[r] = int(max(min(t.rows[r] - k0, int64_t(1) << 24), -(int64_t(1) << 24)));
    return m;
  }

  // Bits 0..hi set (none for hi < 0, all from 63).
  __device__ static uint64_t upto(int hi) { return hi < 0 ? 0 : hi >= 63 ? ~uint64_t(0) : (uint64_t(2) << hi) - 1; }

  // The keys of the tile row r of the thread sees, as bits (the lean code's one test per key).
  __device__ uint64_t row_keys(const TileMask& m, int r) const {
    uint64_t bits = m.keys;
    if (p.causal) bits &= upto(m.rel[r]);
    if (p.window > 0) {
      const int w = int(min(p.window, int64_t(1) << 24));
      bits &= upto(m.rel[r] + w) & ~upto(m.rel[r] - w - 1);
    }
    return bits;
  }

  // Whether row r of the thread sees key j of the tile.
  __device__ bool sees(const TileMask& m, int r, int j) const {
    if (!((m.keys >> j) & 1) || (p.causal && j > m.rel[r])) return false;
    return p.window <= 0 || (j >= m.rel[r] - p.window && j <= m.rel[r] + p.window);
  }

  // S = Q K^T for the warp's 16 rows and the tile's 64 keys: [slice][c0 c1 c2 c3] as mma lays
  // them out (c0, c1: row rows[0], keys col and col + 1; c2, c3 the same keys of rows[1]).
  // Each step of the head width over all eight slices, so consecutive products are independent.
  __device__ void scores(const uint32_t (&qf)[D / 16][4], int stage, float (&s)[kKeys / 8][4]) const {
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if constexpr (Lean) {
        // Two slices' B fragments (8 keys x 16 of the width each) by one ldmatrix.
        const int key = (t.lane >> 4) * 8 + (t.lane & 7), at = kk * 16 + ((t.lane >> 3) & 1) * 8;
#pragma unroll
        for (int n = 0; n < kKeys / 8; n += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, &sh.k[stage][n * 8 + key][at]);
          mma(s[n], qf[kk], kb[0], kb[1]);
          mma(s[n + 1], qf[kk], kb[2], kb[3]);
        }
      } else {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          const __nv_bfloat16* krow = sh.k[stage][n * 8 + t.group] + kk * 16 + t.col;
          mma(s[n], qf[kk], pair(krow), pair(krow + 8));
        }
      }
    }
  }

  // The key tiles the block sees, two in flight: body(stage, k0, mask) for each once it is in
  // shared memory (its values too, with v), the stage refilled only after every warp is done.
  template <typename Body>
  __device__ void over_tiles(const __nv_bfloat16* k, int64_t k_stride, const __nv_bfloat16* v, Body&& body) {
    int stage = 0;
    if (tile_lo < tile_hi) issue(0, k, k_stride, v, tile_lo);
    for (int64_t k0 = tile_lo; k0 < tile_hi; k0 += kKeys, stage ^= 1) {
      if (k0 + kKeys < tile_hi) {
        issue(stage ^ 1, k, k_stride, v, k0 + kKeys);
        wait_copies<1>();
      } else {
        wait_copies<0>();
      }
      __syncthreads();
      body(stage, k0, mask(stage, k0));
      __syncthreads();
    }
  }

  // One term: the output rows, rounded to bf16 as floats, into out (NaN for a poisoned row).
  __device__ void term(int which, float (&out)[D / 8][4]) {
    const auto* q = static_cast<const __nv_bfloat16*>(p.q[which]) + b * p.sq * p.q_stride[which] + h * D;
    const auto* k = static_cast<const __nv_bfloat16*>(p.k[which]) + b * p.sk * p.k_stride[which] + g * D;
    const auto* v = static_cast<const __nv_bfloat16*>(p.v) + b * p.sk * p.v_stride + g * D;
    const int64_t k_stride = p.k_stride[which];
    const int warp = threadIdx.x / 32;
    copy_tile<D>(sh.q, q, p.q_stride[which], q0, p.sq);
    commit_copies();
    wait_copies<0>();
    __syncthreads();
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const __nv_bfloat16 *r0 = sh.q[warp * 16 + t.group] + kk * 16 + t.col, *r1 = r0 + 8 * Tiles<D>::kPitch;
      qf[kk][0] = pair(r0);
      qf[kk][1] = pair(r1);
      qf[kk][2] = pair(r0 + 8);
      qf[kk][3] = pair(r1 + 8);
    }
    // Pass 1: each row's maximum and sum of exponentials.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    bool nan[2] = {false, false};
    float s[kKeys / 8][4];
    over_tiles(k, k_stride, nullptr, [&](int stage, int64_t, const TileMask& mk) {
      scores(qf, stage, s);
      float tile_max[2] = {-INFINITY, -INFINITY};
      uint64_t seen[2] = {0, 0};  // the lean code's keys seen, from the thread's first column
      if constexpr (Lean)
        for (int r = 0; r < 2; ++r) seen[r] = row_keys(mk, r) >> t.col;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          const float scaled = s[n][e] * p.scale;
          const float x = Lean ? ((seen[r] >> (n * 8 + e % 2)) & 1 ? scaled : -INFINITY)
                               : (mk.open || sees(mk, r, n * 8 + t.col + e % 2) ? scaled : -INFINITY);
          s[n][e] = x;
          nan[r] = nan[r] || isnan(x);
          tile_max[r] = fmaxf(tile_max[r], x);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        for (int o = 1; o < 4; o <<= 1) tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], o));
        const float m_new = fmaxf(m[r], tile_max[r]);
        if (m_new == -INFINITY) continue;  // nothing seen yet
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) sum += expf(s[n][2 * r] - m_new) + expf(s[n][2 * r + 1] - m_new);
        l[r] = l[r] * expf(m[r] - m_new) + sum;
        m[r] = m_new;
      }
    });
    float inv[2];
    bool poisoned[2];
    for (int r = 0; r < 2; ++r) {
      for (int o = 1; o < 4; o <<= 1) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
        nan[r] = __shfl_xor_sync(0xffffffffu, int(nan[r]), o) || nan[r];
      }
      poisoned[r] = nan[r] || m[r] == INFINITY;
      inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    }
    // Rows whose probabilities pass 2 computes (not poisoned, some key seen), and the maximum
    // each subtracts (0 for the others, whose exponentials are selected away unread).
    bool live[2];
    float shift[2];
    for (int r = 0; r < 2; ++r) {
      live[r] = !poisoned[r] && m[r] != -INFINITY;
      shift[r] = live[r] ? m[r] : 0.0f;
    }
    // Pass 2: the probabilities rounded to bf16 as the reference rounds them, times V.
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    over_tiles(k, k_stride, v, [&](int stage, int64_t, const TileMask& mk) {
      scores(qf, stage, s);
      uint64_t seen[2] = {0, 0};
      if constexpr (Lean)
        for (int r = 0; r < 2; ++r) seen[r] = live[r] ? row_keys(mk, r) >> t.col : 0;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e / 2;
          if constexpr (Lean) {
            // Every exponential computed and the masked ones selected away: no branch per key.
            const float prob = expf(s[n][e] * p.scale - shift[r]) * inv[r];
            s[n][e] = (seen[r] >> (n * 8 + e % 2)) & 1 ? prob : 0.0f;
          } else {
            const bool seen = mk.open || sees(mk, r, n * 8 + t.col + e % 2);
            s[n][e] = seen && !poisoned[r] && m[r] != -INFINITY ? expf(s[n][e] * p.scale - m[r]) * inv[r] : 0.0f;
          }
        }
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        // The score accumulators of slices 2kk and 2kk+1 are P's A fragment for keys 16kk..16kk+15.
        const uint32_t a[4] = {pack(s[2 * kk][0], s[2 * kk][1]), pack(s[2 * kk][2], s[2 * kk][3]),
                               pack(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        const int key = kk * 16 + (t.lane & 7) + ((t.lane >> 3) & 1) * 8, half = (t.lane >> 4) * 8;
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, &sh.v[stage][key][dt * 16 + half]);
          mma(o[2 * dt], a, bv[0], bv[1]);
          mma(o[2 * dt + 1], a, bv[2], bv[3]);
        }
      }
    });
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) out[n][e] = poisoned[e / 2] ? NAN : __bfloat162float(__float2bfloat16_rn(o[n][e]));
  }
};

template <int D, int Terms, bool Lean> __global__ void __launch_bounds__(kWarps * 32, D == 64 ? 3 : 2)
    flash_kernel(FlashParams p) {
  extern __shared__ __align__(128) unsigned char raw[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  Block<D, Lean> blk{p, *reinterpret_cast<Tiles<D>*>(raw)};
  blk.t.lane = lane;
  blk.t.group = lane / 4;
  blk.t.col = lane % 4 * 2;
  blk.q0 = int64_t(blockIdx.x) * kRows;
  blk.t.rows[0] = blk.q0 + warp * 16 + blk.t.group;
  blk.t.rows[1] = blk.t.rows[0] + 8;
  blk.h = blockIdx.y;
  blk.b = blockIdx.z;
  blk.g = blk.h / (p.hq / p.hk);
  blk.valid = p.key_valid ? p.key_valid + blk.b * p.sk : nullptr;
  // The key tiles any row of the block may see.
  blk.tile_lo = p.window > 0 ? max(blk.q0 - p.window, int64_t(0)) / kKeys * kKeys : 0;
  blk.tile_hi = p.sk;
  if (p.causal) blk.tile_hi = min(blk.tile_hi, blk.q0 + kRows);
  if (p.window > 0) blk.tile_hi = min(blk.tile_hi, blk.q0 + kRows + p.window);
  float out[D / 8][4];
  blk.term(0, out);
  if (Terms > 1) {
    float second[D / 8][4];
    blk.term(1, second);
    for (int n = 0; n < D / 8; ++n)
      for (int e = 0; e < 4; ++e) out[n][e] -= second[n][e];
  }
  auto* o = static_cast<__nv_bfloat16*>(p.o) + blk.b * p.sq * p.o_stride + blk.h * D;
  for (int r = 0; r < 2; ++r) {
    if (blk.t.rows[r] >= p.sq) continue;
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<__nv_bfloat162*>(o + blk.t.rows[r] * p.o_stride + n * 8 + blk.t.col) =
          __floats2bfloat162_rn(out[n][2 * r], out[n][2 * r + 1]);
  }
}

template <int D, int Terms, bool Lean> void launch(const FlashParams& p) {
  const size_t shared = sizeof(Tiles<D>);
  static const bool opted = [&] {
    check(cudaFuncSetAttribute(flash_kernel<D, Terms, Lean>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared)),
          "flash attention shared memory");
    // All of the SM's L1 as shared memory: the default split may fit one block of 88 KiB per SM.
    check(cudaFuncSetAttribute(flash_kernel<D, Terms, Lean>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared)),
          "flash attention shared memory carveout");
    return true;
  }();
  (void)opted;
  const dim3 grid(unsigned((p.sq + kRows - 1) / kRows), unsigned(p.hq), unsigned(p.batch));
  flash_kernel<D, Terms, Lean><<<grid, kWarps * 32, shared, stream()>>>(p);
  check(cudaGetLastError(), "flash attention launch");
}

}  // namespace

bool flash_takes(int64_t head_dim, DType dt, bool plain) {
  return plain && dt == DType::bf16 && (head_dim == 64 || head_dim == 128);
}

void flash_attention(const FlashParams& p) {
  const bool lean = flash_code_knob.value() == kLean;
  flash_code_knob.took(lean ? kLean : kBranches);
  if (p.d == 64) {
    if (p.terms > 1) return lean ? launch<64, 2, true>(p) : launch<64, 2, false>(p);
    return lean ? launch<64, 1, true>(p) : launch<64, 1, false>(p);
  }
  if (p.terms > 1) return lean ? launch<128, 2, true>(p) : launch<128, 2, false>(p);
  lean ? launch<128, 1, true>(p) : launch<128, 1, false>(p);
}

}  // namespace apus::cuda
