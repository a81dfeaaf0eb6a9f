#include "cost/ceiling.h"

#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/cache_dir.h"
#include "io/files.h"
#include "io/weights/quant_weights.h"
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"

namespace apus {

namespace {

using Clock = std::chrono::steady_clock;

// A body's run times: at least `min_runs`, and on until `seconds` have passed, after `warmup`
// seconds of runs that are not kept (clocks ramp up, caches and the primitive are built).
template <typename Body> std::vector<double> run_times(double warmup, double seconds, int min_runs, Body&& body) {
  const auto since = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  for (const auto t0 = Clock::now(); since(t0) < warmup;) body();
  std::vector<double> times;
  for (const auto t0 = Clock::now(); int(times.size()) < min_runs || since(t0) < seconds;) {
    const auto t = Clock::now();
    body();
    times.push_back(since(t));
  }
  std::sort(times.begin(), times.end());
  return times;
}

}  // namespace

std::vector<GemmShape> ceiling_shapes() {
  // klein's linears at 1024 image tokens (attention out, 3072 square) and at 1536 tokens (the
  // fused qkv, 3072 -> 9216), Stable Audio 3 medium's at 30 s (452 tokens, 1536 -> 7680 qkv).
  return {{1024, 3072, 3072}, {1536, 3072, 9216}, {452, 1536, 7680}};
}

bool runs_tier(const Context& c, Products p) { return (c.backend ? *c.backend : cpu_backend()).refuses(p).empty(); }

namespace {

// The tiers a calibration measures, each with its rate in a Chip and its key in the cache.
struct TierRate {
  Products products;
  double Chip::*rate;
  const char* key;
  const char* how;
};
constexpr TierRate kTierRates[] = {
    {Products::decoded, &Chip::bf16_flops, "bf16_flops",
     "bf16 GEMM best rate over the models' shapes, each warmed 0.25 s then timed 0.75 s (G[FL]OP/s best / median / "
     "worst):"},
    {Products::int8, &Chip::int8_ops, "int8_ops", " int8 GEMM (the int8 tier's linear):"},
    {Products::fp8, &Chip::fp8_flops, "fp8_flops", " fp8 GEMM (the fp8 tier's linear):"},
};

}  // namespace

GemmRates measure_gemm(Context& c, const GemmShape& g, double seconds, Products products) {
  // Small values of one sign keep the products finite; what is measured is the rate, not them.
  auto small = [&](Shape s) {
    Tensor t = Tensor::heap(std::move(s), DType::bf16);
    std::fill_n(t.ptr<uint16_t>(), t.numel(), f32_to_bf16(0.01f));
    return t;
  };
  const Tensor x = ops::to_context(c, small({g.m, g.k}));
  const Tensor w = ops::to_context(c, quantize_tier_weight(small({g.n, g.k}), products, "ceiling"));
  Tensor y = ops::empty(c, {g.m, g.n}, DType::bf16);
  Context bf16 = c;
  bf16.act = DType::bf16;
  bf16.cost = nullptr;
  const std::vector<double> times = run_times(seconds / 3, seconds, 5, [&] {
    ops::linear(bf16, x, w, nullptr, y);
    if (c.backend) c.backend->synchronize();
  });
  const double flops = 2.0 * double(g.m) * double(g.k) * double(g.n);
  return {flops / times.front(), flops / times[times.size() / 2], flops / times.back(), int(times.size())};
}

Chip measure_ceiling(Context& c) {
  Chip chip = find_chip("cpu");
  chip.name = "this machine (measured)";
  std::string how;
  for (const TierRate& tier : kTierRates) {
    double& best = chip.*tier.rate;
    best = 0;
    if (!runs_tier(c, tier.products)) continue;
    how += tier.how;
    for (const GemmShape& g : ceiling_shapes()) {
      const GemmRates r = measure_gemm(c, g, 0.75, tier.products);
      best = std::max(best, r.best);
      char line[160];
      std::snprintf(line, sizeof line, " %lldx%lldx%lld %.0f / %.0f / %.0f (%d runs);", static_cast<long long>(g.m),
                    static_cast<long long>(g.k), static_cast<long long>(g.n), r.best / 1e9, r.median / 1e9,
                    r.worst / 1e9, r.runs);
      how += line;
    }
  }
  const int64_t words = int64_t(64) << 20;  // 256 MiB of f32 each way
  const Tensor a = ops::zeros(c, {words / 1024, 1024}, DType::f32);
  Tensor b = ops::zeros(c, {words / 1024, 1024}, DType::f32);
  Context f32 = c;
  f32.cost = nullptr;
  const std::vector<double> copies = run_times(0, 0, 3, [&] {
    ops::copy(f32, a, b);
    if (c.backend) c.backend->synchronize();
  });
  chip.memory_bps = 2.0 * double(a.nbytes()) / copies.front();
  chip.note = how + " best of 3 256 MiB copies";
  return chip;
}

std::string describe_rates(const Chip& chip) {
  char text[64];
  std::string out;
  for (const auto& [rate, unit] : {std::pair{chip.bf16_flops, "GFLOP/s bf16"}, std::pair{chip.int8_ops, "GOP/s int8"},
                                   std::pair{chip.fp8_flops, "GFLOP/s fp8"}}) {
    if (rate <= 0 && !out.empty()) continue;
    std::snprintf(text, sizeof text, "%.0f %s, ", rate / 1e9, unit);
    out += text;
  }
  std::snprintf(text, sizeof text, "%.1f GB/s", chip.memory_bps / 1e9);
  return out + text;
}

std::string calibration_key(const Context& c) {
  if (c.backend && c.backend->device() != Device::cpu) return c.backend->name() + " | " + c.backend->hardware();
  std::string cpu = "unknown cpu";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  const dnnl_version_t* v = dnnl_version();
  return cpu + " | " + std::to_string(omp_get_max_threads()) + " threads | oneDNN " + std::to_string(v->major) + "." +
         std::to_string(v->minor) + "." + std::to_string(v->patch);
}

std::string calibration_file() { return apus_cache_dir() + "/calibration.json"; }

namespace {

nlohmann::json read_calibrations() {
  std::ifstream in{calibration_file()};
  if (!in) return nlohmann::json::object();
  nlohmann::json all = nlohmann::json::parse(in, nullptr, false);
  return all.is_object() ? all : nlohmann::json::object();  // a damaged cache is measured over
}

}  // namespace

void forget_calibration(const Context& c) {
  nlohmann::json all = read_calibrations();
  if (!all.contains(calibration_key(c))) return;
  all.erase(calibration_key(c));
  const std::string text = all.dump(1);
  write_whole_file(calibration_file(), text.data(), text.size());
}

nlohmann::json cached_calibration(const std::string& key) {
  const nlohmann::json all = read_calibrations();
  return all.contains(key) && all[key].is_object() ? all[key] : nlohmann::json();
}

void keep_calibration(const std::string& key, nlohmann::json entry) {
  const std::string path = calibration_file();
  nlohmann::json all = read_calibrations();
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  entry["measured_at"] = when;
  all[key] = std::move(entry);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string text = all.dump(1);
  write_whole_file(path, text.data(), text.size());
}

Chip calibrated_ceiling(Context& c, bool refresh, bool* cached) {
  const std::string key = calibration_key(c);
  const nlohmann::json entry = cached_calibration(key);
  // An entry without a tier's rate predates it, and one without a rate where the tier runs now
  // (AVX2 CPUs gained int8 in session 24), is measured again.
  const bool usable =
      entry.is_object() && entry.value("memory_bps", 0.0) > 0 &&
      std::all_of(std::begin(kTierRates), std::end(kTierRates), [&](const TierRate& t) {
        return entry.value(t.key, -1.0) >= 0 && (entry.value(t.key, 0.0) > 0) == runs_tier(c, t.products);
      });
  if (!refresh && usable) {
    Chip chip = find_chip("cpu");
    chip.name = "this machine (calibrated)";
    for (const TierRate& t : kTierRates) chip.*t.rate = entry[t.key];
    chip.memory_bps = entry["memory_bps"];
    chip.note = entry.value("how", "") + ", " + entry.value("measured_at", "");
    if (cached) *cached = true;
    return chip;
  }
  Chip chip = measure_ceiling(c);
  nlohmann::json kept = {{"memory_bps", chip.memory_bps}, {"how", chip.note}};
  for (const TierRate& t : kTierRates) kept[t.key] = chip.*t.rate;
  keep_calibration(key, std::move(kept));
  chip.name = "this machine (calibrated)";
  if (cached) *cached = false;
  return chip;
}

}  // namespace apus
