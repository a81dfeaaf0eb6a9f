#pragma once
// `--parallel auto`'s memory check (issue 43): whether one process could hold a request, or a
// server's resident model, in what a rank has; if not, the model opens split (tensor).
#include <string>

#include "core/cost.h"

namespace apus {
class Backend;
}

namespace apus::dist {

// Why one process could not hold `cost` (resident: every part's weights at once) in a rank's
// memory: `rank_memory_gib` when given, else the device's own memory (a GPU a rank), else this
// machine's memory or cgroup limit over the `here` ranks on it; empty when it could.
std::string memory_shortfall(const PipelineCost& cost, bool resident, double rank_memory_gib, int here,
                             const Backend* device = nullptr);

}  // namespace apus::dist
