#include "models/common/exchange.h"

#include "core/trace.h"
#include "ops/backend.h"

namespace apus {

void all_gather(Context& c, const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what) {
  if (c.cost) c.cost->mark_sent(double(bytes[size_t(group.rank())]) * (group.size() - 1));
  if (c.count_only) return;
  const TraceSpan span(c.trace, "all_gather", "collective");
  Backend& backend = c.backend ? *c.backend : cpu_backend();
  backend.all_gather(group, data, bytes, what);
}

void all_to_all(Context& c, const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes,
                void* recv, const std::vector<size_t>& recv_bytes, const char* what) {
  if (c.cost) {
    double sent = 0;
    for (int j = 0; j < group.size(); ++j)
      if (j != group.rank()) sent += double(send_bytes[size_t(j)]);
    c.cost->mark_sent(sent);
  }
  if (c.count_only) return;
  const TraceSpan span(c.trace, "all_to_all", "collective");
  Backend& backend = c.backend ? *c.backend : cpu_backend();
  backend.all_to_all(group, send, send_bytes, recv, recv_bytes, what);
}

}  // namespace apus
