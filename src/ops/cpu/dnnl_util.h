#pragma once
// Shared oneDNN state: one CPU engine and stream, and a cache of primitives by shape key,
// so the hot loop reuses compiled kernels instead of re-creating them every call.
#include <dnnl.hpp>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

#include "core/tensor.h"

namespace apus::cpu {

dnnl::engine& dnnl_engine();
dnnl::stream& dnnl_stream();
dnnl::memory::data_type dnnl_type(DType t);

template <typename Prim>
Prim& cached_primitive(const std::string& key, const std::function<Prim()>& make) {
  static std::unordered_map<std::string, Prim> cache;
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make()).first;
  return it->second;
}

}  // namespace apus::cpu
