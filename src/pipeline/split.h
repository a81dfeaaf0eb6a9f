#pragma once
// A request split over processes (issue 43). Classifier-free guidance parallelism: a transformer
// forward over S samples of equal rows, each rank running a contiguous share of the samples, then
// every rank's velocity rows gathered so that each holds all of them and samples on as one
// process would. The linears give the same bits at every row count and nothing else mixes
// samples, so the gathered velocities are one process's, bit for bit.
#include <cstdint>
#include <string>

#include "apus/apus.h"
#include "core/share.h"
#include "ops/ops.h"

namespace apus {

// Refuses a parallelism this request cannot take (`label`: the model, in the message): a strategy
// without a group, nothing to split (one sample), or a device without collectives yet.
void check_parallelism(const Parallelism& p, int64_t samples, bool on_device, const std::string& label);

// This rank's samples of `samples`: all of them without a split.
Share sample_share(const Parallelism& p, int64_t samples);

// Every rank's rows of `velocity` ([samples * rows, channels], rank r's samples written by it)
// gathered into every rank's copy; counting, the whole tensor is filed as the gather's payload.
void gather_samples(Context& c, const Parallelism& p, int64_t samples, Tensor& velocity);

// Runs forward(first, count, x_rows, velocity_rows) on this rank's share of the samples of
// x [samples * rows, ...] and gathers the velocities [samples * rows', ...] over the group.
template <typename Forward> void split_forward(Context& c, const Parallelism& p, int64_t samples, const Tensor& x,
                                               Tensor& velocity, Forward&& forward) {
  const Share mine = sample_share(p, samples);
  const int64_t in_rows = x.shape[0] / samples, out_rows = velocity.shape[0] / samples;
  if (mine.count > 0) {
    Tensor rows = velocity.rows(mine.first * out_rows, (mine.first + mine.count) * out_rows);
    forward(mine.first, mine.count, x.rows(mine.first * in_rows, (mine.first + mine.count) * in_rows), rows);
  }
  gather_samples(c, p, samples, velocity);
}

}  // namespace apus
