#pragma once
// GGML's block formats decoded one block at a time, on the host (quant_blocks.cpp) and on the GPU
// (ops/cuda/stored_weights.cu) from this one definition: gguf-py's dequantisation (gguf.quants),
// operation for operation in fp32. Both translation units are built without contracting a * b + c
// into one rounding (-ffp-contract=off, -fmad=false), which would move the last bit.
//
// decode_block<T>(b, put) calls put(i, value) for each of the block's dtype_block(T) elements.
#include <cstdint>

#include "core/dtype.h"

// Each block function inlined into its caller, so that a host caller compiled per instruction set
// (APUS_CLONES) vectorises it for that set.
#if defined(__CUDACC__)
#define APUS_BLOCK_FN __host__ __device__ __forceinline__
#else
#define APUS_BLOCK_FN [[gnu::always_inline]] inline
#endif

namespace apus::ggml {

APUS_HD inline float half_at(const uint8_t* p) { return f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }
APUS_HD inline uint32_t u32_at(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}

// Q4_K's and Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4).
APUS_HD inline void scale_min_k4(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <class Put> APUS_BLOCK_FN void q8_0(const uint8_t* b, Put put) {
  const float d = half_at(b);
  for (int i = 0; i < 32; ++i) put(i, d * float(int8_t(b[2 + i])));
}

// Q4_0 and Q4_1: element j < 16 in the low nibble of byte j, element j + 16 in its high nibble
// (each half a loop of its own: contiguous stores, which vectorise).
template <class Put> APUS_BLOCK_FN void q4_0(const uint8_t* b, Put put) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) put(j, d * float(int(qs[j] & 0xF) - 8));
  for (int j = 0; j < 16; ++j) put(j + 16, d * float(int(qs[j] >> 4) - 8));
}

template <class Put> APUS_BLOCK_FN void q4_1(const uint8_t* b, Put put) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) put(j, d * float(qs[j] & 0xF) + m);
  for (int j = 0; j < 16; ++j) put(j + 16, d * float(qs[j] >> 4) + m);
}

// Q5_0 and Q5_1: Q4's nibbles, with element i's fifth bit bit i of a 32-bit word.
template <class Put> APUS_BLOCK_FN void q5_0(const uint8_t* b, Put put) {
  const float d = half_at(b);
  const uint32_t qh = u32_at(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    put(j, d * float(int((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16));
    put(j + 16, d * float(int((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16));
  }
}

template <class Put> APUS_BLOCK_FN void q5_1(const uint8_t* b, Put put) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    put(j, d * float((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) + m);
    put(j + 16, d * float((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, sub-block s scaled by d * sc[s] and offset by dmin * m[s];
// byte l of 32-byte chunk c holds sub-block 2c's element l (low nibble) and 2c + 1's (high). Q5_K
// adds sub-block s's fifth bits as bit s of qh[0..31] (qh null for Q4_K).
template <class Put> APUS_BLOCK_FN void k_quant(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, Put put) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  for (int s = 0; s < 8; ++s) {
    int sc, m;
    scale_min_k4(scales, s, sc, m);
    const float ds = d * float(sc), ms = dmin * float(m);
    const uint8_t* q = qs + (s / 2) * 32;
    const int shift = (s % 2) * 4;
    for (int l = 0; l < 32; ++l) {
      const int high = qh ? ((qh[l] >> s) & 1) << 4 : 0;
      put(s * 32 + l, ds * float(((q[l] >> shift) & 0xF) | high) - ms);
    }
  }
}

// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales; each half of 128 takes 64 bytes of low
// nibbles (ql) and 32 bytes of 2-bit high parts (qh), group g of 32 in a half from ql[l + 32 (g % 2)]
// (low nibble for g < 2) and bits 2g of qh[l].
template <class Put> APUS_BLOCK_FN void q6_k(const uint8_t* b, Put put) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const uint8_t* scales = b + 192;
  const float d = half_at(b + 208);
  // Sub-block e / 16 = 8h + 2g + l / 16: its scale's product formed once for its 16 elements.
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 4; ++g)
      for (int half = 0; half < 2; ++half) {
        const float ds = d * float(int8_t(scales[h * 8 + g * 2 + half]));
        for (int l = half * 16; l < half * 16 + 16; ++l) {
          const int low = (ql[h * 64 + (g % 2) * 32 + l] >> ((g / 2) * 4)) & 0xF;
          const int high = (qh[h * 32 + l] >> (2 * g)) & 3;
          put(h * 128 + g * 32 + l, ds * float((low | (high << 4)) - 32));
        }
      }
}

template <DType T, class Put> APUS_BLOCK_FN void decode_block(const uint8_t* b, Put put) {
  if constexpr (T == DType::q8_0) q8_0(b, put);
  else if constexpr (T == DType::q4_0) q4_0(b, put);
  else if constexpr (T == DType::q4_1) q4_1(b, put);
  else if constexpr (T == DType::q5_0) q5_0(b, put);
  else if constexpr (T == DType::q5_1) q5_1(b, put);
  else if constexpr (T == DType::q4_k) k_quant(b, nullptr, b + 16, put);
  else if constexpr (T == DType::q5_k) k_quant(b, b + 16, b + 48, put);
  else q6_k(b, put);
}

// A GGML format as a type, for dispatching on a dtype known only at run time.
template <DType T> struct Format { static constexpr DType dtype = T; };

// f(Format<T>{}) with T the GGML format t names (f a generic lambda); false for any other dtype.
// Always inlined, so that a caller compiled per instruction set (APUS_CLONES) compiles f so too.
template <class F> [[gnu::always_inline]] inline bool with_block_format(DType t, F f) {
  switch (t) {
    case DType::q8_0:
      return f(Format<DType::q8_0>{}), true;
    case DType::q4_0:
      return f(Format<DType::q4_0>{}), true;
    case DType::q4_1:
      return f(Format<DType::q4_1>{}), true;
    case DType::q5_0:
      return f(Format<DType::q5_0>{}), true;
    case DType::q5_1:
      return f(Format<DType::q5_1>{}), true;
    case DType::q4_k:
      return f(Format<DType::q4_k>{}), true;
    case DType::q5_k:
      return f(Format<DType::q5_k>{}), true;
    case DType::q6_k:
      return f(Format<DType::q6_k>{}), true;
    default:
      return false;
  }
}

}  // namespace apus::ggml
