#pragma once
// A request's timeline as Chrome trace events (ui.perfetto.dev, chrome://tracing): a span for each
// pipeline interval, counted stage, module scope and op, on the track of the thread that ran it,
// ops carrying their operands and counted FLOPs and bytes. Collected only when a request asks for
// it; a Context without a Trace pays one pointer test per op.
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "core/cost.h"

namespace apus {

class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  Trace();  // timestamps count from here

  // A finished span. category: "pipeline" (a timed interval), "stage" (a counted stage's code),
  // "module" (a cost scope) or "op"; operands and cost only for ops.
  void add(std::string name, const char* category, Clock::time_point start, Clock::time_point end,
           std::string operands = {}, const OpCost* cost = nullptr);
  // {"traceEvents": [...], "displayTimeUnit": "ms"}, thread names as metadata events.
  std::string json() const;

 private:
  struct Event {
    std::string name, operands;
    const char* category;
    int64_t start_ns, duration_ns;
    int thread;
    bool has_cost;
    OpCost cost;
  };
  mutable std::mutex mutex_;
  Clock::time_point origin_;
  std::vector<Event> events_;
};

// A span from construction to destruction; with a null Trace it records nothing.
class TraceSpan {
 public:
  TraceSpan(Trace* trace, std::string name, const char* category, std::string operands = {},
            const OpCost* cost = nullptr);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Trace* trace_;
  std::string name_, operands_;
  const char* category_;
  bool has_cost_ = false;
  OpCost cost_;
  Trace::Clock::time_point start_;
};

}  // namespace apus
