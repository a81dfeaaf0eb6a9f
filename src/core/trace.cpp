#include "core/trace.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <nlohmann/json.hpp>

namespace apus {

namespace {

int thread_id() { return int(::syscall(SYS_gettid)); }

}  // namespace

Trace::Trace() : origin_(Clock::now()) {}

void Trace::add(std::string name, const char* category, Clock::time_point start, Clock::time_point end,
                std::string operands, const OpCost* cost) {
  Event e{std::move(name),
          std::move(operands),
          category,
          std::chrono::duration_cast<std::chrono::nanoseconds>(start - origin_).count(),
          std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count(),
          thread_id(),
          cost != nullptr,
          cost ? *cost : OpCost{}};
  std::lock_guard lock(mutex_);
  events_.push_back(std::move(e));
}

std::string Trace::json() const {
  std::vector<Event> events;
  {
    std::lock_guard lock(mutex_);
    events = events_;
  }
  // Spans are filed as they end (children first); a viewer reads them in start order, a parent
  // before the children that start with it.
  std::stable_sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
    return a.start_ns != b.start_ns ? a.start_ns < b.start_ns : a.duration_ns > b.duration_ns;
  });
  nlohmann::json out = {{"displayTimeUnit", "ms"}, {"traceEvents", nlohmann::json::array()}};
  auto& list = out["traceEvents"];
  const int pid = int(::getpid());
  std::vector<int> threads;
  for (const Event& e : events) {
    if (std::find(threads.begin(), threads.end(), e.thread) == threads.end()) threads.push_back(e.thread);
    // Microseconds with nanosecond fractions: a child never appears to start before its parent.
    nlohmann::json j = {{"name", e.name},
                        {"cat", e.category},
                        {"ph", "X"},
                        {"ts", double(e.start_ns) / 1e3},
                        {"dur", double(e.duration_ns) / 1e3},
                        {"pid", pid},
                        {"tid", e.thread}};
    if (e.has_cost || !e.operands.empty()) {
      j["args"] = nlohmann::json::object();
      if (!e.operands.empty()) j["args"]["operands"] = e.operands;
      if (e.has_cost)
        j["args"].update(
            {{"flops", e.cost.flops}, {"weight_bytes", e.cost.weight_bytes}, {"activation_bytes", e.cost.bytes_fused}});
    }
    list.push_back(std::move(j));
  }
  for (size_t i = 0; i < threads.size(); ++i)
    list.push_back({{"name", "thread_name"},
                    {"ph", "M"},
                    {"pid", pid},
                    {"tid", threads[i]},
                    {"args", {{"name", i == 0 ? std::string("request") : "request thread " + std::to_string(i)}}}});
  return out.dump();
}

TraceSpan::TraceSpan(Trace* trace, std::string name, const char* category, std::string operands, const OpCost* cost)
    : trace_(trace), category_(category) {
  if (!trace_) return;
  name_ = std::move(name);
  operands_ = std::move(operands);
  if (cost) {
    has_cost_ = true;
    cost_ = *cost;
  }
  start_ = Trace::Clock::now();
}

TraceSpan::~TraceSpan() {
  if (trace_)
    trace_->add(std::move(name_), category_, start_, Trace::Clock::now(), std::move(operands_),
                has_cost_ ? &cost_ : nullptr);
}

}  // namespace apus
