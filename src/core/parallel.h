#pragma once
// The one way kernels run work on the thread pool (OpenMP's, shared with oneDNN). An exception
// that escapes an OpenMP region calls std::terminate, so every iteration runs under a catch: the
// first error stops the remaining iterations and is rethrown on the calling thread.
#include <atomic>
#include <cstdint>
#include <exception>
#include <vector>

namespace apus {

enum class Schedule { even, dynamic };  // equal-cost iterations, or uneven ones (attention tasks)

template <typename Body> void parallel_for(int64_t n, Body&& body, Schedule schedule = Schedule::even) {
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto run = [&](int64_t i) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body(i);
    } catch (...) {
#pragma omp critical(apus_parallel_error)
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };
  if (schedule == Schedule::dynamic) {
#pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < n; ++i) run(i);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) run(i);
  }
  if (error) std::rethrow_exception(error);
}

// Per-thread fp32 scratch that row kernels reuse from call to call, so the step loop does not
// allocate once every buffer has reached its size. Slots let one kernel hold several rows.
inline float* thread_scratch(int slot, int64_t n) {
  thread_local std::vector<float> buffers[4];
  std::vector<float>& b = buffers[slot];
  if (b.size() < size_t(n)) b.resize(size_t(n));
  return b.data();
}

}  // namespace apus
