#pragma once
// `apus bench`: a model loaded once, warmed up, then N requests timed stage by stage against the
// floors of this machine's calibrated ceiling (docs/BENCH.md describes the JSON).
#include <string>
#include <vector>

#include "apus/apus.h"
#include "cost/chips.h"

namespace apus {

struct BenchOptions {
  ModelParts model;
  std::string device = "cpu";  // cpu, or cuda[:N]
  ImageRequest image;          // the request when the model makes images
  AudioRequest audio;          // ... and when it makes audio
  int reps = 3, warmup = 1;
  std::string json;      // where to write the JSON report; empty: none
  std::string trace;     // where to write the trace of one more request, untimed; empty: none
  std::string chart;     // where to draw the stages as stacked bars (SVG); empty: none
  std::string ab;        // "KNOB=A,B": a same-process A/B of two choices of a variant knob
  double ab_bound = -1;  // the outputs' largest mean |A - B|; negative: the precision flip's
};

// The calibrated ceilings of a device ("cpu", "cuda:N"): cached or measured now (`cached` says
// which), kept under `key`.
Chip device_ceiling(const std::string& device, bool refresh = false, bool* cached = nullptr,
                    std::string* key = nullptr);
// Drops that device's cached calibration (forget_calibration).
void forget_device_ceiling(const std::string& device);

// Writes a request's trace (Chrome trace-event JSON) to `path` and says so on stderr.
void write_trace_file(const std::string& path, const std::string& trace);

// --list-variants: every knob, its choices (the default first) and what it chooses.
void print_variants();

int run_bench(const BenchOptions& options);

// `apus report`: the Markdown table of bench reports (--json files), one row each: what the
// README's benchmark table is made from.
std::string bench_table(const std::vector<std::string>& reports);

}  // namespace apus
