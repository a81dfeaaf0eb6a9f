#include "core/quant_blocks.h"

#include <utility>

#include "core/clones.h"
#include "core/error.h"
#include "core/ggml_blocks.h"

// Built with -ffp-contract=off (CMakeLists.txt): gguf-py multiplies and subtracts in separate
// fp32 steps, and a fused d * q - m would round once and differ in the last bit (ggml_blocks.h).
namespace apus {

namespace {

struct GgmlType {
  uint32_t id;
  const char* name;
  DType dtype;
};
// ggml.h's enum ggml_type, the ids apus reads.
constexpr GgmlType kGgmlTypes[] = {
    {0, "F32", DType::f32},    {1, "F16", DType::f16},    {2, "Q4_0", DType::q4_0},  {3, "Q4_1", DType::q4_1},
    {6, "Q5_0", DType::q5_0},  {7, "Q5_1", DType::q5_1},  {8, "Q8_0", DType::q8_0},  {12, "Q4_K", DType::q4_k},
    {13, "Q5_K", DType::q5_k}, {14, "Q6_K", DType::q6_k}, {30, "BF16", DType::bf16},
};
// The rest of ggml's ids, named so a refusal says what the file holds.
constexpr std::pair<uint32_t, const char*> kUnreadGgmlTypes[] = {
    {9, "Q8_1"},   {10, "Q2_K"},   {11, "Q3_K"},  {15, "Q8_K"},  {16, "IQ2_XXS"}, {17, "IQ2_XS"}, {18, "IQ3_XXS"},
    {19, "IQ1_S"}, {20, "IQ4_NL"}, {21, "IQ3_S"}, {22, "IQ2_S"}, {23, "IQ4_XS"},  {24, "I8"},     {25, "I16"},
    {26, "I32"},   {27, "I64"},    {28, "F64"},   {29, "IQ1_M"}, {34, "TQ1_0"},   {35, "TQ2_0"},  {39, "MXFP4"}};

}  // namespace

bool dtype_from_ggml(uint32_t ggml_type, DType& out) {
  for (const auto& t : kGgmlTypes)
    if (t.id == ggml_type) {
      out = t.dtype;
      return true;
    }
  return false;
}

const char* ggml_type_name(uint32_t ggml_type) {
  for (const auto& t : kGgmlTypes)
    if (t.id == ggml_type) return t.name;
  for (const auto& [id, name] : kUnreadGgmlTypes)
    if (id == ggml_type) return name;
  return "an unknown type";
}

// Compiled per instruction set, the blocks' loops inlined into each clone: the decoding
// vectorises (baseline x86-64 converts codes to floats a lane at a time).
APUS_CLONES void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  const int64_t per = dtype_block(t);
  APUS_CHECK(n % per == 0, "dequantize_row: ", n, " elements are not whole ", dtype_name(t), " blocks");
  const auto* p = static_cast<const uint8_t*>(src);
  const size_t bytes = dtype_block_bytes(t);
  const bool known = ggml::with_block_format(
      t, [&](auto format) __attribute__((always_inline)) {
        for (int64_t i = 0; i < n / per; ++i) {
          float* y = dst + i * per;
          ggml::decode_block<decltype(format)::dtype>(p + size_t(i) * bytes, [y](int e, float v) { y[e] = v; });
        }
      });
  APUS_CHECK(known, "dequantize_row: ", dtype_name(t), " is not a block format");
}

int64_t first_nonfinite_scale(DType t, const void* src, int64_t blocks) {
  // Byte offsets of each block's f16 scale and min (-1: none), from ggml's block structs.
  int scale = 0, min = -1;
  switch (t) {
    case DType::q8_0:
    case DType::q4_0:
    case DType::q5_0:
      break;
    case DType::q4_1:
    case DType::q5_1:
    case DType::q4_k:
    case DType::q5_k:
      min = 2;
      break;
    case DType::q6_k:
      scale = 208;
      break;  // ql[128], qh[64], scales[16], then d
    default:
      fail("first_nonfinite_scale: ", dtype_name(t), " is not a block format");
  }
  const auto* p = static_cast<const uint8_t*>(src);
  const size_t bytes = dtype_block_bytes(t);
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = p + size_t(i) * bytes;
    // f16 is non-finite when its five exponent bits are all set.
    auto nonfinite = [b](int at) { return (b[at + 1] & 0x7c) == 0x7c; };
    if (nonfinite(scale) || (min >= 0 && nonfinite(min))) return i;
  }
  return -1;
}

float dequantize_element(DType t, const void* row, int64_t i) {
  const int64_t per = dtype_block(t);
  float block[256];
  dequantize_row(t, static_cast<const uint8_t*>(row) + dtype_bytes(t, i / per * per), block, per);
  return block[i % per];
}

}  // namespace apus
