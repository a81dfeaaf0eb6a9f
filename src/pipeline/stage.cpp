#include "pipeline/stage.h"

#include <omp.h>

#include <algorithm>

#include "core/error.h"
#include "core/memory.h"
#include "ops/backend.h"

namespace apus {

Knob device_steps_knob("device.steps",
                       "how a device's sampler steps are queued: each checked finite as it ends (a wait a step), "
                       "deferred (the checks read once after the last step), or graphs (deferred, each step after "
                       "the first launched as one recorded graph)",
                       {"checked", "deferred", "graphs"});

StepQueue step_queue_for(const Context& c, bool previews, bool split) {
  if (!c.backend || c.backend->device() == Device::cpu || c.trace || c.count_only) return StepQueue::checked;
  auto queue = StepQueue(device_steps_knob.value());
  if (queue == StepQueue::graphs && (previews || split)) queue = StepQueue::deferred;
  device_steps_knob.took(int(queue));
  return queue;
}

StepGraph::StepGraph(Backend& backend) : backend_(backend), recording_(backend.begin_graph()) {}

StepGraph::~StepGraph() {
  if (recording_) backend_.abandon_graph();
}

void StepGraph::launch() {
  if (!recording_) return;
  recording_ = false;  // a launch that throws has ended the recording itself
  backend_.launch_graph();
}

namespace {
// Address space each pool thread takes beyond the counted stage: its malloc arena (glibc reserves
// 64 MiB per thread), its stack and oneDNN's per-thread scratch and kernels.
constexpr double kThreadAddressAllowance = 128.0 * (1 << 20);

template <typename Request> std::vector<Request> copies(const Request& request, int n, int max) {
  check_batch(n, max);
  std::vector<Request> batch(size_t(n), request);
  for (int i = 1; i < n; ++i)
    batch[size_t(i)].seed = request.seed ? std::optional<uint64_t>(*request.seed + uint64_t(i)) : std::nullopt;
  return batch;
}
}  // namespace

std::vector<ImageRequest> batch_of(const ImageRequest& request, int n) {
  return copies(request, n, ImageLimits::max_batch);
}
std::vector<AudioRequest> batch_of(const AudioRequest& request, int n) {
  return copies(request, n, AudioLimits::max_batch);
}

double memory_need(const PipelineCost& cost, const StageCost& s, bool weights_resident) {
  return (weights_resident ? cost.held_bytes : s.model_bytes) + 2 * s.activation_bytes;
}

std::pair<double, std::string> peak_memory_need(const PipelineCost& cost, bool weights_resident) {
  std::pair<double, std::string> peak{0, ""};
  for (const StageCost& s : cost.stages) peak = std::max(peak, {memory_need(cost, s, weights_resident), s.name});
  return peak;
}

void check_memory(const PipelineCost& cost, bool weights_resident, const std::string& what, const Backend* device) {
  if (device && device->memory_bytes() > 0) {
    for (const StageCost& s : cost.stages) {
      const double need = memory_need(cost, s, weights_resident);
      APUS_CHECK(need <= device->memory_bytes(), what, " needs about ", bytes_text(need), " in its ", s.name,
                 " stage, more than the ", bytes_text(device->memory_bytes()), " of ", device->name(), "'s memory");
    }
    return;
  }
  const MemoryBudget budget = memory_budget();
  for (const StageCost& s : cost.stages) {
    const double need = memory_need(cost, s, weights_resident);
    APUS_CHECK(need <= budget.resident_bytes, what, " needs about ", bytes_text(need), " in its ", s.name,
               " stage, more than the ", bytes_text(budget.resident_bytes), " of ", budget.resident_source);
    const double address_need = need + kThreadAddressAllowance * double(omp_get_max_threads());
    APUS_CHECK(address_need <= budget.address_bytes, what, " needs about ", bytes_text(address_need),
               " of address space in its ", s.name, " stage, more than the ",
               bytes_text(std::max(budget.address_bytes, 0.0)), " the address-space limit (ulimit -v) leaves");
  }
}

}  // namespace apus
