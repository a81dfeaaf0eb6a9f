#pragma once
// The roofline of a request: its counted cost (ImageModel::count, which walks the model's own
// stage code in counting mode) priced against a chip. No model code lives here.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/cost.h"
#include "cost/chips.h"

namespace apus {

struct Roofline {
  Chip chip;
  int chips = 1;
};

// All-gather and all_to_all wire bytes per chip for a payload of s bytes.
double allgather_wire_bytes(double s, int n);
double all_to_all_wire_bytes(double s, int n);

// The stable JSON interface (SI units) and the readable table.
nlohmann::json roofline_json(const PipelineCost& p, const Roofline& r);
std::string roofline_table(const PipelineCost& p, const Roofline& r);

}  // namespace apus
