#pragma once
// `apus gate`: is a tier or variant good enough on this model? The seeds' quality gate, computed
// from the model disagreeing with itself. Over a prompt set (prompts x seeds) it renders each
// request three times: fp32 (the reference), bf16 (the model's own precision change) and the
// candidate (bf16 activations with the change: the int8 tier, another checkpoint of the same model,
// or a kernel knob's choice). For each metric (gate/metrics.h) the floor is the bf16 renders'
// scores against fp32 and the threshold is the floor's worst pair; the candidate passes a metric
// when its median over the set is no worse than that threshold, and the gate when it passes every
// metric. The rule is fixed before any render: nothing is tuned to the candidate.
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apus/apus.h"

namespace apus {

struct GateOptions {
  ModelParts reference;         // the model as published
  ModelParts candidate;         // the same model with the change (quant, another file of its weights)
  std::string knob;             // "NAME=CHOICE": a kernel variant the candidate renders with (empty: none)
  int prompts = 10, seeds = 2;  // the first `prompts` of the family's set, seeds 0 .. seeds - 1
  std::optional<int> width, height, steps;
  std::optional<double> seconds;  // audio clips (10 s when not given)
  // Where every render runs, the floor's too ("cpu", "cuda[:N]"): a tier judged as it runs there.
  std::string device = "cpu";
};

struct GateMetric {
  std::string name;
  bool higher_is_better = false;
  std::vector<double> floor, candidate;  // per pair: bf16 and candidate against fp32
  double threshold = 0, floor_median = 0, candidate_median = 0, candidate_worst = 0;
  bool pass = false;
};

struct GateReport {
  std::string model, change, kind;  // kind "image" or "audio"
  std::string device;               // where the renders ran
  std::vector<std::string> pairs;   // "prompt #i, seed s" per pair
  std::vector<GateMetric> metrics;
  bool pass = false;
  nlohmann::json json() const;
  std::string table() const;  // one line per metric, then PASS or FAIL
};

// The family's prompt set (10 each), in order.
const std::vector<std::string>& gate_prompts(bool audio);

// Renders the set and judges it; `progress` gets a line per render.
GateReport run_gate(const GateOptions& o, const std::function<void(const std::string&)>& progress = {});

// The verdict from scores alone (what run_gate applies): threshold, medians, pass.
GateMetric judge(std::string name, bool higher_is_better, std::vector<double> floor, std::vector<double> candidate);

}  // namespace apus
