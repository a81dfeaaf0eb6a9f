#include "bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>

#include "chart.h"
#include "core/error.h"
#include "core/variants.h"
#include "cost/ceiling.h"
#include "cost/roofline.h"
#include "io/files.h"
#include "ops/backend.h"
#include "pipeline/registry.h"

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
  std::printf("traced request, ops by time (%.3f s in ops):\n%-24s %8s %10s %7s %10s\n", traced_us / 1e6, "op", "calls",
              "seconds", "share", "GFLOP/s");
  for (size_t i = 0; i < std::min<size_t>(kinds.size(), 12); ++i)
    std::printf("%-24s %8lld %10.3f %6.1f%% %10.1f\n", kinds[i].name.c_str(), static_cast<long long>(kinds[i].calls),
                kinds[i].us / 1e6, 100 * kinds[i].us / traced_us,
                kinds[i].us > 0 ? kinds[i].flops / kinds[i].us / 1e3 : 0);
}

// The model a bench runs, either kind, and its one request (seeded, so every repetition does the
// same work).
struct Subject {
  AnyModel model;
  ImageRequest image;
  AudioRequest clip;

  Subject(const BenchOptions& o, Weights weights)
      : model(AnyModel::open(o.model, weights, o.device)), image(o.image), clip(o.audio) {
    if (!image.seed) image.seed = 0;
    if (!clip.seed) clip.seed = 0;
  }
  const std::string& label() const { return model.label(); }
  PipelineCost count() const { return model.audio() ? model.audio()->count(clip) : model.image()->count(image); }

  struct Run {
    std::vector<StageTime> stages;
    std::vector<float> output;  // the image's bytes or the clip's samples
    std::string trace;
    double wall_s;
  };
  // One request; `flip_precision` runs it in the other precision (the parity bound's run).
  Run run(bool trace = false, bool flip_precision = false) {
    image.trace = clip.trace = trace;
    if (flip_precision) image.fp32 = !image.fp32, clip.fp32 = !clip.fp32;
    const auto start = Clock::now();
    Run r;
    if (model.audio()) {
      AudioResult a = model.audio()->generate(clip);
      r.stages = std::move(a.stages);
      r.output = std::move(a.samples);
      r.trace = std::move(a.trace);
    } else {
      ImageResult i = model.image()->generate(image);
      r.stages = std::move(i.stages);
      r.output.assign(i.rgb.begin(), i.rgb.end());
      r.trace = std::move(i.trace);
    }
    r.wall_s = seconds_since(start);
    if (flip_precision) image.fp32 = !image.fp32, clip.fp32 = !clip.fp32;
    return r;
  }
};

double mean_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  APUS_CHECK(a.size() == b.size(), "bench: outputs of ", a.size(), " and ", b.size(), " values");
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += std::abs(double(a[i]) - double(b[i]));
  return a.empty() ? 0 : sum / double(a.size());
}

void write_chart(const std::string& path, const std::string& title, const std::vector<Bar>& bars) {
  const std::string svg = stacked_bars_svg(title, bars);
  write_whole_file(path, svg.data(), svg.size());
  std::fprintf(stderr, "wrote chart %s\n", path.c_str());
}

// "512x512, 4 steps" or "30 s, 8 steps" from a report's request block.
// A report's fields, read by name: a missing one or one of another type is refused naming it (a
// report may be hand-edited or from another version), counts held to what a bench can have run.
const Json& field(const Json& j, const std::string& name) {
  APUS_CHECK(j.is_object() && j.contains(name), "no field '", name, "'");
  return j.at(name);
}
std::string text_field(const Json& j, const std::string& name) {
  const Json& v = field(j, name);
  APUS_CHECK(v.is_string(), "field '", name, "' is ", v.type_name(), ", expected a string");
  return v.get<std::string>();
}
double number_field(const Json& j, const std::string& name) {
  const Json& v = field(j, name);
  APUS_CHECK(v.is_number() && std::isfinite(v.get<double>()), "field '", name, "' is ", v.dump(),
             ", expected a finite number");
  return v.get<double>();
}
const Json& array_field(const Json& j, const std::string& name) {
  const Json& v = field(j, name);
  APUS_CHECK(v.is_array(), "field '", name, "' is ", v.type_name(), ", expected an array");
  return v;
}
int64_t count_field(const Json& j, const std::string& name) {
  const double v = number_field(j, name);
  APUS_CHECK(v >= 0 && v <= 1e9 && v == std::floor(v), "field '", name, "' is ", v,
             ", expected a whole number from 0 to 10^9");
  return int64_t(v);
}

