#include "ops/backend.h"

#include "core/error.h"
#if APUS_HAS_CUDA
#include "ops/cuda/cuda.h"
#endif

namespace apus {

Backend* backend_for(const std::string& device) {
  if (device == "cpu") return nullptr;
  APUS_CHECK(device == "cuda" || device.rfind("cuda:", 0) == 0, "device '", device,
             "' is not known (expected cpu, cuda or cuda:N)");
  int ordinal = 0;
  if (device.size() > 5) {
    const std::string n = device.substr(5);
    APUS_CHECK(!n.empty() && n.size() < 4 && n.find_first_not_of("0123456789") == std::string::npos, "device '", device,
               "': expected cuda:N with N a device number");
    ordinal = std::stoi(n);
  }
#if APUS_HAS_CUDA
  return &cuda_backend(ordinal);
#else
  fail("device '", device, "': this build has no CUDA backend (nvcc was not found when it was configured)");
#endif
}

}  // namespace apus
