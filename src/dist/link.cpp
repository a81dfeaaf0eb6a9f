#include "dist/link.h"

#include "cost/ceiling.h"

namespace apus::dist {

LinkRates link_rates(const World& world, bool refresh) {
  LinkRates r;
  if (world.size() == 1) return r;
  r.key = "MPI | " + world.placement();
  // Rank 0 reads the cache for all: the ranks must agree whether to measure.
  std::string kept;
  if (world.rank() == 0 && !refresh) {
    const nlohmann::json entry = cached_calibration(r.key);
    if (entry.is_object() && entry.value("all_gather_bps", 0.0) > 0 && entry.value("all_to_all_bps", 0.0) > 0)
      kept = entry.dump();
  }
  kept = world.broadcast(kept, "the cached link rates");
  if (!kept.empty()) {
    const nlohmann::json entry = nlohmann::json::parse(kept);
    r.all_gather_bps = entry["all_gather_bps"];
    r.all_to_all_bps = entry["all_to_all_bps"];
    r.cached = true;
    return r;
  }
  const nlohmann::json measured = {{"all_gather_bps", world.measure_all_gather_bps()},
                                   {"all_to_all_bps", world.measure_all_to_all_bps()},
                                   {"how", "16 MiB parts, the best of five"}};
  if (world.rank() == 0) keep_calibration(r.key, measured);
  // Rank 0's rates for all, as a cached entry would be.
  const nlohmann::json entry = nlohmann::json::parse(world.broadcast(measured.dump(), "the link rates"));
  r.all_gather_bps = entry["all_gather_bps"];
  r.all_to_all_bps = entry["all_to_all_bps"];
  return r;
}

}  // namespace apus::dist
