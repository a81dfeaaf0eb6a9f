#pragma once
// The roofline of a pipeline, counted by running the engine's own model code in counting mode
// (configs read, no weights, no arithmetic) and priced against a chip.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/cost.h"
#include "cost/chips.h"

namespace apus {

struct StageCost {
  std::string name;
  int64_t calls = 1;  // e.g. 4 transformer forwards
  OpCost per_call;
  std::vector<CostLog::Entry> modules;  // per call
  // What the collectives need, per call: tensor-parallel all-reduce payload, Ulysses
  // all_to_all payload and the activation handed across a depth-shard boundary, in bytes.
  double tp_allreduce_bytes = 0, ulysses_bytes = 0, boundary_bytes = 0;
  double activation_bytes = 0;  // peak arena use of one call: activations and scratch
};

struct PipelineCost {
  std::string model;
  int width = 0, height = 0, steps = 0;
  std::vector<StageCost> stages;
  double parameters = 0;  // distinct weight elements the stages read
};

// model: a model directory (configs only are read) or a published name the engine carries.
PipelineCost count_klein(const std::string& model, int width, int height, int steps);

struct Roofline {
  Chip chip;
  int chips = 1;
};

// Ring all-reduce, all-gather and all_to_all wire bytes per chip for a payload of s bytes.
double allreduce_wire_bytes(double s, int n);
double allgather_wire_bytes(double s, int n);
double all_to_all_wire_bytes(double s, int n);

// The stable JSON interface (SI units) and the readable table.
nlohmann::json roofline_json(const PipelineCost& p, const Roofline& r);
std::string roofline_table(const PipelineCost& p, const Roofline& r);

}  // namespace apus
