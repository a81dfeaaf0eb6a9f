#pragma once
// The machine's own ceilings, measured in this process on the backend that runs the request: what
// `-v` prices each stage against, instead of a table entry written on another machine.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cost/chips.h"
#include "ops/ops.h"

namespace apus {

// A bf16 GEMM y[m, n] = x[m, k] w[n, k]^T.
struct GemmShape {
  int64_t m, k, n;
};
// The shapes the ceiling is measured at: the models' own linears.
std::vector<GemmShape> ceiling_shapes();
// One shape's rates (FLOP/s, or OP/s of int8 products) over the runs of `seconds` after a third
// of that in warm-up runs: the bf16 linear, or a quantised tier's (`products`: its weight's).
struct GemmRates {
  double best, median, worst;
  int runs;
};
GemmRates measure_gemm(Context& c, const GemmShape& g, double seconds, Products products = Products::decoded);
// Whether c's backend runs a quantised tier's linear (Backend::refuses): int8 on a GPU and on CPUs
// with exact int8 products (VNNI or AVX2), fp8 on every CPU and on GPUs with fp8 tensor cores.
bool runs_tier(const Context& c, Products products);

// The FLOP rate: the best rate of the bf16 linear over ceiling_shapes() (each warmed up, then
// timed long enough for the clocks to settle; the spread goes into the note); the int8 and fp8
// tiers' rates the same way where runs_tier (0 elsewhere); the memory bandwidth: the best of three
// 256 MiB copies. About three seconds a rate.
Chip measure_ceiling(Context& c);

// "444 GFLOP/s bf16, 760 GOP/s int8, 430 GFLOP/s fp8, 26.1 GB/s" (a tier where the chip has a
// rate for it).
std::string describe_rates(const Chip& chip);

// What a calibration is kept under: on the CPU its model name, the threads the process runs and
// the GEMM library's version; on a device the backend's name and hardware (a change to any of them
// measures again).
std::string calibration_key(const Context& c);
// The file calibrations are cached in: calibration.json under apus_cache_dir(), mapping each key
// to its rates and when they were measured.
std::string calibration_file();
// The calibration cached under `key` (an object), or null; and keeping one (its measured_at
// stamped), replacing what was kept under that key.
nlohmann::json cached_calibration(const std::string& key);
void keep_calibration(const std::string& key, nlohmann::json entry);
// This machine's ceilings: the cached calibration for calibration_key(), or a measurement (then
// cached) when there is none or `refresh`. `cached` says which.
Chip calibrated_ceiling(Context& c, bool refresh = false, bool* cached = nullptr);
// Drops the cached calibration of c's machine (a run beat it: it understated the machine), so the
// next calibrated_ceiling measures again.
void forget_calibration(const Context& c);

}  // namespace apus
