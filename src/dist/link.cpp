#include "dist/link.h"

#include <algorithm>
#include <chrono>

#include "cost/ceiling.h"

namespace apus::dist {

double device_link_bps(const ProcessGroup& group, Backend& device, bool to_all, size_t part, int tries) {
  const size_t n = size_t(group.size());
  if (n == 1) return 0;
  void* send = device.allocate(part * n);
  void* recv = to_all ? device.allocate(part * n) : nullptr;
  const std::vector<size_t> bytes(n, part);
  double best = 1e30;
  for (int i = 0; i < tries; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (to_all) device.all_to_all(group, send, bytes, recv, bytes, "the link measurement");
    else device.all_gather(group, send, bytes, "the link measurement");
    device.synchronize();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  device.release(send);
  if (recv) device.release(recv);
  return double(part) * double(n - 1) / best;
}

LinkRates link_rates(const World& world, Backend* device, bool refresh) {
  LinkRates r;
  if (world.size() == 1) return r;
  r.key = device ? "NCCL | " + world.placement() + " | " + device->hardware() : "MPI | " + world.placement();
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
  // Through the backend's own exchanges (MPI on host memory, NCCL between GPUs). They are not a
  // request's: -v's traffic leaves them out.
  Backend& link = device ? *device : cpu_backend();
  const World::Traffic before = world.traffic();
  const size_t part = size_t(16) << 20;
  const nlohmann::json measured = {{"all_gather_bps", device_link_bps(world, link, false, part, 5)},
                                   {"all_to_all_bps", device_link_bps(world, link, true, part, 5)},
                                   {"how", "16 MiB parts, the best of five"}};
  world.set_traffic(before);
  if (world.rank() == 0) keep_calibration(r.key, measured);
  // Rank 0's rates for all, as a cached entry would be.
  const nlohmann::json entry = nlohmann::json::parse(world.broadcast(measured.dump(), "the link rates"));
  r.all_gather_bps = entry["all_gather_bps"];
  r.all_to_all_bps = entry["all_to_all_bps"];
  return r;
}

}  // namespace apus::dist
