#pragma once
// Noise a caller hands in as a file (parity runs, tests) instead of a seed.
#include <string>

#include "core/tensor.h"

namespace apus {

// The safetensors tensor `noise` of `path`, checked to have `shape`, a float dtype and only finite
// values, converted to `act`.
Tensor read_noise(const std::string& path, const Shape& shape, DType act);

}  // namespace apus
