#pragma once
// The op layer's front end: model code is written only in these calls. Each op records its cost
// under the current CostScope, returns early in counting mode, checks that its operands live on
// the Context's backend and runs there. The ops and their contracts are listed once in
// ops/op_list.h.
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "core/cost.h"
#include "core/tensor.h"
#include "core/trace.h"
#include "ops/op_list.h"

namespace apus {

class Backend;
class Adapters;

class StepAgreement;

struct Context {
  Arena* arena = nullptr;
  DType act = DType::bf16;             // activation dtype: bf16 (as the official pipeline) or f32 (parity)
  CostLog* cost = nullptr;             // when set, every op reports its cost under the current scope
  bool count_only = false;             // shapes only: ops report and return; tensors may hold no data
  Backend* backend = nullptr;          // where ops run; null: the CPU backend
  Trace* trace = nullptr;              // when set, every module scope and op is a span on it
  const Adapters* adapters = nullptr;  // the request's low-rank adapters (ops/adapters.h): linear applies them
  // Set by the request's owner to end it: every op checks it first and throws "cancelled".
  const std::atomic<bool>* stop = nullptr;
  // Set by the request's owner to end the sampling early: no step starts after it is set, and the
  // later stages run on the latents as they are (AUTOMATIC1111's interrupt).
  const std::atomic<bool>* finish_steps = nullptr;
  // Under a split with either flag given: agrees them over the ranks before every step
  // (pipeline/split.h), stop and finish_steps then pointing at the agreed ones.
  StepAgreement* agreement = nullptr;
};

// Names a module for the cost log, and the trace, for as long as it lives.
class CostScope {
 public:
  CostScope(Context& c, const std::string& name) : log_(c.cost) {
    if (log_) log_->push(name);
    if (c.trace) span_.emplace(c.trace, name, "module");
  }
  ~CostScope() {
    if (log_) log_->pop();
  }
  CostScope(const CostScope&) = delete;
  CostScope& operator=(const CostScope&) = delete;

 private:
  CostLog* log_;
  std::optional<TraceSpan> span_;
};

// Marks the GEMMs inside as the second half of a tensor-parallel pair (attention's output
// projection, the MLP's down projection): their inputs and outputs are what apus's tensor
// parallelism gathers (models/common/tensor_split.h), priced by the roofline.
class RowParallel {
 public:
  explicit RowParallel(Context& c) : log_(c.cost) {
    if (log_) log_->set_row_parallel(true);
  }
  ~RowParallel() {
    if (log_) log_->set_row_parallel(false);
  }
  RowParallel(const RowParallel&) = delete;
  RowParallel& operator=(const RowParallel&) = delete;

 private:
  CostLog* log_;
};

// Records the residual stream between two blocks: where a depth split would cut.
inline void mark_depth_boundary(Context& c, const Tensor& residual) {
  if (c.cost) c.cost->mark_boundary(double(residual.nbytes()));
}

namespace ops {

APUS_DECLARE_OPS

// A tensor that outlives the arena (a stage's output, a table kept across steps); in counting
// mode its shape alone, so counting never allocates activation memory.
Tensor empty(Context& c, Shape shape, DType dtype);

// Host data in the context's memory: the tensor itself on the CPU, its copy on a device; counting
// mode passes shapes through. What pipelines and models build on the host (ids, positions, noise,
// pixels, schedule scalars) reaches the ops through here or host_filled.
Tensor to_context(Context& c, const Tensor& host);
// The host tensor's bytes into `to`, a tensor of the context's device (Backend::upload_into).
void upload_into(Context& c, const Tensor& host, Tensor& to);
// A tensor of the context's memory, in the arena, filled on the host by fill(tensor) (not called
// in counting mode; on a device it fills a host tensor that is then copied into the arena's,
// Backend::upload_into: no device allocation and no wait, so a step may stage its inputs).
template <typename Fill> Tensor host_filled(Context& c, Shape shape, DType dtype, Fill&& fill) {
  Tensor t = Tensor::in(*c.arena, shape, dtype);
  if (c.count_only) return t;
  if (t.device == Device::cpu) {
    fill(t);
    return t;
  }
  Tensor host = Tensor::heap(std::move(shape), dtype);
  fill(host);
  upload_into(c, host, t);
  return t;
}
// ops::empty's tensor filled with zeros (staged from the host on a device).
Tensor zeros(Context& c, Shape shape, DType dtype);
// A result on the host: the tensor itself on the CPU, a copy from a device.
Tensor to_host(Context& c, const Tensor& t);

}  // namespace ops
}  // namespace apus
