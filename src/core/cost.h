#pragma once
// Cost accounting: every op reports what it costs under the current module scope, so the cost
// model is counted from the same model code that runs inference (docs/ROOFLINE.md).
#include <cstdint>
#include <string>
#include <vector>

namespace apus {

struct OpCost {
  double flops = 0;
  double weight_bytes = 0;   // parameters read
  double bytes_fused = 0;    // activations: inputs read once, outputs written once
  double bytes_unfused = 0;  // plus every interior tensor written and read back
  OpCost& operator+=(const OpCost& o) {
    flops += o.flops;
    weight_bytes += o.weight_bytes;
    bytes_fused += o.bytes_fused;
    bytes_unfused += o.bytes_unfused;
    return *this;
  }
};

class CostLog {
 public:
  struct Entry {
    std::string path;  // e.g. "dit/single.7/attn"
    OpCost cost;
    int64_t ops = 0;
  };
  void push(const std::string& name) { stack_.push_back(name); }
  void pop() { stack_.pop_back(); }
  void add(const OpCost& c);
  // Module totals in first-seen order.
  const std::vector<Entry>& entries() const { return entries_; }
  OpCost total() const;

 private:
  std::vector<std::string> stack_;
  std::vector<Entry> entries_;
};

// One stage of a request as counted: its modules' cost per call, how often it runs, and the peak
// activation memory one call needs.
struct StageCost {
  std::string name;
  int64_t calls = 1;  // e.g. 4 transformer forwards
  OpCost per_call;
  std::vector<CostLog::Entry> modules;  // per call
  // What the collectives need, per call: tensor-parallel all-reduce payload, Ulysses
  // all_to_all payload and the activation handed across a depth-shard boundary, in bytes.
  double tp_allreduce_bytes = 0, ulysses_bytes = 0, boundary_bytes = 0;
  double activation_bytes = 0;  // peak arena use of one call: activations and scratch
  bool replicated = false;      // not split by tensor or sequence parallelism (a VAE decode)
};

struct PipelineCost {
  std::string model;
  int width = 0, height = 0, steps = 0;
  std::vector<StageCost> stages;
  double parameters = 0;  // distinct weight elements the stages read
};

}  // namespace apus
