#include "dist/memory_check.h"

#include "core/memory.h"
#include "ops/backend.h"
#include "pipeline/stage.h"

namespace apus::dist {

std::string memory_shortfall(const PipelineCost& cost, bool resident, double rank_memory_gib, int here,
                             const Backend* device) {
  const auto [need, stage] = peak_memory_need(cost, resident);
  const double device_memory = device ? device->memory_bytes() : 0;
  std::string source;
  double memory = 0;
  if (rank_memory_gib > 0) {
    memory = rank_memory_gib * double(1 << 30);
    source = "--rank-memory";
  } else if (device_memory > 0) {
    memory = device_memory;
    source = device->name() + "'s memory (each rank its own device)";
  } else {
    const MemoryBudget budget = memory_budget();
    memory = budget.resident_bytes / here;
    source = budget.resident_source + " over the " + std::to_string(here) + " ranks on it";
  }
  if (need <= memory) return "";
  return "one process needs about " + bytes_text(need) + " in its " + stage + " stage, more than the " +
         bytes_text(memory) + " a rank has: " + source;
}

}  // namespace apus::dist
