#pragma once
// A generator's upcoming draws, of sizes known in advance, made on a thread of their own while the
// caller does other work. The values are the generator's, in its order; only when they are made
// changes. Why: SAME's decoder noise is millions of torch CPU normals a chunk (the Mersenne
// Twister is sequential), ~0.4 s of host time for 120 s of audio that a GPU would wait for after
// the DiT; drawn ahead, it is made while the device runs the text encoder and the DiT.
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "sampling/torch_rng.h"

namespace apus {

class DrawsAhead {
 public:
  // Draws `sizes` (torch.randn calls of that many float32 values, in order) from a copy of
  // `generator`, after making and discarding the draws `skip` (what the caller draws from its own
  // copy first). At most `budget` values wait to be taken at a time.
  DrawsAhead(const TorchGenerator& generator, std::vector<int64_t> skip, std::vector<int64_t> sizes, int64_t budget);
  ~DrawsAhead();
  DrawsAhead(const DrawsAhead&) = delete;
  DrawsAhead& operator=(const DrawsAhead&) = delete;

  // The next planned draw into out, waiting until it is made; n must be its planned size.
  void take(float* out, int64_t n);

 private:
  void produce(TorchGenerator generator, const std::vector<int64_t>& skip);

  const std::vector<int64_t> sizes_;
  const int64_t budget_;
  std::vector<std::vector<float>> made_;
  size_t made_count_ = 0, taken_ = 0;
  int64_t held_ = 0;  // values made and not yet taken
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::thread thread_;
};

}  // namespace apus
