#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

// Functions both the host and the CUDA backend's kernels call (nvcc compiles them for both).
#if defined(__CUDACC__)
#define APUS_HD __host__ __device__
#else
#define APUS_HD
#endif

namespace apus {

// Kernels accept only the dtypes they implement.
// q8_0 ... q6_k are GGML's block formats (core/quant_blocks.h): a block of dtype_block elements
// takes dtype_block_bytes bytes, so they have no per-element size.
// fp8_e5m2, e8m0 (power-of-two scale bytes, mxfp8's) and fp4_e2m1 (two codes a byte, the high
// nibble first: nvfp4's) come from ComfyUI's quantised checkpoints (core/scaled_codes.h).
enum class DType : uint8_t {
  f32,
  bf16,
  f16,
  i8,
  fp8_e4m3,
  u8,
  i32,
  i64,
  boolean,
  q8_0,
  q4_0,
  q4_1,
  q5_0,
  q5_1,
  q4_k,
  q5_k,
  q6_k,
  fp8_e5m2,
  e8m0,
  fp4_e2m1
};

// Bytes per element; refused for a block format.
size_t dtype_size(DType t);
// GGML's block formats, whose blocks carry their own scales. fp4_e2m1 also has no per-element size
// (blocks of two codes a byte) but its scales are the tensor's (core/scaled_codes.h): not one.
bool is_block_quantized(DType t);
int64_t dtype_block(DType t);       // elements per block: 1 for an element type
size_t dtype_block_bytes(DType t);  // bytes per block
// Bytes of n elements (a multiple of dtype_block(t)).
size_t dtype_bytes(DType t, int64_t n);
std::string_view dtype_name(DType t);
// Parses a safetensors dtype string ("F32", "BF16", ...); returns false for unknown ones.
bool dtype_from_safetensors(std::string_view s, DType& out);
std::string_view dtype_safetensors_name(DType t);  // "F32", "BF16", ...

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's bfloat16 conversion does (NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// A float as the reference holds it after one op in dtype `dt` (only bf16 rounds here).
inline float round_as(DType dt, float f) { return dt == DType::bf16 ? round_bf16(f) : f; }

// IEEE binary16, rounded to nearest even (numpy's astype(float16)): subnormals, overflow to
// infinity and NaN included.
uint16_t f32_to_f16(float f);
// f16_to_f32 over a row, vectorised (per-ISA clones): exact, subnormals, infinities and NaN included.
void f16_to_f32_row(const uint16_t* in, float* out, int64_t n);

// The narrow formats' codes as fp32, exactly (each is a small integer times a power of two), on the
// host and on the GPU alike, so a weight decodes to the same bits on every backend.
APUS_HD inline float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
APUS_HD inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
// 2^e for e in [-126, 127].
APUS_HD inline float exp2i(int e) { return f32_from_bits(uint32_t(e + 127) << 23); }
// A finite code from its sign, exponent and mantissa fields (subnormal at exponent 0).
APUS_HD inline float narrow_float(bool negative, int exp, int mant, int mant_bits, int bias) {
  const float v = exp == 0 ? float(mant) * exp2i(1 - bias - mant_bits)
                           : float(mant | (1 << mant_bits)) * exp2i(exp - bias - mant_bits);
  return negative ? -v : v;
}
// The format's signed infinity or (quiet) NaN.
APUS_HD inline float narrow_special(bool negative, bool nan) {
  return f32_from_bits((negative ? 0x80000000u : 0u) | (nan ? 0x7fc00000u : 0x7f800000u));
}
// IEEE binary16: subnormals, infinities and NaN included.
APUS_HD inline float f16_to_f32(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  return exp == 31 ? narrow_special(h >> 15, mant != 0) : narrow_float(h >> 15, exp, mant, 10, 15);
}
// float8_e4m3fn, torch's: bias 7, no infinities, S.1111.111 is NaN.
APUS_HD inline float fp8_e4m3_to_f32(uint8_t v) {
  return (v & 0x7f) == 0x7f ? narrow_special(v >> 7, true) : narrow_float(v >> 7, (v >> 3) & 0xf, v & 7, 3, 7);
}
// float8_e5m2, torch's: bias 15, IEEE-style infinities and NaNs.
APUS_HD inline float fp8_e5m2_to_f32(uint8_t v) {
  const int exp = (v >> 2) & 0x1f, mant = v & 3;
  return exp == 31 ? narrow_special(v >> 7, mant != 0) : narrow_float(v >> 7, exp, mant, 2, 15);
}
// An e8m0 scale byte as comfy-kitchen's e8m0_to_f32 reads it: the byte as an fp32 exponent field,
// 2^(v - 127), with 0 read as 0 and 255 as infinity (torch's float8_e8m0fnu has 2^-127 and NaN).
APUS_HD inline float e8m0_to_f32(uint8_t v) { return f32_from_bits(v == 0 ? 0u : uint32_t(v) << 23); }
// fp4 e2m1 (nvfp4's codes, the low four bits of `code`): comfy-kitchen's E2M1_LUT, 0, 0.5, 1,
// 1.5, 2, 3, 4, 6 and their negatives.
APUS_HD inline float fp4_e2m1_to_f32(uint8_t code) { return narrow_float(code & 8, (code >> 1) & 3, code & 1, 1, 1); }

}  // namespace apus