std::string request_text(const Json& request) {
  std::string steps = ", " + std::to_string(count_field(request, "steps")) + " steps";
  if (request.contains("cfg")) {
    char g[32];
    std::snprintf(g, sizeof g, ", cfg %g", number_field(request, "cfg"));
    steps += g;
  }
  if (request.contains("references"))
    steps += ", " + std::to_string(count_field(request, "references")) + " reference image(s)";
  if (request.contains("seconds")) {
    char s[32];
    std::snprintf(s, sizeof s, "%g s", number_field(request, "seconds"));
    return s + steps;
  }
  return std::to_string(count_field(request, "width")) + "x" + std::to_string(count_field(request, "height")) + steps;
}

// Seconds per call of each counted stage in one request, in pipeline order.
std::vector<std::pair<std::string, double>> per_call(const std::vector<StageTime>& stages) {
  std::vector<std::pair<std::string, double>> mean;
  std::vector<int> calls;
  for (const StageTime& t : stages) {
    if (t.stage.empty()) continue;
    auto it = std::find_if(mean.begin(), mean.end(), [&](const auto& m) { return m.first == t.stage; });
    if (it == mean.end()) it = mean.insert(mean.end(), {t.stage, 0.0}), calls.push_back(0);
    it->second += t.seconds;
    ++calls[size_t(it - mean.begin())];
  }
  for (size_t i = 0; i < mean.size(); ++i) mean[i].second /= calls[i];
  return mean;
}

int run_ab(const BenchOptions& o);

}  // namespace

Chip device_ceiling(const std::string& device, bool refresh, bool* cached, std::string* key) {
  Backend* backend = backend_for(device);
  Arena arena(size_t(64) << 20, false, backend ? static_cast<Allocator&>(*backend) : host_allocator());
  Context ctx{&arena};
  ctx.backend = backend;
  if (key) *key = calibration_key(ctx);
  return calibrated_ceiling(ctx, refresh, cached);
}

void forget_device_ceiling(const std::string& device) {
  Backend* backend = backend_for(device);
  Arena arena(size_t(1) << 20, false, backend ? static_cast<Allocator&>(*backend) : host_allocator());
  Context ctx{&arena};
  ctx.backend = backend;
  forget_calibration(ctx);
}

