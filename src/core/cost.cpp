#include "core/cost.h"

namespace apus {

void CostLog::add(const OpCost& c) {
  std::string path;
  for (const auto& s : stack_) path += (path.empty() ? "" : "/") + s;
  // Consecutive ops of one module land in the same entry; entries keep first-seen order.
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it)
    if (it->path == path) {
      it->cost += c;
      ++it->ops;
      return;
    }
  entries_.push_back({path, c, 1});
}

OpCost CostLog::total() const {
  OpCost t;
  for (const auto& e : entries_) t += e.cost;
  return t;
}

}  // namespace apus
