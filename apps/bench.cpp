#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cost/ceiling.h"
#include "cost/roofline.h"
#include "io/files.h"

namespace apus {

namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Spread {
  double min = 0, p50 = 0, max = 0;
};

Spread spread(std::vector<double> v) {
  APUS_CHECK(!v.empty(), "bench: a stage without any timing");
  std::sort(v.begin(), v.end());
  return {v.front(), (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2, v.back()};
}

// The traced request's time by op kind, most first: where a stage's distance to its floor goes.
void print_top_ops(const Json& trace) {
  struct Kind {
    std::string name;
    int64_t calls = 0;
    double us = 0, flops = 0;
  };
  std::vector<Kind> kinds;
  double traced_us = 0;
  for (const Json& e : trace["traceEvents"]) {
    if (e.value("cat", "") != "op") continue;
    const std::string name = e["name"];
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const Kind& k) { return k.name == name; });
    if (it == kinds.end()) it = kinds.insert(kinds.end(), Kind{name});
    ++it->calls;
    it->us += e["dur"].get<double>();
    it->flops += e["args"]["flops"].get<double>();
    traced_us += e["dur"].get<double>();
  }
  std::sort(kinds.begin(), kinds.end(), [](const Kind& a, const Kind& b) { return a.us > b.us; });
  std::printf("traced request, ops by time (%.3f s in ops):\n%-24s %8s %10s %7s %10s\n", traced_us / 1e6, "op",
              "calls", "seconds", "share", "GFLOP/s");
  for (size_t i = 0; i < std::min<size_t>(kinds.size(), 12); ++i)
    std::printf("%-24s %8lld %10.3f %6.1f%% %10.1f\n", kinds[i].name.c_str(), static_cast<long long>(kinds[i].calls),
                kinds[i].us / 1e6, 100 * kinds[i].us / traced_us, kinds[i].us > 0 ? kinds[i].flops / kinds[i].us / 1e3 : 0);
}

}  // namespace

