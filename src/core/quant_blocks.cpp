#include "core/quant_blocks.h"

#include <cstring>
#include <utility>

#include "core/error.h"

// Built with -ffp-contract=off (CMakeLists.txt): gguf-py multiplies and subtracts in separate
// fp32 steps, and a fused d * q - m would round once and differ in the last bit.
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

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Q4_K's and Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4).
void scale_min_k4(const uint8_t* q, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int i = 0; i < 32; ++i) y[i] = d * float(int8_t(b[2 + i]));
}

// Q4_0 and Q4_1: element j < 16 in the low nibble of byte j, element j + 16 in its high nibble.
void q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(int(qs[j] & 0xF) - 8);
    y[j + 16] = d * float(int(qs[j] >> 4) - 8);
  }
}

void q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(qs[j] & 0xF) + m;
    y[j + 16] = d * float(qs[j] >> 4) + m;
  }
}

// Q5_0 and Q5_1: Q4's nibbles, with element i's fifth bit bit i of a 32-bit word.
void q5_0(const uint8_t* b, float* y) {
  const float d = half(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(int((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
    y[j + 16] = d * float(int((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
  }
}

void q5_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) + m;
    y[j + 16] = d * float((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, sub-block s scaled by d * sc[s] and offset by dmin * m[s];
// byte l of 32-byte chunk c holds sub-block 2c's element l (low nibble) and 2c + 1's (high). Q5_K
// adds sub-block s's fifth bits as bit s of qh[0..31] (qh null for Q4_K).
void k_quant(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  for (int s = 0; s < 8; ++s) {
    uint8_t sc, m;
    scale_min_k4(scales, s, sc, m);
    const float ds = d * float(sc), ms = dmin * float(m);
    const uint8_t* q = qs + (s / 2) * 32;
    const int shift = (s % 2) * 4;
    for (int l = 0; l < 32; ++l) {
      const int high = qh ? ((qh[l] >> s) & 1) << 4 : 0;
      y[s * 32 + l] = ds * float(((q[l] >> shift) & 0xF) | high) - ms;
    }
  }
}
void q4_k(const uint8_t* b, float* y) { k_quant(b, nullptr, b + 16, y); }
void q5_k(const uint8_t* b, float* y) { k_quant(b, b + 16, b + 48, y); }

// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales; each half of 128 takes 64 bytes of low
// nibbles (ql) and 32 bytes of 2-bit high parts (qh), group g of 32 in a half from ql[l + 32 (g % 2)]
// (low nibble for g < 2) and bits 2g of qh[l].
void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int g = 0; g < 4; ++g)
      for (int l = 0; l < 32; ++l) {
        const int e = h * 128 + g * 32 + l;
        const int low = (ql[h * 64 + (g % 2) * 32 + l] >> ((g / 2) * 4)) & 0xF;
        const int high = (qh[h * 32 + l] >> (2 * g)) & 3;
        y[e] = (d * float(scales[e / 16])) * float((low | (high << 4)) - 32);
      }
}

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

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  void (*block)(const uint8_t*, float*) = nullptr;
  switch (t) {
    case DType::q8_0:
      block = q8_0;
      break;
    case DType::q4_0:
      block = q4_0;
      break;
    case DType::q4_1:
      block = q4_1;
      break;
    case DType::q5_0:
      block = q5_0;
      break;
    case DType::q5_1:
      block = q5_1;
      break;
    case DType::q4_k:
      block = q4_k;
      break;
    case DType::q5_k:
      block = q5_k;
      break;
    case DType::q6_k:
      block = q6_k;
      break;
    default:
      fail("dequantize_row: ", dtype_name(t), " is not a block format");
  }
  const int64_t per = dtype_block(t);
  APUS_CHECK(n % per == 0, "dequantize_row: ", n, " elements are not whole ", dtype_name(t), " blocks");
  const auto* p = static_cast<const uint8_t*>(src);
  const size_t bytes = dtype_block_bytes(t);
  for (int64_t i = 0; i < n / per; ++i) block(p + size_t(i) * bytes, dst + i * per);
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
