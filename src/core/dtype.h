#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

namespace apus {

// Room for quantised tiers (i8, fp8) is kept in the enum; kernels accept only what they implement.
enum class DType : uint8_t { f32, bf16, f16, i8, fp8_e4m3, u8, i32, i64, boolean };

size_t dtype_size(DType t);
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

float f16_to_f32(uint16_t h);

}  // namespace apus
