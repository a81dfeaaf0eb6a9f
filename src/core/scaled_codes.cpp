#include "core/scaled_codes.h"

#include <array>

#include "core/error.h"

namespace apus {

namespace {

// Every code of the fp8 and fp4 formats as fp32 (code_value's), so a row decodes by lookups.
struct CodeTables {
  std::array<float, 256> e4m3, e5m2;
  std::array<float, 16> e2m1;
  CodeTables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[size_t(i)] = fp8_e4m3_to_f32(uint8_t(i));
      e5m2[size_t(i)] = fp8_e5m2_to_f32(uint8_t(i));
    }
    for (int i = 0; i < 16; ++i) e2m1[size_t(i)] = fp4_e2m1_to_f32(uint8_t(i));
  }
};
const CodeTables& code_tables() {
  static const CodeTables tables;
  return tables;
}

// Codes [c0, c1) of a row as fp32, unscaled.
void decode_codes(DType t, const void* row, int64_t c0, int64_t c1, float* out) {
  const uint8_t* b = static_cast<const uint8_t*>(row);
  switch (t) {
    case DType::fp8_e4m3: {
      const float* lut = code_tables().e4m3.data();
      for (int64_t c = c0; c < c1; ++c) out[c - c0] = lut[b[c]];
      return;
    }
    case DType::fp8_e5m2: {
      const float* lut = code_tables().e5m2.data();
      for (int64_t c = c0; c < c1; ++c) out[c - c0] = lut[b[c]];
      return;
    }
    case DType::i8: {
      const int8_t* q = static_cast<const int8_t*>(row);
      for (int64_t c = c0; c < c1; ++c) out[c - c0] = float(q[c]);
      return;
    }
    case DType::fp4_e2m1: {
      const float* lut = code_tables().e2m1.data();
      for (int64_t c = c0; c < c1; ++c) out[c - c0] = lut[fp4_code(b, c)];
      return;
    }
    default:
      fail("dtype ", dtype_name(t), " is no code format");
  }
}

}  // namespace

bool is_code_format(DType t) {
  return t == DType::fp8_e4m3 || t == DType::fp8_e5m2 || t == DType::i8 || t == DType::fp4_e2m1;
}

float BlockScales::at(int64_t r, int64_t j) const {
  return load_f32(factors, block_factor_index(r, j, per_row, tiled));
}

void decode_code_row(const Tensor& t, int64_t r, float* out, int64_t n) {
  const void* row = t.row(r);
  decode_codes(t.dtype, row, 0, n, out);
  if (!t.encoding.block_scales) {
    if (t.encoding.code_scale != 1)
      for (int64_t c = 0; c < n; ++c) out[c] *= t.encoding.code_scale;
    return;
  }
  const BlockScales& s = *t.encoding.block_scales;
  const int64_t rr = t.encoding.block_row0 + r;
  for (int64_t c0 = 0; c0 < n; c0 += s.block) {
    const float f = t.encoding.code_scale * s.at(rr, c0 / s.block);
    const int64_t c1 = std::min(n, c0 + s.block);
    for (int64_t c = c0; c < c1; ++c) out[c] *= f;
  }
}

float decode_code_element(const Tensor& t, int64_t r, int64_t c) {
  float v;
  decode_codes(t.dtype, t.row(r), c, c + 1, &v);
  if (!t.encoding.block_scales) return v * t.encoding.code_scale;
  const BlockScales& s = *t.encoding.block_scales;
  return v * (t.encoding.code_scale * s.at(t.encoding.block_row0 + r, c / s.block));
}

}  // namespace apus
