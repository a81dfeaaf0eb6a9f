// The CPU backend object: the op list's entries forwarded to the kernels of this folder.
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"

namespace apus {

namespace {

class CpuBackend final : public HostBackend {
 public:
  CpuBackend() : HostBackend("cpu") {}
#define APUS_CPU_OP(ret, name, params, args) \
  ret name params override { return cpu::name args; }
  APUS_OPS(APUS_CPU_OP)
#undef APUS_CPU_OP
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace apus
