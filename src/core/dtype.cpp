#include "core/dtype.h"

#include <cmath>
#include <cstring>

#include "core/clones.h"
#include "core/error.h"

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
    case DType::fp8_e5m2:
    case DType::e8m0:
    case DType::u8:
    case DType::boolean:
      return 1;
    case DType::i64:
      return 8;
    default:
      fail("dtype ", dtype_name(t), " is block-quantised: it has no per-element size");
  }
}

namespace {
struct BlockFormat {
  DType t;
  int64_t elements;
  size_t bytes;
};
// GGML's block_q8_0 ... block_q6_K (ggml-common.h); packed fp4, two codes a byte.
constexpr BlockFormat kBlockFormats[] = {{DType::q8_0, 32, 34},   {DType::q4_0, 32, 18},   {DType::q4_1, 32, 20},
                                         {DType::q5_0, 32, 22},   {DType::q5_1, 32, 24},   {DType::q4_k, 256, 144},
                                         {DType::q5_k, 256, 176}, {DType::q6_k, 256, 210}, {DType::fp4_e2m1, 2, 1}};
const BlockFormat* block_format(DType t) {
  for (const auto& f : kBlockFormats)
    if (f.t == t) return &f;
  return nullptr;
}
}  // namespace

bool is_block_quantized(DType t) { return block_format(t) != nullptr && t != DType::fp4_e2m1; }

int64_t dtype_block(DType t) {
  const BlockFormat* f = block_format(t);
  return f ? f->elements : 1;
}

size_t dtype_block_bytes(DType t) {
  const BlockFormat* f = block_format(t);
  return f ? f->bytes : dtype_size(t);
}

size_t dtype_bytes(DType t, int64_t n) {
  const BlockFormat* f = block_format(t);
  if (!f) return size_t(n) * dtype_size(t);
  APUS_CHECK(n % f->elements == 0, n, " elements of ", dtype_name(t), " are not whole ", f->elements,
             "-element blocks");
  return size_t(n / f->elements) * f->bytes;
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
    case DType::q8_0:
      return "q8_0";
    case DType::q4_0:
      return "q4_0";
    case DType::q4_1:
      return "q4_1";
    case DType::q5_0:
      return "q5_0";
    case DType::q5_1:
      return "q5_1";
    case DType::q4_k:
      return "q4_k";
    case DType::q5_k:
      return "q5_k";
    case DType::q6_k:
      return "q6_k";
    case DType::fp8_e5m2:
      return "fp8_e5m2";
    case DType::e8m0:
      return "e8m0";
    case DType::fp4_e2m1:
      return "fp4_e2m1";
  }
  return "?";
}

namespace {
struct SafetensorsName {
  std::string_view name;
  DType t;
};
constexpr SafetensorsName kSafetensorsNames[] = {{"F32", DType::f32},          {"BF16", DType::bf16},
                                                 {"F16", DType::f16},          {"I8", DType::i8},
                                                 {"F8_E4M3", DType::fp8_e4m3}, {"U8", DType::u8},
                                                 {"I32", DType::i32},          {"I64", DType::i64},
                                                 {"BOOL", DType::boolean},     {"F8_E5M2", DType::fp8_e5m2},
                                                 {"F8_E8M0", DType::e8m0}};
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

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
  if (abs < 0x38800000u) {                                  // below 2^-14: a subnormal half, in units of 2^-24
    const int exponent = int(abs >> 23);
    if (exponent < 102) return uint16_t(sign);  // under 2^-25
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int drop = 126 - exponent;
    const uint32_t q = mant >> drop, rest = mant & ((1u << drop) - 1), mid = 1u << (drop - 1);
    return uint16_t(sign | (q + (rest > mid || (rest == mid && (q & 1)))));
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1fffu;
  h += rest > 0x1000u || (rest == 0x1000u && (h & 1));
  return uint16_t(sign | h);
}

APUS_CLONES void f16_to_f32_row(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    // Exponent and mantissa moved into float position and rebased by 2^(127-15): exact for normal
    // and subnormal halves alike; the all-ones exponent (Inf, NaN) is set directly.
    const uint32_t magnitude = uint32_t(in[i] & 0x7fffu) << 13;
    float f;
    std::memcpy(&f, &magnitude, 4);
    f *= 0x1p112f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (magnitude >= (0x7c00u << 13)) u = magnitude | 0x7f800000u;
    u |= uint32_t(in[i] & 0x8000u) << 16;
    std::memcpy(&out[i], &u, 4);
  }
}

}  // namespace apus