int run_bench(const BenchOptions& o) {
  APUS_CHECK(o.reps >= 1 && o.reps <= 1000 && o.warmup >= 0 && o.warmup <= 100, "bench: --reps ", o.reps,
             " / --warmup ", o.warmup, " outside 1..1000 / 0..100");
  if (!o.ab.empty()) return run_ab(o);
  const auto t0 = Clock::now();
  Subject subject(o, Weights::resident);
  const double load_s = seconds_since(t0);
  const PipelineCost cost = subject.count();
  bool cached = false;
  std::string machine;
  const Chip chip = device_ceiling(o.device, false, &cached, &machine);
  const Json roof = roofline_json(cost, {chip, 1});

  std::vector<double> walls;
  std::map<std::string, std::vector<double>> calls;  // stage -> every call's seconds
  for (int i = 0; i < o.warmup + o.reps; ++i) {
    const Subject::Run run = subject.run();
    if (i < o.warmup) continue;
    walls.push_back(run.wall_s);
    for (const StageTime& t : run.stages)
      if (!t.stage.empty()) calls[t.stage].push_back(t.seconds);
    std::fprintf(stderr, "run %d/%d: %.3f s\n", i - o.warmup + 1, o.reps, run.wall_s);
  }

  Json report;
  report["model"] = subject.label();
  report["kind"] = kind_name(subject.model.kind());
  report["request"] = roof["request"];
  report["reps"] = o.reps;
  report["warmup"] = o.warmup;
  report["load_s"] = load_s;
  report["ceiling"] = {{"bf16_flops_per_s", chip.bf16_flops},
                       {"int8_ops_per_s", chip.int8_ops},
                       {"fp8_flops_per_s", chip.fp8_flops},
                       {"memory_bytes_per_s", chip.memory_bps},
                       {"machine", machine},
                       {"how", chip.note},
                       {"cached", cached},
                       {"file", calibration_file()}};
  report["stages"] = Json::array();
  std::printf("%-16s %6s %10s %10s %10s %10s %12s %8s\n", "stage", "calls", "min", "p50", "max", "floor", "GFLOP/s",
              "share");
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
    report["stages"].push_back({{"name", s.name},
                                {"calls_per_request", s.calls},
                                {"min_s", t.min},
                                {"p50_s", t.p50},
                                {"max_s", t.max},
                                {"flops", s.per_call.flops},
                                {"bytes", bytes},
                                {"achieved_flops_per_s", s.per_call.flops / t.p50},
                                {"achieved_bytes_per_s", bytes / t.p50},
                                {"floor_s", floor},
                                {"ceiling_share", floor / t.p50}});
    std::printf("%-16s %6lld %8.4f s %8.4f s %8.4f s %8.4f s %12.1f %7.1f%%\n", s.name.c_str(),
                static_cast<long long>(s.calls), t.min, t.p50, t.max, floor, s.per_call.flops / t.p50 / 1e9,
                100 * floor / t.p50);
  }
  const Spread wall = spread(walls);
  const double floor_total = roof["total"]["floor_s"].get<double>();
  report["whole_request"] = {{"min_s", wall.min},
                             {"p50_s", wall.p50},
                             {"max_s", wall.max},
                             {"flops", flops_total},
                             {"achieved_flops_per_s", flops_total / wall.p50},
                             {"floor_s", floor_total},
                             {"ceiling_share", floor_total / wall.p50}};
  report["peak_rss_bytes"] = peak_rss_bytes();
  if (!o.chart.empty()) {
    Bar measured{"measured (p50)", {}}, floor{"floor at this machine's ceiling", {}};
    double staged = 0;
    for (const Json& st : report["stages"]) {
      const double calls = st["calls_per_request"].get<double>();
      measured.segments.push_back({st["name"], st["p50_s"].get<double>() * calls});
      floor.segments.push_back({st["name"], st["floor_s"].get<double>() * calls});
      staged += st["p50_s"].get<double>() * calls;
    }
    measured.segments.push_back({"outside the stages", std::max(0.0, wall.p50 - staged)});
    write_chart(o.chart, subject.label() + " " + request_text(report["request"]) + ": each stage against its floor",
                {measured, floor});
  }
  std::printf("%-16s %6s %8.4f s %8.4f s %8.4f s %8.4f s %12.1f %7.1f%%\n", "whole request", "", wall.min, wall.p50,
              wall.max, floor_total, flops_total / wall.p50 / 1e9, 100 * floor_total / wall.p50);
  std::printf("load %.3f s, peak memory %.2f GiB; ceiling %s (%s)\n", load_s,
              double(peak_rss_bytes()) / double(1u << 30), describe_rates(chip).c_str(),
              cached ? "calibration cached" : "calibrated now");
  if (!o.json.empty()) {
    const std::string text = report.dump(1) + "\n";
    write_whole_file(o.json, text.data(), text.size());
  }
  // Traced apart from the timed requests: recording every op's span costs time of its own.
  if (!o.trace.empty()) {
    const std::string trace = subject.run(true).trace;
    write_trace_file(o.trace, trace);
    print_top_ops(Json::parse(trace));
  }
  return 0;
}

