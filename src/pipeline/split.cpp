#include "pipeline/split.h"

#include <vector>

#include "core/error.h"
#include "core/trace.h"

namespace apus {

void check_parallelism(const Parallelism& p, int64_t samples, bool on_device, const std::string& label) {
  if (p.strategy == Parallel::none) return;
  APUS_CHECK(p.group, label, ": a split over processes needs their group (none was given)");
  APUS_CHECK(samples > 1, label, ": parallel cfg splits the transformer's samples, and this request has one ",
             "(unguided, one output): guide it (cfg > 1) or ask for several outputs");
  APUS_CHECK(!on_device, label, ": parallel cfg on a device gathers over NCCL, not built yet (issue 43)");
}

Share sample_share(const Parallelism& p, int64_t samples) {
  if (p.strategy == Parallel::none) return {0, samples};
  return share_of(samples, p.group->rank(), p.group->size());
}

void gather_samples(Context& c, const Parallelism& p, int64_t samples, Tensor& velocity) {
  // Marked split or not: what the roofline prices a cfg split of this request by.
  if (c.cost && samples > 1) c.cost->mark_gather(double(velocity.nbytes()));
  if (p.strategy == Parallel::none) return;
  const int n = p.group->size();
  const size_t sample_bytes = velocity.nbytes() / size_t(samples);
  std::vector<size_t> bytes;
  for (int r = 0; r < n; ++r) bytes.push_back(size_t(share_of(samples, r, n).count) * sample_bytes);
  if (c.cost) c.cost->mark_sent(double(bytes[size_t(p.group->rank())]) * (n - 1));
  if (c.count_only) return;
  const TraceSpan span(c.trace, "all_gather", "collective");
  p.group->all_gather(velocity.data, bytes, "the transformer's velocities");
}

}  // namespace apus
