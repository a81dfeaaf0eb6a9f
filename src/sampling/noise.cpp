#include "sampling/noise.h"

#include <cmath>

#include "core/error.h"
#include "io/weights/safetensors.h"

namespace apus {

Tensor read_noise(const std::string& path, const Shape& shape, DType act) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  const Tensor& n = f.get("noise");
  APUS_CHECK(n.shape == shape, path, ": tensor 'noise' has shape ", shape_str(n.shape), ", expected ",
             shape_str(shape));
  APUS_CHECK(n.dtype == DType::f32 || n.dtype == DType::bf16 || n.dtype == DType::f16, path,
             ": tensor 'noise' has dtype ", dtype_name(n.dtype), ", expected f32, bf16 or f16");
  for (int64_t i = 0; i < n.numel(); ++i)
    APUS_CHECK(std::isfinite(load_f32(n, i)), path, ": tensor 'noise' holds a non-finite value at ", "element ", i);
  return to_dtype(n, act);
}

}  // namespace apus
