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

}  // namespace apus