int run_bench(const BenchOptions& o) {
  APUS_CHECK(o.reps >= 1 && o.reps <= 1000 && o.warmup >= 0 && o.warmup <= 100, "bench: --reps ", o.reps,
             " / --warmup ", o.warmup, " outside 1..1000 / 0..100");
  const bool audio = is_audio_model(o.model);
  const auto t0 = Clock::now();
  std::unique_ptr<ImageModel> image_model;
  std::unique_ptr<AudioModel> audio_model;
  if (audio) audio_model = AudioModel::open(o.model, Weights::resident);
  else image_model = ImageModel::open(o.model, Weights::resident);
  const double load_s = seconds_since(t0);
  // A seed is fixed so every repetition does the same work.
  ImageRequest image = o.image;
  AudioRequest clip = o.audio;
  if (!image.seed) image.seed = 0;
  if (!clip.seed) clip.seed = 0;
  const PipelineCost cost = audio ? audio_model->count(clip) : image_model->count(image);
  Arena arena;
  Context ctx{&arena};
  bool cached = false;
  const Chip chip = calibrated_ceiling(ctx, false, &cached);
  const Json roof = roofline_json(cost, {chip, 1});

  std::vector<double> walls;
  std::map<std::string, std::vector<double>> calls;  // stage -> every call's seconds
  for (int i = 0; i < o.warmup + o.reps; ++i) {
    const auto start = Clock::now();
    const std::vector<StageTime> stages = audio ? audio_model->generate(clip).stages : image_model->generate(image).stages;
    const double wall = seconds_since(start);
    if (i < o.warmup) continue;
    walls.push_back(wall);
    for (const StageTime& t : stages)
      if (!t.stage.empty()) calls[t.stage].push_back(t.seconds);
    std::fprintf(stderr, "run %d/%d: %.3f s\n", i - o.warmup + 1, o.reps, wall);
  }

  Json report;
  report["model"] = audio ? audio_model->label() : image_model->label();
  report["kind"] = audio ? "audio" : "image";
  report["request"] = roof["request"];
  report["reps"] = o.reps;
  report["warmup"] = o.warmup;
  report["load_s"] = load_s;
  report["ceiling"] = {{"bf16_flops_per_s", chip.bf16_flops}, {"memory_bytes_per_s", chip.memory_bps},
                       {"machine", calibration_key()}, {"how", chip.note}, {"cached", cached},
                       {"file", calibration_file()}};
  report["stages"] = Json::array();
  std::printf("%-16s %6s %10s %10s %10s %10s %12s %8s\n", "stage", "calls", "min", "p50", "max", "floor",
              "GFLOP/s", "share");
  double flops_total = 0;
  for (size_t i = 0; i < cost.stages.size(); ++i) {
    const StageCost& s = cost.stages[i];
    const auto it = calls.find(s.name);
    APUS_CHECK(it != calls.end(), "bench: stage ", s.name, " was counted but never timed");
    const Spread t = spread(it->second);
    const double floor = roof["stages"][i]["per_call"]["floor_s"].get<double>();
    // What the floor prices: parameters read plus activations moved once (the fused count).
    const double bytes = s.per_call.weight_bytes + s.per_call.bytes_fused;
    flops_total += s.per_call.flops * double(s.calls);
    report["stages"].push_back({{"name", s.name}, {"calls_per_request", s.calls}, {"min_s", t.min}, {"p50_s", t.p50},
                                {"max_s", t.max}, {"flops", s.per_call.flops}, {"bytes", bytes},
                                {"achieved_flops_per_s", s.per_call.flops / t.p50},
                                {"achieved_bytes_per_s", bytes / t.p50}, {"floor_s", floor},
                                {"ceiling_share", floor / t.p50}});
    std::printf("%-16s %6lld %8.4f s %8.4f s %8.4f s %8.4f s %12.1f %7.1f%%\n", s.name.c_str(),
                static_cast<long long>(s.calls), t.min, t.p50, t.max, floor, s.per_call.flops / t.p50 / 1e9,
                100 * floor / t.p50);
  }
  const Spread wall = spread(walls);
  const double floor_total = roof["total"]["floor_s"].get<double>();
  report["whole_request"] = {{"min_s", wall.min}, {"p50_s", wall.p50}, {"max_s", wall.max}, {"flops", flops_total},
                             {"achieved_flops_per_s", flops_total / wall.p50}, {"floor_s", floor_total},
                             {"ceiling_share", floor_total / wall.p50}};
  report["peak_rss_bytes"] = peak_rss_bytes();
  std::printf("%-16s %6s %8.4f s %8.4f s %8.4f s %8.4f s %12.1f %7.1f%%\n", "whole request", "", wall.min, wall.p50,
              wall.max, floor_total, flops_total / wall.p50 / 1e9, 100 * floor_total / wall.p50);
  std::printf("load %.3f s, peak memory %.2f GiB; ceiling %.0f GFLOP/s bf16, %.1f GB/s (%s)\n", load_s,
              double(peak_rss_bytes()) / double(1u << 30), chip.bf16_flops / 1e9, chip.memory_bps / 1e9,
              cached ? "calibration cached" : "calibrated now");
  if (!o.json.empty()) {
    const std::string text = report.dump(1) + "\n";
    write_whole_file(o.json, text.data(), text.size());
  }
  // Traced apart from the timed requests: recording every op's span costs time of its own.
  if (!o.trace.empty()) {
    image.trace = clip.trace = true;
    const std::string trace = audio ? audio_model->generate(clip).trace : image_model->generate(image).trace;
    write_whole_file(o.trace, trace.data(), trace.size());
    std::fprintf(stderr, "wrote trace %s\n", o.trace.c_str());
    print_top_ops(Json::parse(trace));
  }
  return 0;
}

}  // namespace apus
