#pragma once
// Shared oneDNN state: one CPU engine, and per thread a stream and a cache of primitives by
// shape key, so the hot loop reuses compiled kernels and threads that run primitives side by
// side (attention heads) never share one primitive's scratchpad.
#include <dnnl.hpp>
#include <functional>
#include <string>
#include <unordered_map>

#include "core/error.h"
#include "core/tensor.h"

namespace apus::cpu {

dnnl::engine& dnnl_engine();
dnnl::stream& dnnl_stream();
dnnl::memory::data_type dnnl_type(DType t);
// Whether the CPU runs oneDNN's bf16 GEMM and convolution natively (AVX512-BF16 or AVX-512 core).
// Without it (AVX2 machines, or the knob off) bf16 operands are widened to f32 per call.
bool native_bf16();

// oneDNN reports failures (out of memory creating a kernel or its scratchpad, an unsupported
// shape) as dnnl::error; these turn them into apus::Error naming the kernel.
template <typename Prim>
Prim& cached_primitive(const std::string& key, const std::function<Prim()>& make) {
  thread_local std::unordered_map<std::string, Prim> cache;
  auto it = cache.find(key);
  if (it == cache.end()) {
    try {
      it = cache.emplace(key, make()).first;
    } catch (const dnnl::error& e) {
      fail("oneDNN could not create the kernel for ", key, ": ", e.what(),
           e.status == dnnl_out_of_memory ? " (out of memory)" : "");
    }
  }
  return it->second;
}

template <typename Run>
void run_primitive(const std::string& key, Run&& run) {
  try {
    run();
    dnnl_stream().wait();
  } catch (const dnnl::error& e) {
    fail("oneDNN failed running the kernel for ", key, ": ", e.what(),
         e.status == dnnl_out_of_memory ? " (out of memory)" : "");
  }
}

}  // namespace apus::cpu
