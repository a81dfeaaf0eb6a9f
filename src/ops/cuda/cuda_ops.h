#pragma once
// The CUDA backend's ops (src/ops/cuda/*.cu), one function per op of the list.
#include <cuda_runtime.h>

#include "core/error.h"
#include "ops/ops.h"

namespace apus::cuda {

APUS_DECLARE_OPS

// Throws an apus::Error naming the call and CUDA's message when `e` is an error.
void check(cudaError_t e, const char* what);
// The stream every op of this backend is queued on.
cudaStream_t stream();

}  // namespace apus::cuda
