#pragma once
#include <unistd.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "apus/apus.h"
#include "server/http.h"
#include "server/jobs.h"

namespace apus::server {

// Prometheus text exposition of what the server has done: requests and failures by route,
// the queues, each model's request and stage latencies as histograms, resident memory.
class Metrics {
 public:
  void request(const std::string& route, int status) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++requests_[route];
    if (status >= 400) ++failures_[{route, status}];
  }
  void job(const Job& j, JobState final_state) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++jobs_[{j.model, state_name(final_state)}];
    if (final_state != JobState::done) return;
    observe(latency_[j.model], std::chrono::duration<double>(std::chrono::steady_clock::now() - j.submitted).count());
    for (const auto& [stage, seconds] : j.stages) observe(stages_[{j.model, stage}], seconds);
  }
  // queues: per model, the jobs waiting and whether one runs.
  std::string text(const std::vector<std::tuple<std::string, size_t, bool>>& queues) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    auto line = [&](const std::string& l) { out += l + "\n"; };
    line("# HELP apus_build_info The server's version.");
    line("# TYPE apus_build_info gauge");
    line(std::string("apus_build_info{version=\"") + version() + "\"} 1");
    line("# HELP apus_requests_total HTTP requests by route.");
    line("# TYPE apus_requests_total counter");
    for (const auto& [route, n] : requests_) line("apus_requests_total{route=\"" + route + "\"} " + std::to_string(n));
    line("# HELP apus_request_failures_total HTTP requests answered with an error, by route and status.");
    line("# TYPE apus_request_failures_total counter");
    for (const auto& [key, n] : failures_)
      line("apus_request_failures_total{route=\"" + key.first + "\",status=\"" + std::to_string(key.second) + "\"} " +
           std::to_string(n));
    line("# HELP apus_jobs_total Jobs ended, by model and state.");
    line("# TYPE apus_jobs_total counter");
    for (const auto& [key, n] : jobs_)
      line("apus_jobs_total{model=\"" + key.first + "\",state=\"" + key.second + "\"} " + std::to_string(n));
    line("# HELP apus_queue_depth Jobs waiting per model (the running one not counted).");
    line("# TYPE apus_queue_depth gauge");
    for (const auto& [model, n, running] : queues)
      line("apus_queue_depth{model=\"" + model + "\"} " + std::to_string(n));
    line("# HELP apus_jobs_running Jobs running per model (0 or 1).");
    line("# TYPE apus_jobs_running gauge");
    for (const auto& [model, n, running] : queues)
      line("apus_jobs_running{model=\"" + model + "\"} " + std::string(running ? "1" : "0"));
    histogram(out, "apus_request_seconds", "Submission to result, per model.", latency_,
              [](const std::string& m) { return "model=\"" + m + "\""; });
    histogram(out, "apus_stage_seconds", "Each stage's run (each sampler step on its own), per model.", stages_,
              [](const std::pair<std::string, std::string>& k) {
                return "model=\"" + k.first + "\",stage=\"" + k.second + "\"";
              });
    line("# HELP apus_resident_memory_bytes Resident memory of the server process.");
    line("# TYPE apus_resident_memory_bytes gauge");
    line("apus_resident_memory_bytes " + std::to_string(resident_bytes()));
    return out;
  }

 private:
  struct Histogram {
    std::vector<uint64_t> counts = std::vector<uint64_t>(kBounds.size(), 0);
    double sum = 0;
    uint64_t n = 0;
  };
  static inline const std::vector<double> kBounds = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
  static void observe(Histogram& h, double v) {
    for (size_t i = 0; i < kBounds.size(); ++i)
      if (v <= kBounds[i]) ++h.counts[i];
    h.sum += v;
    ++h.n;
  }
  template <typename Map, typename Labels> static void histogram(std::string& out, const std::string& name,
                                                                 const std::string& help, const Map& m, Labels labels) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    for (const auto& [key, h] : m) {
      const std::string l = labels(key);
      for (size_t i = 0; i < kBounds.size(); ++i) {
        char le[32];
        std::snprintf(le, sizeof le, "%g", kBounds[i]);
        out += name + "_bucket{" + l + ",le=\"" + le + "\"} " + std::to_string(h.counts[i]) + "\n";
      }
      out += name + "_bucket{" + l + ",le=\"+Inf\"} " + std::to_string(h.n) + "\n";
      char sum[32];
      std::snprintf(sum, sizeof sum, "%.6f", h.sum);
      out += name + "_sum{" + l + "} " + sum + "\n" + name + "_count{" + l + "} " + std::to_string(h.n) + "\n";
    }
  }
  static uint64_t resident_bytes() {
    long pages = 0, resident = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
      std::fclose(f);
    }
    return uint64_t(resident) * uint64_t(sysconf(_SC_PAGESIZE));
  }
  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> requests_;
  std::map<std::pair<std::string, int>, uint64_t> failures_;
  std::map<std::pair<std::string, std::string>, uint64_t> jobs_;
  std::map<std::string, Histogram> latency_;
  std::map<std::pair<std::string, std::string>, Histogram> stages_;
};

// A route's name for the metrics: job ids folded into one; requests no route took counted
// together (their paths are the client's to choose).
std::string route_name(const http::Request& req, const std::string& pattern);

}  // namespace apus::server
