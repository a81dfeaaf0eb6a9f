#pragma once
// `apus bench`: a model loaded once, warmed up, then N requests timed stage by stage against the
// floors of this machine's calibrated ceiling (docs/BENCH.md describes the JSON).
#include <string>

#include "apus/apus.h"

namespace apus {

struct BenchOptions {
  std::string model;
  ImageRequest image;  // the request when the model makes images
  AudioRequest audio;  // ... and when it makes audio
  int reps = 3, warmup = 1;
  std::string json;    // where to write the JSON report; empty: none
  std::string trace;   // where to write the trace of one more request, untimed; empty: none
};

int run_bench(const BenchOptions& options);

}  // namespace apus
