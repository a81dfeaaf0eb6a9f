// A program on the engine alone: linked against every object of apus_core and nothing of
// apus_server or apus_hub, so core code that came to call into the server or the hub would fail
// this link. It opens a model directory and counts a request, as an embedding program would.
#include <cstdio>
#include <exception>

#include "apus/apus.h"
#include "core/cost.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR\n", argv[0]);
    return 2;
  }
  try {
    const auto model = apus::ImageModel::open(argv[1], apus::Weights::none);
    const apus::PipelineCost cost = model->count({.prompt = "a lighthouse", .width = 64, .height = 64});
    double flops = 0;
    for (const apus::StageCost& stage : cost.stages) flops += stage.per_call.flops * double(stage.calls);
    std::printf("%s: %zu stages, %.3g FLOPs\n", model->label().c_str(), cost.stages.size(), flops);
    return flops > 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
