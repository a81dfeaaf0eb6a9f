// The reference backend object and the element helpers its ops share.
#include <cmath>

#include "core/quant_blocks.h"
#include "core/scaled_codes.h"
#include "ops/backend.h"
#include "ops/ref/ref_ops.h"

namespace apus {

namespace ref {

double get(const Tensor& t, int64_t r, int64_t i) {
  if (is_block_quantized(t.dtype)) return dequantize_element(t.dtype, t.row(r), i);
  if (is_code_format(t.dtype)) return decode_code_element(t, r, i);
  const void* p = static_cast<const char*>(t.row(r)) + size_t(i) * dtype_size(t.dtype);
  switch (t.dtype) {
    case DType::f32:
      return *static_cast<const float*>(p);
    case DType::bf16:
      return bf16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::f16:
      return f16_to_f32(*static_cast<const uint16_t*>(p));
    default:
      fail("reference backend: unsupported dtype ", dtype_name(t.dtype));
  }
}

void put(Tensor& t, int64_t r, int64_t i, double v) {
  void* p = static_cast<char*>(t.row(r)) + size_t(i) * dtype_size(t.dtype);
  switch (t.dtype) {
    case DType::f32:
      *static_cast<float*>(p) = float(v);
      return;
    case DType::bf16:
      *static_cast<uint16_t*>(p) = f32_to_bf16(float(v));
      return;
    default:
      fail("reference backend: cannot store ", dtype_name(t.dtype));
  }
}

double as(DType dt, double v) { return dt == DType::bf16 ? round_bf16(float(v)) : double(float(v)); }

Tensor rows2d(const Tensor& t) { return t.rank() == 2 ? t : t.reshape({t.numel() / t.shape.back(), t.shape.back()}); }

double silu(double v) { return v / (1.0 + std::exp(-v)); }

double gelu_tanh(double v) {
  const double u = std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v);
  return 2.0 * u < -18.0 ? 0.0 * v : 0.5 * v * (1.0 + std::tanh(u));
}

}  // namespace ref

namespace {

class ReferenceBackend final : public HostBackend {
 public:
  ReferenceBackend() : HostBackend("reference") {}
#define APUS_REF_OP(ret, name, params, args) \
  ret name params override { return ref::name args; }
  APUS_OPS(APUS_REF_OP)
#undef APUS_REF_OP
};

}  // namespace

Backend& reference_backend() {
  static ReferenceBackend backend;
  return backend;
}

}  // namespace apus
