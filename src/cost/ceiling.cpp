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
#include "ops/backend.h"

namespace apus {

namespace {

template <typename Body> double best_seconds(int runs, Body&& body) {
  double best = 1e30;
  for (int i = 0; i < runs; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

Chip measure_ceiling(Context& c) {
  const int64_t m = 1024, k = 3072, n = 3072;
  // Small values of one sign keep the products finite; what is measured is the rate, not them.
  auto small = [&](Shape s) {
    Tensor t = Tensor::heap(std::move(s), DType::bf16);
    std::fill_n(t.ptr<uint16_t>(), t.numel(), f32_to_bf16(0.01f));
    return ops::to_context(c, t);
  };
  const Tensor x = small({m, k}), w = small({n, k});
  Tensor y = ops::empty(c, {m, n}, DType::bf16);
  Context bf16 = c;
  bf16.act = DType::bf16;
  bf16.cost = nullptr;
  Backend* device = c.backend;
  auto timed = [&](auto&& op) {
    return [&] {
      op();
      if (device) device->synchronize();
    };
  };
  ops::linear(bf16, x, w, nullptr, y);  // first call builds the kernel
  const double gemm = best_seconds(10, timed([&] { ops::linear(bf16, x, w, nullptr, y); }));
  const int64_t words = int64_t(64) << 20;  // 256 MiB of f32 each way
  const Tensor a = ops::zeros(c, {words / 1024, 1024}, DType::f32);
  Tensor b = ops::zeros(c, {words / 1024, 1024}, DType::f32);
  const double copy = best_seconds(3, timed([&] { ops::copy(bf16, a, b); }));
  Chip chip = find_chip("cpu");
  chip.name = "this machine (measured)";
  chip.bf16_flops = 2.0 * double(m) * double(k) * double(n) / gemm;
  chip.memory_bps = 2.0 * double(a.nbytes()) / copy;
  chip.note = "best of 10 bf16 GEMMs 1024x3072x3072 and of 3 256 MiB copies";
  return chip;
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

Chip calibrated_ceiling(Context& c, bool refresh, bool* cached) {
  const std::string path = calibration_file(), key = calibration_key(c);
  nlohmann::json all = nlohmann::json::object();
  if (std::ifstream in{path}) {
    all = nlohmann::json::parse(in, nullptr, false);
    if (!all.is_object()) all = nlohmann::json::object();  // a damaged cache is measured over
  }
  const nlohmann::json* entry = all.contains(key) ? &all[key] : nullptr;
  if (!refresh && entry && entry->is_object() && entry->value("bf16_flops", 0.0) > 0 &&
      entry->value("memory_bps", 0.0) > 0) {
    Chip chip = find_chip("cpu");
    chip.name = "this machine (calibrated)";
    chip.bf16_flops = (*entry)["bf16_flops"];
    chip.memory_bps = (*entry)["memory_bps"];
    chip.note = entry->value("how", "") + ", " + entry->value("measured_at", "");
    if (cached) *cached = true;
    return chip;
  }
  Chip chip = measure_ceiling(c);
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  all[key] = {
      {"bf16_flops", chip.bf16_flops}, {"memory_bps", chip.memory_bps}, {"how", chip.note}, {"measured_at", when}};
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  const std::string text = all.dump(1);
  write_whole_file(path, text.data(), text.size());
  chip.name = "this machine (calibrated)";
  if (cached) *cached = false;
  return chip;
}

}  // namespace apus
