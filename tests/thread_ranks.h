#pragma once
// n ranks as threads of one process (a ProcessGroup each), for proving the splits of issue 43
// without MPI: the exchanges pass through buffers shared between barriers, and each rank counts
// the bytes it sends the others. WidenedBf16 holds the bf16 GEMMs to kernels whose outputs do not
// depend on the call's shape, as bit-for-bit splits need.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cstring>
#include <vector>

#include "apus/apus.h"
#include "ops/cpu/cpu_ops.h"

namespace apus::test {

class ThreadRanks {
 public:
  explicit ThreadRanks(int n) : n_(n), sync_(n), parts_(size_t(n * n)) {}
  class Rank final : public ProcessGroup {
   public:
    Rank(ThreadRanks& all, int rank) : all_(all), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return all_.n_; }
    void all_gather(void* data, const std::vector<size_t>& bytes, const char*) const override {
      size_t at = 0, total = 0;
      for (int r = 0; r < size(); ++r) (r < rank_ ? at : total) += bytes[size_t(r)];
      total += at;
      if (rank_ == 0) all_.buffer_.assign(total, 0);
      all_.sync_.arrive_and_wait();
      std::memcpy(all_.buffer_.data() + at, static_cast<char*>(data) + at, bytes[size_t(rank_)]);
      all_.sync_.arrive_and_wait();
      std::memcpy(data, all_.buffer_.data(), total);
      sent += double(bytes[size_t(rank_)]) * (size() - 1);
      all_.sync_.arrive_and_wait();
    }
    void all_to_all(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes, const char*) const override {
      ++all_to_alls;
      const char* from = static_cast<const char*>(send);
      for (int j = 0; j < size(); ++j) {
        all_.part(rank_, j).assign(from, from + send_bytes[size_t(j)]);
        from += send_bytes[size_t(j)];
        if (j != rank_) sent += double(send_bytes[size_t(j)]);
      }
      all_.sync_.arrive_and_wait();
      char* to = static_cast<char*>(recv);
      for (int i = 0; i < size(); ++i) {
        const std::vector<char>& part = all_.part(i, rank_);
        EXPECT_EQ(part.size(), recv_bytes[size_t(i)]) << "rank " << rank_ << " expects another size from rank " << i;
        std::memcpy(to, part.data(), std::min(part.size(), recv_bytes[size_t(i)]));
        to += recv_bytes[size_t(i)];
      }
      all_.sync_.arrive_and_wait();
    }
    mutable double sent = 0;
    mutable int all_to_alls = 0;

   private:
    ThreadRanks& all_;
    int rank_;
  };

 private:
  std::vector<char>& part(int from, int to) { return parts_[size_t(from * n_ + to)]; }
  int n_;
  std::barrier<> sync_;
  std::vector<char> buffer_;
  std::vector<std::vector<char>> parts_;  // [from][to]
};

// bf16 GEMMs widened to f32 on apus's own kernels while it lives. oneDNN's native bf16 kernels
// (AVX512-BF16, AMX) are chosen by the call's shape: a linear of 32 output features (or of fewer
// rows) can sum an output in another order than the same feature in a call of 64 (seen on an AMX
// Xeon, k 256: one element of 160 a bf16 ulp apart), so a rank's share is not always the whole
// call's bits there.
// The widened kernels compute each output feature alike in any call, as the split needs.
struct WidenedBf16 {
  WidenedBf16() { cpu::native_bf16_knob.set(1); }
  ~WidenedBf16() { cpu::native_bf16_knob.set(0); }
};

}  // namespace apus::test
