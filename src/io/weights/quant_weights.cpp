#include "io/weights/quant_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/scaled_codes.h"
#include "core/tier_rows.h"
#include "ops/cpu/cpu_ops.h"

namespace apus {

namespace {

// A tier's weight: each row of w (widened to fp32) quantised by quantize(row, codes row) into
// `codes`' dtype with its scale a row, the tier's products flagged; a row whose scale comes back
// NaN (a NaN or an infinity in it) refused by number.
template <typename Quantize> Tensor quantized_rows(const Tensor& w, const std::string& what, const char* tier,
                                                   DType codes, Products products, Quantize quantize) {
  APUS_CHECK(
      w.rank() == 2 && w.contiguous() && (w.dtype == DType::bf16 || w.dtype == DType::f16 || w.dtype == DType::f32),
      what, ": the ", tier, " tier quantises bf16, f16 or f32 matrices, got ", dtype_name(w.dtype), " ",
      shape_str(w.shape));
  const int64_t n = w.shape[0], k = w.shape[1];
  Tensor q = Tensor::heap(w.shape, codes);
  auto scales = std::make_shared<BlockScales>();
  scales->factors = Tensor::heap({n, 1}, DType::f32);
  scales->block = k;
  scales->per_row = 1;
  float* factor = scales->factors.ptr<float>();
  int64_t bad_row = -1;
  parallel_for(n, [&](int64_t r) {
    thread_local std::vector<float> row;
    row.resize(size_t(k));
    cpu::widen_row(w.row(r), w.dtype, row.data(), k);
    factor[r] = quantize(row.data(), k, q.row(r));
    if (std::isnan(factor[r])) {
#pragma omp critical(apus_tier_bad_row)
      bad_row = bad_row < 0 ? r : std::min(bad_row, r);
    }
  });
  APUS_CHECK(bad_row < 0, what, ": row ", bad_row, " holds a NaN or an infinity; the ", tier, " tier cannot scale it");
  q.encoding.block_scales = std::move(scales);
  q.encoding.products = products;
  return q;
}

}  // namespace

Tensor quantize_int8_weight(const Tensor& w, const std::string& what) {
  APUS_CHECK(w.rank() != 2 || w.shape[1] <= kInt8MaxDot, what, ": rows of ", w.shape[1],
             " values; the int8 tier's integer sums hold at most ", kInt8MaxDot);
  return quantized_rows(w, what, "int8", DType::i8, Products::int8, [](float* row, int64_t k, void* codes) {
    return quantize_int8_row(row, k, static_cast<int8_t*>(codes));
  });
}

Tensor quantize_tier_weight(const Tensor& w, Products products, const std::string& what) {
  if (products == Products::int8) return quantize_int8_weight(w, what);
  if (products == Products::fp8) return quantize_fp8_weight(w, what);
  return w;
}

Tensor quantize_fp8_weight(const Tensor& w, const std::string& what) {
  return quantized_rows(w, what, "fp8", DType::fp8_e4m3, Products::fp8, [](float* row, int64_t k, void* codes) {
    const float scale = quantize_fp8_row(row, k, row);
    auto* bytes = static_cast<uint8_t*>(codes);
    if (!std::isnan(scale))
      for (int64_t i = 0; i < k; ++i) bytes[i] = fp8_e4m3_code(row[i]);
    return scale;
  });
}

Tensor TierLinears::apply(const std::string& name, const Tensor& stored) const {
  if (stored.rank() != 2 || !name.ends_with(".weight")) return stored;
  auto named = [&](const std::vector<std::string>& ends) {
    return std::any_of(ends.begin(), ends.end(), [&](const std::string& end) { return name.ends_with(end); });
  };
  if (named(scope_.skip) || (!scope_.only.empty() && !named(scope_.only))) return stored;
  const bool int8 = products_ == Products::int8;
  const char* tier = int8 ? "int8" : "fp8";
  const DType codes = int8 ? DType::i8 : DType::fp8_e4m3;
  const std::string what = "tensor '" + name + "'";
  if (stored.dtype == codes) {
    const BlockScales* s = stored.encoding.block_scales.get();
    APUS_CHECK(!s || s->per_row == 1, what, ": ", dtype_name(codes), " codes with ", s ? s->per_row : 0,
               " scales per row; the ", tier, " tier multiplies rows of one scale");
    APUS_CHECK(!int8 || stored.shape[1] <= kInt8MaxDot, what, ": rows of ", stored.shape[1],
               " values; the int8 tier's integer sums hold at most ", kInt8MaxDot);
    Tensor flagged = stored;
    flagged.encoding.products = products_;
    return flagged;
  }
  if (is_stored_quantized(stored.dtype) && scope_.keep_quantized) return stored;
  APUS_CHECK(!is_stored_quantized(stored.dtype), what, " is stored as ", dtype_name(stored.dtype), "; --quant ", tier,
             " takes bf16, f16 or f32 weights (or ", dtype_name(codes),
             " with a scale a row), not a weight that is quantised already");
  if (!stored.data) {
    Tensor t = Tensor::shape_only(stored.shape, codes);
    t.encoding.products = products_;
    return t;
  }
  return quantize_tier_weight(stored, products_, what);
}

Tensor quantize_q8_0_weight(const Tensor& w, const std::string& what) {
  APUS_CHECK(
      w.rank() == 2 && w.contiguous() && (w.dtype == DType::bf16 || w.dtype == DType::f16 || w.dtype == DType::f32),
      what, ": q8_0 quantises bf16, f16 or f32 matrices, got ", dtype_name(w.dtype), " ", shape_str(w.shape));
  const int64_t n = w.shape[0], k = w.shape[1], per = dtype_block(DType::q8_0);
  APUS_CHECK(k % per == 0, what, ": rows of ", k, " values are not whole Q8_0 blocks of ", per);
  Tensor q = Tensor::heap(w.shape, DType::q8_0);
  int64_t bad_row = -1;
  parallel_for(n, [&](int64_t r) {
    thread_local std::vector<float> row;
    row.resize(size_t(k));
    cpu::widen_row(w.row(r), w.dtype, row.data(), k);
    auto* block = static_cast<uint8_t*>(q.row(r));
    bool fine = true;
    for (int64_t b = 0; b < k / per; ++b, block += dtype_block_bytes(DType::q8_0)) {
      const float* x = row.data() + b * per;
      float amax = 0;
      for (int64_t i = 0; i < per; ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        fine &= std::isfinite(x[i]);
      }
      const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
      const uint16_t d16 = f32_to_f16(d);
      fine &= std::isfinite(f16_to_f32(d16));
      std::memcpy(block, &d16, 2);
      for (int64_t i = 0; i < per; ++i) block[2 + i] = uint8_t(int8_t(std::round(x[i] * id)));
    }
    if (!fine) {
#pragma omp critical(apus_q8_0_bad_row)
      bad_row = bad_row < 0 ? r : std::min(bad_row, r);
    }
  });
  APUS_CHECK(bad_row < 0, what, ": row ", bad_row,
             " holds a NaN, an infinity or a value past f16's range (Q8_0's scales are f16)");
  return q;
}

Tensor Q8Linears::apply(const std::string& name, const Tensor& stored) const {
  if (stored.rank() != 2 || !name.ends_with(".weight") || is_stored_quantized(stored.dtype) ||
      stored.shape[1] % dtype_block(DType::q8_0) != 0)
    return stored;
  if (!stored.data) return Tensor::shape_only(stored.shape, DType::q8_0);
  return quantize_q8_0_weight(stored, "tensor '" + name + "'");
}

const char* quant_name(Quant quant) {
  switch (quant) {
    case Quant::none:
      return "none";
    case Quant::int8:
      return "int8";
    case Quant::q8_0:
      return "q8_0";
    case Quant::fp8:
      return "fp8";
  }
  return "?";
}

std::shared_ptr<const WeightTransform> quant_linears(Quant quant, Backend* device) {
  if (quant == Quant::none) return nullptr;
  if (quant == Quant::q8_0) return std::make_shared<Q8Linears>();
  const Products products = quant == Quant::int8 ? Products::int8 : Products::fp8;
  const std::string refusal = (device ? *device : cpu_backend()).refuses(products);
  APUS_CHECK(refusal.empty(), refusal);
  return std::make_shared<TierLinears>(products, TierScope{{"embed_tokens.weight"}});
}

void use_quant_linears(ModelDir& dir, Quant quant, Backend* device) {
  const std::shared_ptr<const WeightTransform> linears = quant_linears(quant, device);
  if (!linears) return;
  dir.use_transform("transformer", linears);
  dir.use_transform("text_encoder", linears);
}

}  // namespace apus
