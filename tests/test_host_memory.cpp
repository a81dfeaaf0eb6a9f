// Host memory: large blocks on transparent huge pages, and arena chunks a finished request hands
// to the next (knobs host.pages and host.arena_chunks).
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "core/tensor.h"
#include "core/variants.h"
#include "test_util.h"

namespace apus {
namespace {

// The kernel's transparent huge page mode: always, madvise or never ("" when it has none).
std::string thp_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  const std::string line((std::istreambuf_iterator<char>(f)), {});
  const size_t open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos ? "" : line.substr(open + 1, close - open - 1);
}

// The THPeligible line of the mapping holding p in /proc/self/smaps (-1 when absent).
int thp_eligible(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool inside = false;
  const auto at = reinterpret_cast<uintptr_t>(p);
  while (std::getline(f, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= at && at < hi;
      continue;
    }
    if (inside && line.rfind("THPeligible:", 0) == 0) return std::stoi(line.substr(12));
  }
  return -1;
}

TEST(HostMemory, LargeBlocksAreHugePageAlignedAndAdvised) {
  Allocator& host = host_allocator();
  const size_t bytes = (size_t(6) << 20) + 4096;
  const std::string mode = thp_mode();
  std::cout << "transparent huge pages: " << (mode.empty() ? "absent" : mode) << "\n";
  void* p = host.allocate(bytes);
  std::memset(p, 1, bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % (size_t(2) << 20), 0u);
  if (mode == "madvise" || mode == "always") EXPECT_EQ(thp_eligible(p), 1) << "a 6 MiB block is not huge-page eligible";
  host.release(p);

  KnobScope small("host.pages", "default");
  void* q = host.allocate(bytes);
  std::memset(q, 1, bytes);
  if (mode == "madvise") EXPECT_EQ(thp_eligible(q), 0) << "a default-pages block was advised huge";
  host.release(q);
}

TEST(HostMemory, FinishedArenasLendTheirChunksToTheNext) {
  const size_t odd = (size_t(5) << 20) + 192;  // a chunk size no other test makes
  const size_t before = pooled_host_bytes();
  void* first = nullptr;
  {
    Arena a(size_t(1) << 20);
    first = a.alloc(odd);
    std::memset(first, 7, odd);
  }
  ASSERT_EQ(pooled_host_bytes(), before + odd);
  {
    Arena b(size_t(1) << 20);
    void* again = b.alloc(odd - 1000);  // the smallest kept chunk that holds it is a's
    EXPECT_EQ(again, first);
    EXPECT_EQ(pooled_host_bytes(), before);
    // A second block in the same chunk still fits; a larger one takes a fresh chunk.
    void* rest = b.alloc(512);
    EXPECT_EQ(static_cast<char*>(rest), static_cast<char*>(first) + ((odd - 1000 + 63) & ~size_t(63)));
    char* big = static_cast<char*>(b.alloc(odd + 4096));
    EXPECT_TRUE(big + odd + 4096 <= first || big >= static_cast<char*>(first) + odd);
    std::memset(big, 3, odd + 4096);
  }
  EXPECT_GE(pooled_host_bytes(), before + odd);

  KnobScope released("host.arena_chunks", "released");
  const size_t kept = pooled_host_bytes();
  {
    Arena c(size_t(1) << 20);
    void* p = c.alloc(odd);
    EXPECT_EQ(pooled_host_bytes(), kept) << "a released-chunks arena took from the pool";
    std::memset(p, 1, odd);
  }
  EXPECT_EQ(pooled_host_bytes(), kept) << "a released-chunks arena kept its chunk";
}

}  // namespace
}  // namespace apus
