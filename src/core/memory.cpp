#include "core/memory.h"
#include <cstdio>

#include "apus/apus.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>

namespace apus {

namespace {

// A value in bytes from a one-number file ("max" and absent files mean no limit).
double limit_file(const std::string& path) {
  std::ifstream f(path);
  std::string v;
  if (!(f >> v) || v == "max") return INFINITY;
  try {
    return std::stod(v);
  } catch (...) {
    return INFINITY;
  }
}

// Bytes of a "Key:   N kB" line of /proc/self/status.
double status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line))
    if (line.rfind(k, 0) == 0) return std::stod(line.substr(k.size())) * 1024;
  return 0;
}

}  // namespace

uint64_t peak_rss_bytes() { return uint64_t(status_kb("VmHWM")); }

std::string bytes_text(double bytes) {
  char s[32];
  if (bytes >= 1e9) std::snprintf(s, sizeof s, "%.1f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(s, sizeof s, "%.1f MB", bytes / 1e6);
  else std::snprintf(s, sizeof s, "%.0f kB", bytes / 1e3);
  return s;
}

MemoryBudget memory_budget() {
  MemoryBudget b;
  b.resident_bytes = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  b.resident_source = "this machine's RAM";
  // cgroup v2, then v1 (a v1 "no limit" is a huge number, which the min ignores).
  for (const char* p : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const double limit = limit_file(p);
    if (limit < b.resident_bytes) {
      b.resident_bytes = limit;
      b.resident_source = std::string("the cgroup memory limit (") + p + ")";
    }
  }
  rlimit as{};
  b.address_bytes = INFINITY;
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
    b.address_bytes = double(as.rlim_cur) - status_kb("VmSize");
  return b;
}

}  // namespace apus
