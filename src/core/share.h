#pragma once
// How work of `count` items splits over `size` ranks (issue 43): rank r takes items
// [first, first + count) in order, the first count % size ranks one more.
#include <algorithm>
#include <cstdint>

namespace apus {

struct Share {
  int64_t first = 0, count = 0;
};

inline Share share_of(int64_t count, int rank, int size) {
  const int64_t base = count / size, extra = count % size;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

}  // namespace apus
