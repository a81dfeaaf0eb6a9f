#pragma once
// The rates between a world's ranks (issue 43), a ceiling as the GEMM's is: measured by `apus
// calibrate` under mpirun (or by the first command that needs them) and kept in the calibration
// cache under the ranks' placement, so that auto prices the splits at them and -v sets each rank's
// time in its exchanges beside what the count's bytes take at them.
#include <algorithm>
#include <string>

#include "dist/world.h"
#include "ops/backend.h"

namespace apus::dist {

struct LinkRates {
  double all_gather_bps = 0, all_to_all_bps = 0;  // what one rank sends per second in each
  bool cached = false;
  std::string key;  // "MPI | 2 ranks on node1 (2)", "NCCL | 2 ranks on node1 (2) | NVIDIA H200 ..."
  // The slower of the two: what the roofline prices every exchange at.
  double bps() const { return std::min(all_gather_bps, all_to_all_bps); }
};

// A collective (every rank calls it, and gets the same rates): the cached rates of this placement,
// or measured now (16 MiB parts, the best of five each) and kept when there are none or `refresh`.
// With a device (null: the CPU) the rates of its exchanges between the ranks' devices (NCCL over
// NVLink or the network), kept under the device's hardware too. One process: zeros.
LinkRates link_rates(const World& world, Backend* device = nullptr, bool refresh = false);

// What one rank sends per second through `device`'s exchanges over `group` (an all-gather of
// `part`-byte parts, or an all-to-all of `part` bytes to each rank), the best of `tries`; 0 for
// one rank.
double device_link_bps(const ProcessGroup& group, Backend& device, bool to_all, size_t part, int tries);

}  // namespace apus::dist
