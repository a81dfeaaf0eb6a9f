#include "io/weights/int8_weights.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/int8_rows.h"
#include "core/parallel.h"
#include "core/scaled_codes.h"
#include "ops/cpu/cpu_ops.h"

namespace apus {

Tensor quantize_int8_weight(const Tensor& w, const std::string& what) {
  APUS_CHECK(
      w.rank() == 2 && w.contiguous() && (w.dtype == DType::bf16 || w.dtype == DType::f16 || w.dtype == DType::f32),
      what, ": the int8 tier quantises bf16, f16 or f32 matrices, got ", dtype_name(w.dtype), " ", shape_str(w.shape));
  const int64_t n = w.shape[0], k = w.shape[1];
  APUS_CHECK(k <= kInt8MaxDot, what, ": rows of ", k, " values; the int8 tier's integer sums hold at most ",
             kInt8MaxDot);
  Tensor q = Tensor::heap(w.shape, DType::i8);
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
    factor[r] = quantize_int8_row(row.data(), k, static_cast<int8_t*>(q.row(r)));
    if (std::isnan(factor[r])) {
#pragma omp critical(apus_int8_bad_row)
      bad_row = bad_row < 0 ? r : std::min(bad_row, r);
    }
  });
  APUS_CHECK(bad_row < 0, what, ": row ", bad_row, " holds a NaN or an infinity; the int8 tier cannot scale it");
  q.encoding.block_scales = std::move(scales);
  q.encoding.int8_matmul = true;
  return q;
}

Tensor Int8Linears::apply(const std::string& name, const Tensor& stored) const {
  if (stored.rank() != 2 || !name.ends_with(".weight")) return stored;
  auto named = [&](const std::vector<std::string>& ends) {
    return std::any_of(ends.begin(), ends.end(), [&](const std::string& end) { return name.ends_with(end); });
  };
  if (named(scope_.skip) || (!scope_.only.empty() && !named(scope_.only))) return stored;
  const std::string what = "tensor '" + name + "'";
  if (stored.dtype == DType::i8) {
    APUS_CHECK(!stored.encoding.block_scales || stored.encoding.block_scales->per_row == 1, what, ": int8 codes with ",
               stored.encoding.block_scales ? stored.encoding.block_scales->per_row : 0,
               " scales per row; the int8 tier multiplies rows of one scale");
    APUS_CHECK(stored.shape[1] <= kInt8MaxDot, what, ": rows of ", stored.shape[1],
               " values; the int8 tier's integer sums hold at most ", kInt8MaxDot);
    Tensor flagged = stored;
    flagged.encoding.int8_matmul = true;
    return flagged;
  }
  if (is_stored_quantized(stored.dtype) && scope_.keep_quantized) return stored;
  APUS_CHECK(!is_stored_quantized(stored.dtype), what, " is stored as ", dtype_name(stored.dtype),
             "; --quant int8 takes bf16, f16 or f32 weights (or int8 with a scale per row), not a weight that is "
             "quantised already");
  if (!stored.data) {
    Tensor t = Tensor::shape_only(stored.shape, DType::i8);
    t.encoding.int8_matmul = true;
    return t;
  }
  return quantize_int8_weight(stored, what);
}

std::shared_ptr<const WeightTransform> int8_linears(Quant quant, Backend* device) {
  if (quant == Quant::none) return nullptr;
  // A GPU sums int8 products exactly on its integer tensor cores; a CPU needs VNNI or AVX2 for it.
  APUS_CHECK(device || cpu::exact_int8_products(),
             "--quant int8 needs a CPU with VNNI (AVX512-VNNI, AVX-VNNI or AMX) or AVX2, ",
             "where its int8 products are exact; this one has neither");
  return std::make_shared<Int8Linears>(Int8Scope{{"embed_tokens.weight"}});
}

void use_int8_linears(ModelDir& dir, Quant quant, Backend* device) {
  const std::shared_ptr<const WeightTransform> linears = int8_linears(quant, device);
  if (!linears) return;
  dir.use_transform("transformer", linears);
  dir.use_transform("text_encoder", linears);
}

}  // namespace apus
