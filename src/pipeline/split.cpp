#include "pipeline/split.h"

#include <vector>

#include "core/error.h"
#include "models/common/exchange.h"
#include "ops/backend.h"

namespace apus {

void ProcessGroup::lose(const std::string& message) const { throw Error(message); }

void StepAgreement::before_step() {
  const int n = group_.size();
  std::vector<uint8_t> flags(size_t(2 * n), 0);
  auto asked = [](const std::atomic<bool>* f) { return f && f->load(std::memory_order_relaxed); };
  flags[size_t(2 * group_.rank())] = asked(asked_stop_);
  flags[size_t(2 * group_.rank()) + 1] = asked(asked_finish_);
  group_.all_gather(flags.data(), std::vector<size_t>(size_t(n), 2), "agreeing whether the steps go on");
  for (int r = 0; r < n; ++r) {
    if (flags[size_t(2 * r)]) stop_ = true;
    if (flags[size_t(2 * r) + 1]) finish_ = true;
  }
}

const char* parallel_name(Parallel p) {
  switch (p) {
    case Parallel::none:
      return "none";
    case Parallel::cfg:
      return "cfg";
    case Parallel::ulysses:
      return "ulysses";
    case Parallel::tensor:
      return "tensor";
    case Parallel::batch:
      return "batch";
  }
  return "?";
}

void check_parallelism(const Parallelism& p, int64_t samples, const Backend* device, const std::string& label,
                       const ProcessGroup* weights_split) {
  if (weights_split)
    APUS_CHECK(p.strategy == Parallel::tensor && p.group == weights_split, label,
               ": its transformer's weights are split over ", weights_split->size(),
               " ranks (opened for parallel tensor): every request runs as parallel tensor over them, not ",
               parallel_name(p.strategy), p.strategy == Parallel::tensor ? " over other ranks" : "");
  if (p.strategy == Parallel::none) return;
  const char* name = parallel_name(p.strategy);
  APUS_CHECK(p.group, label, ": a split over processes needs their group (none was given)");
  APUS_CHECK(p.strategy != Parallel::tensor || weights_split, label,
             ": parallel tensor runs a model whose transformer was opened split over the ranks ",
             "(ModelParts::tensor_ranks; the CLI's --parallel tensor), and this one holds its weights whole");
  APUS_CHECK(p.strategy != Parallel::cfg || samples > 1, label,
             ": parallel cfg splits the transformer's samples, and this request has one ",
             "(unguided, one output): guide it (cfg > 1) or ask for several outputs");
  std::string why;
  APUS_CHECK(!device || device->exchanges(&why), label, ": parallel ", name, " on ", device->name(), ": ", why);
}

const ProcessGroup* ranks_sharing_inputs(const Parallelism& p) {
  return p.strategy == Parallel::none || p.strategy == Parallel::batch ? nullptr : p.group;
}

Share sample_share(const Parallelism& p, int64_t samples) {
  if (p.strategy != Parallel::cfg) return {0, samples};
  return share_of(samples, p.group->rank(), p.group->size());
}

void gather_samples(Context& c, const Parallelism& p, int64_t samples, Tensor& velocity) {
  if (p.strategy != Parallel::cfg) return;
  const int n = p.group->size();
  const size_t sample_bytes = velocity.nbytes() / size_t(samples);
  std::vector<size_t> bytes;
  for (int r = 0; r < n; ++r) bytes.push_back(size_t(share_of(samples, r, n).count) * sample_bytes);
  all_gather(c, *p.group, velocity.data, bytes, "the transformer's velocities");
}

void gather_sequence(Context& c, const Parallelism& p, int64_t samples, const Tensor& mine, Tensor& velocity) {
  const int n = p.group->size(), me = p.group->rank();
  const int64_t rows = velocity.shape[0] / samples, channels = velocity.shape[1];
  const size_t row_bytes = dtype_bytes(velocity.dtype, channels);
  // Gathered rank after rank (each rank's rows of every sample), then put in sample order.
  ArenaScope arena(*c.arena);
  Tensor gathered = Tensor::in(*c.arena, velocity.shape, velocity.dtype);
  std::vector<size_t> bytes;
  for (int r = 0; r < n; ++r) bytes.push_back(size_t(samples * share_of(rows, r, n).count) * row_bytes);
  const Share own = share_of(rows, me, n);
  Tensor slot = gathered.rows(samples * own.first, samples * (own.first + own.count));
  if (own.count > 0) ops::copy(c, mine, slot);
  all_gather(c, *p.group, gathered.data, bytes, "the transformer's velocities");
  for (int r = 0; r < n; ++r) {
    const Share s = share_of(rows, r, n);
    for (int64_t b = 0; b < samples && s.count > 0; ++b) {
      Tensor to = velocity.rows(b * rows + s.first, b * rows + s.first + s.count);
      ops::copy(c, gathered.rows(samples * s.first + b * s.count, samples * s.first + (b + 1) * s.count), to);
    }
  }
}

}  // namespace apus
