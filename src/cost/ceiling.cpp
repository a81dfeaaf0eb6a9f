#include "cost/ceiling.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace apus {

namespace {

template <typename Body>
double best_seconds(int runs, Body&& body) {
  double best = 1e30;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

Chip measure_ceiling(Context& c) {
  const int64_t m = 1024, k = 3072, n = 3072;
  Tensor x = ops::empty(c, {m, k}, DType::bf16), w = ops::empty(c, {n, k}, DType::bf16);
  Tensor y = ops::empty(c, {m, n}, DType::bf16);
  // Small values of one sign keep the products finite; what is measured is the rate, not them.
  std::fill_n(x.ptr<uint16_t>(), x.numel(), f32_to_bf16(0.01f));
  std::fill_n(w.ptr<uint16_t>(), w.numel(), f32_to_bf16(0.01f));
  Context bf16 = c;
  bf16.act = DType::bf16;
  bf16.cost = nullptr;
  ops::linear(bf16, x, w, nullptr, y);  // first call builds the kernel
  const double gemm = best_seconds(3, [&] { ops::linear(bf16, x, w, nullptr, y); });
  const int64_t words = int64_t(64) << 20;  // 256 MiB of f32 each way
  Tensor a = ops::empty(c, {words / 1024, 1024}, DType::f32), b = ops::empty(c, {words / 1024, 1024}, DType::f32);
  std::memset(a.data, 0, a.nbytes());
  std::memset(b.data, 0, b.nbytes());
  const double copy = best_seconds(3, [&] { ops::copy(bf16, a, b); });
  Chip chip = find_chip("cpu");
  chip.name = "this machine (measured)";
  chip.bf16_flops = 2.0 * double(m) * double(k) * double(n) / gemm;
  chip.memory_bps = 2.0 * double(a.nbytes()) / copy;
  chip.note = "measured in this process: best of 3 bf16 GEMMs 1024x3072x3072, 256 MiB copies";
  return chip;
}

}  // namespace apus
