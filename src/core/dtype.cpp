#include "core/dtype.h"

#include <cmath>

namespace apus {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::i8:
    case DType::fp8_e4m3:
    case DType::u8:
    case DType::boolean:
      return 1;
    case DType::i64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i8:
      return "i8";
    case DType::fp8_e4m3:
      return "fp8_e4m3";
    case DType::u8:
      return "u8";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::boolean:
      return "bool";
  }
  return "?";
}

namespace {
struct SafetensorsName {
  std::string_view name;
  DType t;
};
constexpr SafetensorsName kSafetensorsNames[] = {
    {"F32", DType::f32}, {"BF16", DType::bf16},        {"F16", DType::f16},
    {"I8", DType::i8},   {"F8_E4M3", DType::fp8_e4m3}, {"U8", DType::u8},
    {"I32", DType::i32}, {"I64", DType::i64},          {"BOOL", DType::boolean}};
}  // namespace

bool dtype_from_safetensors(std::string_view s, DType& out) {
  for (const auto& e : kSafetensorsNames)
    if (e.name == s) {
      out = e.t;
      return true;
    }
  return false;
}

std::string_view dtype_safetensors_name(DType t) {
  for (const auto& e : kSafetensorsNames)
    if (e.t == t) return e.name;
  return "?";
}

float f16_to_f32(uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v;
  if (exp == 0) v = std::ldexp(float(mant), -24);
  else if (exp == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp(float(mant | 0x400), exp - 25);
  return sign ? -v : v;
}

}  // namespace apus
