#pragma once
// What the requests of a batch must share, said once per family beside its request type (issue
// 41): each shared setting as a name and a comparison, and a compile-time count that fails when the
// request type gains a field listed neither as shared nor as one of the per-sample fields (a field
// forgotten here would silently mix settings in a batch).
#include <algorithm>
#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "core/error.h"

namespace apus {

namespace detail {
struct AnyField {
  template <typename T> operator T() const;
};
}  // namespace detail

// The number of fields of an aggregate whose members are not themselves aggregates.
template <typename T, typename... Fields> consteval std::size_t field_count() {
  if constexpr (requires { T{Fields{}..., detail::AnyField{}}; }) return field_count<T, Fields..., detail::AnyField>();
  else return sizeof...(Fields);
}

template <typename Request> struct SharedSetting {
  const char* name;
  bool (*same)(const Request&, const Request&);
};

// The same adapters, in the same order, at the same scales.
inline bool same_loras(const std::vector<Lora>& a, const std::vector<Lora>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const Lora& x, const Lora& y) { return x.file == y.file && x.scale == y.scale; });
}

inline bool same_parallelism(const Parallelism& a, const Parallelism& b) {
  return a.strategy == b.strategy && a.group == b.group;
}

// Refuses a batch whose requests differ in a shared setting, naming the first that does.
template <typename Request, std::size_t N>
void check_batch_shares(const std::vector<Request>& requests, const std::array<SharedSetting<Request>, N>& shared) {
  for (std::size_t i = 1; i < requests.size(); ++i)
    for (const SharedSetting<Request>& s : shared)
      if (!s.same(requests[i], requests.front())) {
        std::string all;
        for (const SharedSetting<Request>& t : shared) all += std::string(all.empty() ? "" : ", ") + t.name;
        fail("a batch shares ", s.name, ": request ", i + 1, "'s differs from the first's (a batch's requests share ",
             all, ")");
      }
}

}  // namespace apus