void write_trace_file(const std::string& path, const std::string& trace) {
  write_whole_file(path, trace.data(), trace.size());
  std::fprintf(stderr, "wrote trace %s\n", path.c_str());
}

void print_variants() {
  for (const Knob* k : knobs()) {
    std::string choices;
    for (size_t i = 0; i < k->choices().size(); ++i)
      choices += (i ? ", " : "") + k->choices()[i] + (int(i) == k->value() ? " (now)" : "");
    std::printf("%-24s %s\n%-24s   %s\n", k->name().c_str(), choices.c_str(), "", k->about().c_str());
  }
}

namespace {

// --ab KNOB=A,B: both arms on one loaded model in one process, interleaved (A B, then B A, ...) so
// drift in the machine falls on both; each arm must run its own code, and the outputs must agree
// within the parity bound: by default how far this request moves when only its precision changes
// (bf16 against fp32), the disagreement the official code has with itself.
int run_ab(const BenchOptions& o) {
  const size_t eq = o.ab.find('='), comma = o.ab.find(',', eq == std::string::npos ? 0 : eq);
  APUS_CHECK(eq != std::string::npos && comma != std::string::npos && o.ab.find(',', comma + 1) == std::string::npos,
             "--ab ", o.ab, ": expected KNOB=A,B (apus bench --list-variants)");
  Knob& knob = find_knob(o.ab.substr(0, eq));
  const std::string names[2] = {o.ab.substr(eq + 1, comma - eq - 1), o.ab.substr(comma + 1)};
  const int arms[2] = {knob.index_of(names[0]), knob.index_of(names[1])};
  APUS_CHECK(arms[0] != arms[1], "--ab ", o.ab, ": the two arms are the same choice");
  Subject subject(o, Weights::resident);
  const int initial = knob.value();
  std::vector<std::vector<std::pair<std::string, double>>> per_rep[2];  // arm -> rep -> (stage, s per call)
  std::vector<double> walls[2];
  std::vector<int64_t> calls;  // per request, in the order of per_rep's stages
  int64_t took_own[2] = {0, 0}, took_other[2] = {0, 0};
  std::vector<float> outputs[2];
  for (int rep = 0; rep < o.warmup + o.reps; ++rep)
    for (int k = 0; k < 2; ++k) {
      const int arm = rep % 2 ? 1 - k : k;
      knob.set(arms[arm]);
      knob.clear_taken();
      Subject::Run run = subject.run();
      took_own[arm] += knob.taken(arms[arm]);
      took_other[arm] += knob.taken(arms[1 - arm]);
      if (outputs[arm].empty()) outputs[arm] = std::move(run.output);
      if (rep < o.warmup) continue;
      per_rep[arm].push_back(per_call(run.stages));
      if (calls.empty())
        for (const auto& entry : per_rep[arm].back())
          calls.push_back(std::count_if(run.stages.begin(), run.stages.end(),
                                        [&](const StageTime& t) { return t.stage == entry.first; }));
      walls[arm].push_back(run.wall_s);
      std::fprintf(stderr, "rep %d/%d arm %s: %.3f s\n", rep - o.warmup + 1, o.reps, names[arm].c_str(), run.wall_s);
    }
  knob.set(initial);
  for (int arm = 0; arm < 2; ++arm)
    APUS_CHECK(took_own[arm] > 0, "--ab ", o.ab, ": arm ", names[arm], " never ran its code (",
               took_other[arm] > 0 ? "it took " + names[1 - arm] + "'s" : std::string("the knob was never read"),
               "): this machine or request cannot take that choice, so the arms would time the same code");

  const double diff = mean_abs_diff(outputs[0], outputs[1]);
  double bound = o.ab_bound;
  std::string bound_how = "--ab-bound";
  if (bound < 0) {
    // The precision flip runs on the same knob setting as arm A.
    knob.set(arms[0]);
    Subject other(o, Weights::per_stage);
    bound = mean_abs_diff(outputs[0], other.run(false, true).output);
    knob.set(initial);
    bound_how = std::string("this request's output moved by flipping its precision (") +
                (o.image.fp32 || o.audio.fp32 ? "fp32 -> bf16" : "bf16 -> fp32") + ") under arm " + names[0];
  }
  const bool agree = diff <= bound;

  Json report;
  report["model"] = subject.label();
  report["kind"] = kind_name(subject.model.kind());
  report["reps"] = o.reps;
  report["warmup"] = o.warmup;
  report["ab"] = {{"knob", knob.name()},
                  {"about", knob.about()},
                  {"arms", {names[0], names[1]}},
                  {"took", {{names[0], took_own[0]}, {names[1], took_own[1]}}},
                  {"output", {{"mean_abs_diff", diff}, {"bound", bound}, {"bound_how", bound_how}, {"agree", agree}}}};
  // Per stage: each arm's p50 per call over the reps, and B/A per rep (its spread).
  auto row = [&](const std::string& name, const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> ratios;
    for (size_t i = 0; i < a.size(); ++i) ratios.push_back(b[i] / a[i]);
    const Spread sa = spread(a), sb = spread(b), r = spread(ratios);
    std::printf("%-16s %10.4f s %10.4f s %8.3f  [%.3f, %.3f]\n", name.c_str(), sa.p50, sb.p50, sb.p50 / sa.p50, r.min,
                r.max);
    return Json{{"name", name},       {"a_p50_s", sa.p50}, {"b_p50_s", sb.p50}, {"ratio", sb.p50 / sa.p50},
                {"ratio_min", r.min}, {"ratio_max", r.max}};
  };
  std::printf("%s: A = %s, B = %s, %d reps interleaved\n%-16s %12s %12s %8s  %s\n", knob.name().c_str(),
              names[0].c_str(), names[1].c_str(), o.reps, "stage", "A p50", "B p50", "B/A", "B/A per rep");
  report["ab"]["stages"] = Json::array();
  for (size_t j = 0; j < per_rep[0].front().size(); ++j) {
    std::vector<double> a, b;
    for (int i = 0; i < o.reps; ++i) {
      a.push_back(per_rep[0][size_t(i)][j].second);
      b.push_back(per_rep[1][size_t(i)][j].second);
    }
    report["ab"]["stages"].push_back(row(per_rep[0].front()[j].first, a, b));
  }
  report["ab"]["whole_request"] = row("whole request", walls[0], walls[1]);
  if (!o.chart.empty()) {
    std::vector<Bar> bars;
    for (int arm = 0; arm < 2; ++arm) {
      Bar bar{std::string(arm ? "B: " : "A: ") + names[arm] + " (p50)", {}};
      double staged = 0;
      for (size_t j = 0; j < report["ab"]["stages"].size(); ++j) {
        const Json& st = report["ab"]["stages"][j];
        const double seconds = st[arm ? "b_p50_s" : "a_p50_s"].get<double>() * double(calls[j]);
        bar.segments.push_back({st["name"], seconds});
        staged += seconds;
      }
      bar.segments.push_back({"outside the stages", std::max(0.0, spread(walls[arm]).p50 - staged)});
      bars.push_back(bar);
    }
    write_chart(o.chart, subject.label() + ": " + knob.name() + " A/B", bars);
  }
  std::printf("outputs: mean |A - B| %.3g, bound %.3g (%s): %s\n", diff, bound, bound_how.c_str(),
              agree ? "agree" : "DIFFER");
  if (!o.json.empty()) {
    const std::string text = report.dump(1) + "\n";
    write_whole_file(o.json, text.data(), text.size());
  }
  APUS_CHECK(agree, "--ab ", o.ab, ": the arms' outputs differ by mean |A - B| ", diff, ", over the bound ", bound,
             " (", bound_how, "): arm ", names[1], " changes the result, not only the speed");
  return 0;
}

}  // namespace

