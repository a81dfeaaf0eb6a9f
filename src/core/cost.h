#pragma once
// Cost accounting: every op reports what it costs under the current module scope, so the cost
// model is counted from the same model code that runs inference (docs/ROOFLINE.md).
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace apus {

struct OpCost {
  double flops = 0;
  double weight_bytes = 0;   // parameters read
  double bytes_fused = 0;    // activations: inputs read once, outputs written once
  double bytes_unfused = 0;  // plus every interior tensor written and read back
  // What a multi-chip strategy would move for this op, tagged where it communicates: the input
  // and output of the second GEMM of a tensor-parallel pair (apus's tensor parallelism gathers
  // both: models/common/tensor_split.h) and attention's q, k, v and o (sequence parallelism,
  // Ulysses, all_to_all's them).
  double tp_bytes = 0;
  double ulysses_bytes = 0;
  double int8_ops = 0;  // the part of flops the int8 tier runs as integer products
  double fp8_ops = 0;   // ... and the part the fp8 tier runs as float8 products
  OpCost& operator+=(const OpCost& o) {
    flops += o.flops;
    int8_ops += o.int8_ops;
    fp8_ops += o.fp8_ops;
    weight_bytes += o.weight_bytes;
    bytes_fused += o.bytes_fused;
    bytes_unfused += o.bytes_unfused;
    tp_bytes += o.tp_bytes;
    ulysses_bytes += o.ulysses_bytes;
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
  // Inside a row-parallel scope GEMM outputs are tensor parallelism's all-reduce payload.
  void set_row_parallel(bool on) { row_parallel_ = on; }
  bool row_parallel() const { return row_parallel_; }
  // A point where a depth (pipeline) split would hand `bytes` of activations to the next chip;
  // the largest one per call is what the strategy moves.
  void mark_boundary(double bytes) { boundary_ = std::max(boundary_, bytes); }
  double boundary() const { return boundary_; }
  // What a cfg or Ulysses split gathers here (the velocities of every sample of a transformer
  // forward), whether or not this request splits: summed per call.
  void mark_gather(double bytes) { gather_ += bytes; }
  double gather() const { return gather_; }
  // A transformer forward that cfg and Ulysses splits divide runs here.
  void mark_divisible() { divisible_ = true; }
  bool divisible() const { return divisible_; }
  // The work here comes in `parts` equal pieces that cfg and Ulysses splits deal out over the
  // ranks (SAME's chunks), whether or not this request splits; their outputs are its gather.
  void mark_parts(int64_t parts) { parts_ = parts; }
  int64_t parts() const { return parts_; }
  // Bytes this rank sends the others here under the request's own split (none: 0), summed.
  void mark_sent(double bytes) { sent_ += bytes; }
  double sent() const { return sent_; }
  void add(const OpCost& c);
  // Module totals in first-seen order.
  const std::vector<Entry>& entries() const { return entries_; }
  OpCost total() const;

 private:
  std::vector<std::string> stack_;
  std::vector<Entry> entries_;
  bool row_parallel_ = false;
  double boundary_ = 0;
  double gather_ = 0, sent_ = 0;
  bool divisible_ = false;
  int64_t parts_ = 0;
};

// One stage of a request as counted: its modules' cost per call, how often it runs, and the peak
// activation memory one call needs.
struct StageCost {
  std::string name;
  int64_t calls = 1;  // e.g. 4 transformer forwards
  OpCost per_call;
  std::vector<CostLog::Entry> modules;  // per call
  // The activation a depth split hands across a shard boundary per call (the tensor-parallel and
  // Ulysses payloads are in per_call).
  double boundary_bytes = 0;
  double gather_bytes = 0;      // what a cfg or Ulysses split all-gathers per call (CostLog::mark_gather)
  double sent_bytes = 0;        // what this rank sends per call under the request's split
  double activation_bytes = 0;  // peak arena use of one call: activations and scratch
  double model_bytes = 0;       // the weights of the model running it, as held in memory
  bool replicated = false;      // not split by tensor or sequence parallelism (a VAE decode)
  bool divisible = false;       // what apus's cfg and Ulysses splits divide (CostLog::mark_divisible)
  int64_t parts = 0;            // ... or deal out in pieces (CostLog::mark_parts); 0: neither
};

struct PipelineCost {
  std::string model;
  int width = 0, height = 0, steps = 0;
  double seconds = 0;  // audio requests: the clip's length (width and height stay 0)
  int references = 0;  // image requests: reference images (editing)
  double cfg = 1;      // guidance scale (1: none)
  int samples = 1;     // the transformer's samples per forward: the batch, twice when guided
  std::vector<StageCost> stages;
  double parameters = 0;  // distinct weight elements the stages read
  double held_bytes = 0;  // every part's weights as held in memory (StageCost::model_bytes, once a part)
};

}  // namespace apus
