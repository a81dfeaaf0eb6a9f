#include "sampling/draws_ahead.h"

#include <algorithm>

#include "core/error.h"

namespace apus {

DrawsAhead::DrawsAhead(const TorchGenerator& generator, std::vector<int64_t> skip, std::vector<int64_t> sizes,
                       int64_t budget)
    : sizes_(std::move(sizes)), budget_(budget), made_(sizes_.size()) {
  thread_ = std::thread([this, generator, skip = std::move(skip)] { produce(generator, skip); });
}

DrawsAhead::~DrawsAhead() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void DrawsAhead::produce(TorchGenerator generator, const std::vector<int64_t>& skip) {
  try {
    std::vector<float> scratch;
    for (const int64_t n : skip) {
      scratch.resize(size_t(n));
      generator.randn(scratch.data(), n);
    }
    for (size_t i = 0; i < sizes_.size(); ++i) {
      {
        // A draw larger than the budget still goes once nothing else waits.
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [&] { return stop_ || held_ == 0 || held_ + sizes_[i] <= budget_; });
        if (stop_) return;
      }
      std::vector<float> values(static_cast<size_t>(sizes_[i]));
      generator.randn(values.data(), sizes_[i]);
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        made_[i] = std::move(values);
        held_ += sizes_[i];
        made_count_ = i + 1;
      }
      changed_.notify_all();
    }
  } catch (...) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      error_ = std::current_exception();
    }
    changed_.notify_all();
  }
}

void DrawsAhead::take(float* out, int64_t n) {
  std::unique_lock<std::mutex> lock(mutex_);
  APUS_CHECK(taken_ < sizes_.size(), "draws ahead: draw ", taken_ + 1, " asked for, ", sizes_.size(), " planned");
  APUS_CHECK(n == sizes_[taken_], "draws ahead: draw ", taken_ + 1, " asked for ", n, " values, planned ",
             sizes_[taken_]);
  changed_.wait(lock, [&] { return made_count_ > taken_ || error_; });
  if (made_count_ <= taken_) std::rethrow_exception(error_);
  std::vector<float> values = std::move(made_[taken_]);
  ++taken_;
  held_ -= n;
  lock.unlock();
  changed_.notify_all();
  std::copy(values.begin(), values.end(), out);
}

}  // namespace apus
