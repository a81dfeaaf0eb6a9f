#pragma once
// A backend runs the ops of the list (ops/op_list.h) on one device: all of them, or those its
// supports() answers for. The Context names the backend its ops run on; the front end (ops.cpp)
// checks that the backend runs the op and that every operand lives on its device before
// dispatching. A new backend is a folder src/ops/<name>/ implementing the
// list plus one Backend subclass, and its device name in backend_for (below, ops/backend.cpp);
// model code does not change.
#include <string>
#include <vector>

#include "ops/op_list.h"

namespace apus {

class ProcessGroup;

// A backend is also the allocator of its device: the arena, ops::empty and (on a GPU) weight
// upload take memory through it.
class Backend : public Allocator {
 public:
  Backend(std::string name, Device device, int ordinal) : Allocator(device, ordinal), name_(std::move(name)) {}
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  const std::string& name() const { return name_; }
  // A copy of a contiguous host tensor in this backend's memory (a host backend hands it back),
  // and of one of this backend's tensors on the host (waiting for the ops queued before it).
  virtual Tensor upload(const Tensor& host) = 0;
  virtual Tensor download(const Tensor& t) = 0;
  // Copies a contiguous host tensor into `to`, a contiguous tensor of this backend's memory of the
  // same bytes (an arena's), queued behind the ops before it: no allocation and no wait for the
  // device (an allocation's release would wait for it); the host's bytes may be reused once it
  // returns. What host_filled stages a step's small inputs through (a LoRA's gates, a sigma).
  virtual void upload_into(const Tensor& host, Tensor& to) = 0;
  // Waits for the ops queued so far (a GPU runs them asynchronously): what a timing needs first.
  virtual void synchronize() {}
  // The hardware under the backend in words (a GPU's model, its runtime's version): what a
  // calibration of a device is kept under. The host's is calibration_key's.
  virtual std::string hardware() const { return name(); }
  // The device memory a request must fit in, in bytes (a GPU's total); 0 where the host's memory
  // is the device's (host backends), so the host's budget applies.
  virtual double memory_bytes() const { return 0; }

  // Whether this backend runs `op`. A backend that implements only part of the list says so
  // here, and the front end refuses the rest by name before dispatching (its entries for them are
  // never called); the op table skips them on it.
  virtual bool supports(ops::OpId) const { return true; }
  // Graph recording, for a device's sampler steps under device.steps=graphs (pipeline/stage.h):
  // after begin_graph answers true, the ops called until launch_graph are recorded, not run, and
  // launch_graph queues the recording as one graph (a GPU runs it without a launch from the host
  // per op); abandon_graph drops a recording an op threw in. The host's small inputs staged inside
  // one (upload_into) are kept until the graph has run. False: no recording, the ops run as called.
  virtual bool begin_graph() { return false; }
  virtual void launch_graph() {}
  virtual void abandon_graph() noexcept {}
  // A mark at the end of what is queued so far, and a wait until the device has run up to a mark:
  // how a host queuing steps ahead of a device bounds how far ahead it runs (so that a cancel or
  // an interrupt reaches the steps not yet queued). A backend that runs ops as they are called
  // marks nothing. A mark can be waited for until kQueueMarks more marks were made on its thread.
  static constexpr int kQueueMarks = 8;
  virtual int mark_queue() { return 0; }
  virtual void wait_for_mark(int) {}

  // Why this backend cannot run the linears of a quantised tier's weights (Products::int8 or fp8:
  // core/tensor.h), naming what it lacks, as the one-line refusal `--quant` gets at load; empty
  // where it runs them.
  virtual std::string refuses(Products) const { return {}; }

  // ProcessGroup's exchanges over this backend's memory (every split's exchanges pass here,
  // models/common/exchange.h): a host backend hands its memory to the group (MPI); a GPU's go
  // device to device (NCCL over the group's ranks). exchanges() says whether a split can run here
  // (and if not, why), before a request starts.
  virtual void all_gather(const ProcessGroup& group, void* data, const std::vector<size_t>& bytes,
                          const char* what) = 0;
  virtual void all_to_all(const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes,
                          void* recv, const std::vector<size_t>& recv_bytes, const char* what) = 0;
  virtual bool exchanges(std::string* why) const = 0;

#define APUS_BACKEND_OP(ret, name, params, args) virtual ret name params = 0;
  APUS_OPS(APUS_BACKEND_OP)
#undef APUS_BACKEND_OP

 private:
  std::string name_;
};

// A backend whose memory is host memory (the CPU and reference backends).
class HostBackend : public Backend {
 public:
  explicit HostBackend(std::string name) : Backend(std::move(name), Device::cpu, 0) {}
  void* allocate(size_t bytes) override { return host_allocator().allocate(bytes); }
  void release(void* p) override { host_allocator().release(p); }
  Tensor upload(const Tensor& host) override { return host; }
  Tensor download(const Tensor& t) override { return t; }
  void upload_into(const Tensor& host, Tensor& to) override;
  void all_gather(const ProcessGroup& group, void* data, const std::vector<size_t>& bytes, const char* what) override;
  void all_to_all(const ProcessGroup& group, const void* send, const std::vector<size_t>& send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes, const char* what) override;
  bool exchanges(std::string*) const override { return true; }
};

// A stored weight's encoding for its copy on `device`: its block factors (core/scaled_codes.h)
// uploaded too, so the device's decode reads them from its own memory; and back, for a download
// of such a weight (a DoRA's weight norms read it on the host): the factors brought back with it.
WeightEncoding encoding_on(Backend& device, const WeightEncoding& host);
WeightEncoding encoding_off(Backend& device, const WeightEncoding& on_device);

// The optimised CPU backend: oneDNN GEMMs and convolutions, vectorised row kernels.
Backend& cpu_backend();
// Plain loops in f64 with the op contract's roundings and no library calls: the oracle the op
// tests check every other backend against, op by op.
Backend& reference_backend();

// The backend a device name means: null for "cpu", the GPU's for "cuda" or "cuda:N" (refused with
// the reason where this build or machine has none).
Backend* backend_for(const std::string& device);

}  // namespace apus
