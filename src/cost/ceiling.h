#pragma once
// The machine's own ceilings, measured in this process on the backend that runs the request: what
// `-v` prices each stage against, instead of a table entry written on another machine.
#include "cost/chips.h"
#include "ops/ops.h"

namespace apus {

// Best of a few runs: a bf16 GEMM of the DiT's shape class ([1024, 3072] x [3072, 3072]^T) for
// the FLOP rate, a 256 MiB copy for the memory bandwidth. About a second.
Chip measure_ceiling(Context& c);

// What a calibration is kept under: on the CPU its model name, the threads the process runs and
// the GEMM library's version; on a device the backend's name and hardware (a change to any of them
// measures again).
std::string calibration_key(const Context& c);
// The file calibrations are cached in: calibration.json under apus_cache_dir(), mapping each key
// to its rates and when they were measured.
std::string calibration_file();
// This machine's ceilings: the cached calibration for calibration_key(), or a measurement (then
// cached) when there is none or `refresh`. `cached` says which.
Chip calibrated_ceiling(Context& c, bool refresh = false, bool* cached = nullptr);

}  // namespace apus
