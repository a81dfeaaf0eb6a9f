// The CPU backend object: the op list's entries forwarded to the kernels of this folder.
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"

namespace apus {

namespace {

class CpuBackend final : public HostBackend {
 public:
  CpuBackend() : HostBackend("cpu") {}
  // fp8's products are exact in the bf16 (or widened fp32) GEMM of every CPU; int8's need VNNI or AVX2.
  std::string refuses(Products p) const override {
    if (p != Products::int8 || cpu::exact_int8_products()) return {};
    return "--quant int8 needs a CPU with VNNI (AVX512-VNNI, AVX-VNNI or AMX) or AVX2, where its int8 products are "
           "exact; this one has neither";
  }
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
