#pragma once
// What every model family's pipeline shares: counting a stage, timing stages, admitting a request
// against the memory this process may use.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"
#include "core/cost.h"
#include "core/error.h"
#include "core/variants.h"
#include "ops/ops.h"

namespace apus {

// Runs `body` once in counting mode (shape-only tensors, a measuring arena, activations in `act`,
// the request's) and files what it cost as one stage run `calls` times per request.
template <typename Body> StageCost count_stage(const std::string& name, int64_t calls, DType act, Body&& body) {
  CostLog log;
  Arena arena(size_t(64) << 20, /*measure_only=*/true);
  Context c{&arena, act, &log, true};
  body(c);
  StageCost s;
  s.name = name;
  s.calls = calls;
  s.activation_bytes = double(arena.high_water());
  s.per_call = log.total();
  s.modules = log.entries();
  s.boundary_bytes = log.boundary();
  s.gather_bytes = log.gather();
  s.sent_bytes = log.sent();
  s.divisible = log.divisible();
  s.parts = log.parts();
  return s;
}

// Appends the wall time since the previous stop to a result's stage list (and, tracing, the
// interval as a span).
class StageClock {
 public:
  StageClock(std::vector<StageTime>& out, Trace* trace) : out_(out), trace_(trace) {}
  void stop(const std::string& name, const std::string& stage = "") { stop_evenly({name}, stage); }
  // The time since the previous stop shared evenly by `names`, in order (steps queued without a
  // wait between them, whose own times the host does not see); returns each one's share.
  double stop_evenly(const std::vector<std::string>& names, const std::string& stage = "") {
    const auto now = std::chrono::steady_clock::now();
    const auto share = (now - start_) / std::max<int64_t>(int64_t(names.size()), 1);
    for (const std::string& name : names) {
      out_.push_back({name, stage, std::chrono::duration<double>(share).count()});
      if (trace_) trace_->add(name, "pipeline", start_, start_ + share);
      start_ += share;
    }
    start_ = now;
    return std::chrono::duration<double>(share).count();
  }

 private:
  std::vector<StageTime>& out_;
  Trace* trace_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// A trace for a batch when any of its requests asks for one, else none.
template <typename Request> std::unique_ptr<Trace> trace_if_asked(const std::vector<Request>& requests) {
  const bool asked = std::any_of(requests.begin(), requests.end(), [](const Request& r) { return r.trace; });
  return asked ? std::make_unique<Trace>() : nullptr;
}

// Runs the code of the counted stage `stage` (what count_stage walked), traced as one span of
// that name: a trace's ops per stage can be held against the count.
template <typename Body> void run_stage(Context& c, const char* stage, Body&& body) {
  const TraceSpan span(c.trace, stage, "stage");
  body();
}

// The error of a stage whose output holds NaN or Inf.
inline std::string nonfinite_error(const std::string& stage) {
  return stage + " produced NaN or Inf (from a non-finite weight, noise value or setting upstream)";
}
// Stops the request when a stage's output holds NaN or Inf: an image or a sound from it would be
// garbage, and its cast to integers undefined.
inline void require_finite(Context& c, const Tensor& t, const std::string& stage) {
  APUS_CHECK(ops::all_finite(c, t), nonfinite_error(stage));
}

// How a device's sampler steps are queued (the knob device.steps): each checked finite as it ends
// (a wait for the device a step; what a host backend always does), deferred (the checks' answers
// left on the device by nonfinite_flag and read once after the last step: the host queues step
// after step while the device runs), or graphs (deferred, and every step after the first
// recorded and launched as one graph: a launch a step in place of one an op; the first step, run
// as called, warms what is set up once: libraries' handles, algorithms, the arena's memory).
enum class StepQueue { checked, deferred, graphs };
extern Knob device_steps_knob;
// The queue of a batch's steps on c's backend: checked on a host backend, under a trace (it waits
// for every op) and in counting mode; deferred in place of graphs where a step reads its state on
// the host (previews) or exchanges over a split's ranks.
StepQueue step_queue_for(const Context& c, bool previews, bool split);

// A step recorded as one graph on `backend` for as long as it lives (where the backend records
// one): launched by launch(), dropped if the step threw before.
class StepGraph {
 public:
  explicit StepGraph(Backend& backend);
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;
  ~StepGraph();
  void launch();

 private:
  Backend& backend_;
  bool recording_;
};

// "transformer step i+1": how a step's time is filed; with "/n" how an error names it.
inline std::string step_label(int i) { return "transformer step " + std::to_string(i + 1); }
inline std::string step_name(int i, int n) { return step_label(i) + "/" + std::to_string(n); }
inline std::string step_line(int i, int n, float sigma, double seconds) {
  char line[96];
  std::snprintf(line, sizeof line, "step %d/%d  sigma %.4f  %.2f s", i + 1, n, double(sigma), seconds);
  return line;
}

// Runs body on the resident model, or loads one for this stage and releases it after.
template <typename Model, typename Load, typename Body>
void with_model(const std::optional<Model>& resident, Load&& load, Body&& body) {
  if (resident) return body(*resident);
  const Model m = load();
  m.make_resident();
  body(m);
}

// Runs sampler step i of n, checks `state` (the latents it updates) finite, reports
// "step i/n  sigma s  t s" through `say` and files the time as "transformer step i" of `stage`.
template <typename Step> void timed_step(Context& c, StageClock& clock, const Progress& say, int i, int n, float sigma,
                                         const Tensor& state, const char* stage, Step&& step) {
  const auto t0 = std::chrono::steady_clock::now();
  step();
  require_finite(c, state, step_name(i, n));
  say(step_line(i, n, sigma, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
  clock.stop(step_label(i), stage);
}

// A batch of 1..max requests; refused naming "batch", which a front end calls its own (the CLI's
// -n, the server's n).
inline void check_batch(int64_t batch, int max) {
  APUS_CHECK_FIELD(batch >= 1 && batch <= max, "batch", "batch ", batch, " outside 1..", max);
}

// The memory stage `s` of `cost` needs: its model's weights as held (every part's when the model
// is resident) plus twice its counted activations (for the backend's own scratch).
double memory_need(const PipelineCost& cost, const StageCost& s, bool weights_resident);
// The largest of them, and its stage's name.
std::pair<double, std::string> peak_memory_need(const PipelineCost& cost, bool weights_resident);

// Refuses a request whose largest stage would not fit in the memory this process may use
// (memory_need), against RAM, a cgroup limit and the address space `ulimit -v` leaves. A clear error instead of the OOM
// killer or a failed allocation halfway. On a device with memory of its own (Backend::memory_bytes), weights and
// activations are held to that.
void check_memory(const PipelineCost& cost, bool weights_resident, const std::string& what,
                  const Backend* device = nullptr);

}  // namespace apus
