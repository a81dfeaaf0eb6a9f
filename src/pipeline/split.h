#pragma once
// A request split over processes (issue 43): each step's transformer forward divided over the
// ranks, then every rank's velocities gathered so that each holds all of them and samples on as
// one process would. Classifier-free guidance parallelism divides the samples (a guided request's
// branches, the images of a batch); Ulysses divides every sample's tokens, its attention
// exchanging heads (models/common/sequence_split.h). The linears give the same bits at every row
// count, and each sample's and each head's attention sees the same keys in the same order, so the
// gathered velocities are one process's, bit for bit.
#include <atomic>
#include <cstdint>
#include <string>

#include "apus/apus.h"
#include "core/share.h"
#include "ops/ops.h"

namespace apus {

// The ranks of a split stop together: a server's rank 0 holds the flags its clients set (cancel,
// AUTOMATIC1111's interrupt), and a rank that left the steps alone would leave the others waiting
// in an exchange. Each flag is agreed over the group before every step, and the ops and the step
// loop read the agreed ones. Every rank of the split gives both flags or neither.
class StepAgreement {
 public:
  StepAgreement(const ProcessGroup& group, const std::atomic<bool>* stop, const std::atomic<bool>* finish)
      : group_(group), asked_stop_(stop), asked_finish_(finish) {}
  // An all-gather of every rank's two flags: one set on any rank is set on all.
  void before_step();
  const std::atomic<bool>* stop() const { return &stop_; }
  const std::atomic<bool>* finish() const { return &finish_; }

 private:
  const ProcessGroup& group_;
  const std::atomic<bool>*asked_stop_, *asked_finish_;
  std::atomic<bool> stop_{false}, finish_{false};
};

// "none", "cfg", "ulysses", "tensor", "batch": the CLI's names.
const char* parallel_name(Parallel p);

// Refuses a parallelism this request cannot take (`label`: the model, in the message): a strategy
// without a group, cfg with nothing to split (one sample), tensor on a model holding whole weights,
// anything but tensor over `weights_split` on a model whose weights are split over those ranks, a
// device (null: the CPU) that cannot exchange between the ranks (Backend::exchanges).
void check_parallelism(const Parallelism& p, int64_t samples, const Backend* device, const std::string& label,
                       const ProcessGroup* weights_split = nullptr);

// The group when every rank of the split holds the same request (cfg, ulysses, tensor): the stages
// around the transformer then deal their features or chunks out over it. Null for none and batch
// (each rank its own requests).
const ProcessGroup* ranks_sharing_inputs(const Parallelism& p);

// This rank's samples of `samples` under cfg: all of them otherwise.
Share sample_share(const Parallelism& p, int64_t samples);

// cfg: every rank's rows of `velocity` ([samples * rows, channels], rank r's samples written by
// it) gathered into every rank's copy; counting, files the bytes this rank sends.
void gather_samples(Context& c, const Parallelism& p, int64_t samples, Tensor& velocity);

// Ulysses: each sample's rows of the velocity [samples * rows, channels], every rank holding its
// share of them in `mine` [samples * its rows, channels], gathered into every rank's `velocity`;
// counting, files the bytes this rank sends.
void gather_sequence(Context& c, const Parallelism& p, int64_t samples, const Tensor& mine, Tensor& velocity);

// A transformer forward over x [samples * rows, ...] writing velocity [samples * rows', ...] as the
// request splits it, through forward(first, count, x_part, velocity_part) on samples
// [first, first + count): cfg runs this rank's share of the samples, then gathers every rank's
// velocities; tensor runs them all (the model's linears exchanging features); Ulysses runs every sample on this rank's
// share of its rows (the model's attention exchanging the rest; its prologue holds the same share), then gathers every
// rank's rows.
template <typename Forward> void split_forward(Context& c, const Parallelism& p, int64_t samples, const Tensor& x,
                                               Tensor& velocity, Forward&& forward) {
  if (c.cost) {
    c.cost->mark_divisible();
    c.cost->mark_gather(double(velocity.nbytes()));
  }
  if (p.strategy != Parallel::ulysses) {
    const Share mine = sample_share(p, samples);
    const int64_t in_rows = x.shape[0] / samples, out_rows = velocity.shape[0] / samples;
    if (mine.count > 0) {
      Tensor rows = velocity.rows(mine.first * out_rows, (mine.first + mine.count) * out_rows);
      forward(mine.first, mine.count, x.rows(mine.first * in_rows, (mine.first + mine.count) * in_rows), rows);
    }
    gather_samples(c, p, samples, velocity);
    return;
  }
  ArenaScope arena(*c.arena);
  const int64_t rows = x.shape[0] / samples;
  const Share mine = share_of(rows, p.group->rank(), p.group->size());
  Tensor x_mine = Tensor::in(*c.arena, {samples * mine.count, x.shape[1]}, x.dtype);
  Tensor v_mine = Tensor::in(*c.arena, {samples * mine.count, velocity.shape[1]}, velocity.dtype);
  for (int64_t s = 0; s < samples; ++s) {
    Tensor to = x_mine.rows(s * mine.count, (s + 1) * mine.count);
    ops::copy(c, x.rows(s * rows + mine.first, s * rows + mine.first + mine.count), to);
  }
  forward(0, samples, x_mine, v_mine);
  gather_sequence(c, p, samples, v_mine, velocity);
}

}  // namespace apus
