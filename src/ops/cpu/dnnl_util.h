#pragma once
// Shared oneDNN state: one CPU engine, and per thread a stream and a cache of primitives by
// shape key, so the hot loop reuses compiled kernels and threads that run primitives side by
// side (attention heads) never share one primitive's scratchpad.
#include <array>
#include <cstring>
#include <dnnl.hpp>
#include <string>
#include <tuple>
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

// A kernel's identity: its kind and the integers that shape it (dims, strides, dtypes, flags),
// built per call without allocating.
struct KernelKey {
  static constexpr int kMax = 20;
  const char* kind;
  std::array<int64_t, kMax> values{};
  int n = 0;
  KernelKey(const char* k, std::initializer_list<int64_t> v) : kind(k) {
    for (int64_t x : v) {
      if (n == kMax) fail("KernelKey: more than ", kMax, " values");
      values[size_t(n++)] = x;
    }
  }
  bool operator==(const KernelKey& o) const { return n == o.n && values == o.values && std::strcmp(kind, o.kind) == 0; }
  bool operator<(const KernelKey& o) const {
    const int c = std::strcmp(kind, o.kind);
    return c != 0 ? c < 0 : std::tie(n, values) < std::tie(o.n, o.values);
  }
  std::string str() const {
    std::string s = std::string(kind) + "[";
    for (int i = 0; i < n; ++i) {
      if (i) s += ',';
      s += std::to_string(values[size_t(i)]);
    }
    return s + "]";
  }
};

struct KernelKeyHash {
  size_t operator()(const KernelKey& k) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the kind's characters and the values
    for (const char* c = k.kind; *c; ++c) h = (h ^ uint8_t(*c)) * 1099511628211ull;
    for (int i = 0; i < k.n; ++i) h = (h ^ uint64_t(k.values[size_t(i)])) * 1099511628211ull;
    return size_t(h);
  }
};

// oneDNN reports failures (out of memory creating a kernel or its scratchpad, an unsupported
// shape) as dnnl::error; these turn them into apus::Error naming the kernel.
template <typename Prim, typename Make> Prim& cached_primitive(const KernelKey& key, Make&& make) {
  thread_local std::unordered_map<KernelKey, Prim, KernelKeyHash> cache;
  auto it = cache.find(key);
  if (it == cache.end()) {
    try {
      it = cache.emplace(key, make()).first;
    } catch (const dnnl::error& e) {
      fail("oneDNN could not create the kernel for ", key.str(), ": ", e.what(),
           e.status == dnnl_out_of_memory ? " (out of memory)" : "");
    }
  }
  return it->second;
}

template <typename Run> void run_primitive(const KernelKey& key, Run&& run) {
  try {
    run();
    dnnl_stream().wait();
  } catch (const dnnl::error& e) {
    fail("oneDNN failed running the kernel for ", key.str(), ": ", e.what(),
         e.status == dnnl_out_of_memory ? " (out of memory)" : "");
  }
}

}  // namespace apus::cpu
