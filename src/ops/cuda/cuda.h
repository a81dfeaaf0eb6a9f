#pragma once
// The CUDA backend (issue 11): the op list on an NVIDIA GPU, memory from cudaMalloc, GEMMs through
// cuBLASLt, every op of the list as a kernel with the contract's numerics (correct first; the fast
// kernels follow, docs/ROADMAP.md). Present when the build found nvcc (APUS_HAS_CUDA).
#include <string>

#include "ops/backend.h"

namespace apus {

// Whether a CUDA device can run here; if not, why (no driver, no device, built without CUDA).
bool cuda_available(std::string* why);
// How many CUDA devices this machine has (0 without a driver or device).
int cuda_device_count();
// The libraries the backend opens at run time, as this build knows them: "cuBLASLt, cuDNN, NCCL"
// (cuDNN and NCCL where their headers were found when it was configured).
std::string cuda_libraries();
// The backend of GPU `ordinal`; refused when cuda_available is false.
Backend& cuda_backend(int ordinal = 0);
// A device copy of a host tensor (contiguous), and a host copy of a device one.
Tensor to_device(Backend& backend, const Tensor& host);
Tensor to_host(const Tensor& device);

}  // namespace apus
