#pragma once
// What this process may use: the admission check compares a request against it before loading.
#include <cstdint>
#include <string>

namespace apus {

struct MemoryBudget {
  double resident_bytes;  // physical RAM, lowered by a cgroup memory limit
  std::string resident_source;
  double address_bytes;  // free address space under RLIMIT_AS (infinite when unlimited)
};
MemoryBudget memory_budget();

// A size for messages: "3.2 GB", "45.1 MB", "12 kB".
std::string bytes_text(double bytes);

}  // namespace apus
