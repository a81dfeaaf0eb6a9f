// The CPU backend object: the op list's entries forwarded to the kernels of this folder.
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"

namespace apus {

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend() : Backend("cpu", Device::cpu, 0) {}
#define APUS_CPU_OP(ret, name, params, args) \
  ret name params override { return cpu::name args; }
  APUS_OPS(APUS_CPU_OP)
  // Host memory: the same allocator host-side staging uses.
  void* allocate(size_t bytes) override { return host_allocator().allocate(bytes); }
  void release(void* p) override { host_allocator().release(p); }
#undef APUS_CPU_OP
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace apus
