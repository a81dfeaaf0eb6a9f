#pragma once
// The machine's own ceilings, measured in this process on the backend that runs the request: what
// `-v` prices each stage against, instead of a table entry written on another machine.
#include "cost/chips.h"
#include "ops/ops.h"

namespace apus {

// Best of a few runs: a bf16 GEMM of the DiT's shape class ([1024, 3072] x [3072, 3072]^T) for
// the FLOP rate, a 256 MiB copy for the memory bandwidth. About a second.
Chip measure_ceiling(Context& c);

}  // namespace apus