std::string bench_table(const std::vector<std::string>& reports) {
  auto num = [](const char* f, double v) {
    char b[64];
    std::snprintf(b, sizeof b, f, v);
    return std::string(b);
  };
  std::string bench =
      "| model | request | whole request p50 (share of ceiling) | stages: p50 per call (share) | load | peak RSS | "
      "ceiling |\n"
      "|---|---|---|---|---|---|---|\n";
  std::string ab =
      "| model | request | knob: A vs B | B/A whole request [per-rep spread] | B/A per stage | outputs |\n"
      "|---|---|---|---|---|---|\n";
  // A table cell's text: a '|' would end the cell and a line break the row.
  auto cell = [](const std::string& text) {
    std::string out;
    for (char ch : text) out += ch == '|' ? std::string("\\|") : ch == '\n' || ch == '\r' ? " " : std::string(1, ch);
    return out;
  };
  auto text = [&](const Json& j, const std::string& name) { return cell(text_field(j, name)); };
  bool any_bench = false, any_ab = false;
  for (const std::string& path : reports) {
    try {
      const Json r = Json::parse(read_file(path), nullptr, false);
      APUS_CHECK(r.is_object() && r.contains("model") && (r.contains("stages") || r.contains("ab")),
                 "no 'model' and 'stages' or 'ab' fields: not written by apus bench --json");
      if (r.contains("ab")) {
        const Json& a = field(r, "ab");
        std::string stages;
        for (const Json& st : array_field(a, "stages"))
          stages += (stages.empty() ? "" : ", ") + text(st, "name") + num(" %.3f", number_field(st, "ratio"));
        const Json& w = field(a, "whole_request");
        const Json& arms = field(a, "arms");
        APUS_CHECK(arms.is_array() && arms.size() == 2 && arms[0].is_string() && arms[1].is_string(),
                   "field 'arms' is ", arms.dump(), ", expected two names");
        ab += "| " + text(r, "model") + " | " + text(r, "kind") + ", " + std::to_string(count_field(r, "reps")) +
              " reps | `" + text(a, "knob") + "` " + cell(arms[0].get<std::string>()) + " vs " +
              cell(arms[1].get<std::string>()) + " | " + num("%.3f", number_field(w, "ratio")) +
              num(" [%.3f, ", number_field(w, "ratio_min")) + num("%.3f]", number_field(w, "ratio_max")) + " | " +
              stages + " | mean abs diff " + num("%.3g", number_field(field(a, "output"), "mean_abs_diff")) +
              num(" (bound %.3g) |\n", number_field(field(a, "output"), "bound"));
        any_ab = true;
        continue;
      }
      std::string stages;
      for (const Json& st : array_field(r, "stages"))
        stages += (stages.empty() ? "" : ", ") + text(st, "name") + num(" %.3f s", number_field(st, "p50_s")) +
                  num(" (%.0f %%)", 100 * number_field(st, "ceiling_share"));
      const Json& w = field(r, "whole_request");
      const Json& c = field(r, "ceiling");
      bench += "| " + text(r, "model") + " | " + cell(request_text(field(r, "request"))) + " | **" +
               num("%.2f s**", number_field(w, "p50_s")) + num(" (%.0f %%)", 100 * number_field(w, "ceiling_share")) +
               " | " + stages + " | " + num("%.1f s", number_field(r, "load_s")) + " | " +
               num("%.2f GiB", number_field(r, "peak_rss_bytes") / double(1u << 30)) + " | " +
               num("%.0f GFLOP/s bf16, ", number_field(c, "bf16_flops_per_s") / 1e9) +
               num("%.1f GB/s", number_field(c, "memory_bytes_per_s") / 1e9) + " (" + text(c, "machine") + ") |\n";
      any_bench = true;
    } catch (const Json::exception& e) {
      fail(path, ": not an apus bench report (", e.what(), ")");
    } catch (const Error& e) {
      fail(path, ": not an apus bench report (", e.what(), ")");
    }
  }
  return (any_bench ? bench : "") + (any_bench && any_ab ? "\n" : "") + (any_ab ? ab : "");
}

}  // namespace apus
