#include "cost/roofline.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <regex>

#include "core/error.h"

namespace apus {

namespace {

// The rates a floor is priced at: int8 and fp8 products at the tier's rate where the chip has one
// (else as bf16), every other FLOP at the bf16 rate, bytes at the bandwidth.
struct Rates {
  double bf16, int8, fp8, bandwidth;
};

double compute_seconds(const OpCost& c, const Rates& r) {
  return (c.flops - c.int8_ops - c.fp8_ops) / r.bf16 + c.int8_ops / (r.int8 > 0 ? r.int8 : r.bf16) +
         c.fp8_ops / (r.fp8 > 0 ? r.fp8 : r.bf16);
}

double floor_seconds(const OpCost& c, const Rates& r) {
  const double memory = r.bandwidth > 0 ? (c.weight_bytes + c.bytes_fused) / r.bandwidth : 0;
  return std::max(compute_seconds(c, r), memory);
}

nlohmann::json cost_json(const OpCost& c, const Rates& r) {
  nlohmann::json j = {{"flops", c.flops},
                      {"weight_bytes", c.weight_bytes},
                      {"bytes_fused", c.bytes_fused},
                      {"bytes_unfused", c.bytes_unfused},
                      {"floor_s", floor_seconds(c, r)}};
  if (c.int8_ops > 0) j["int8_ops"] = c.int8_ops;
  if (c.fp8_ops > 0) j["fp8_ops"] = c.fp8_ops;
  return j;
}

// Modules run one after another, so a stage's floor is the sum of its modules' floors.
double stage_floor_per_call(const StageCost& s, const Rates& r) {
  double f = 0;
  for (const auto& m : s.modules) f += floor_seconds(m.cost, r);
  return f;
}

OpCost times(OpCost c, double n) {
  c.flops *= n;
  c.int8_ops *= n;
  c.fp8_ops *= n;
  c.weight_bytes *= n;
  c.bytes_fused *= n;
  c.bytes_unfused *= n;
  return c;
}

}  // namespace

double allgather_wire_bytes(double s, int n) { return double(n - 1) / n * s; }
double all_to_all_wire_bytes(double s, int n) { return double(n - 1) / (double(n) * n) * s; }

nlohmann::json roofline_json(const PipelineCost& p, const Roofline& r) {
  const double peak = r.chip.bf16_flops, bw = r.chip.memory_bps, ridge = bw > 0 ? peak / bw : 0;
  const Rates rates{peak, r.chip.int8_ops, r.chip.fp8_flops, bw};
  nlohmann::json out;
  out["chip"] = {{"name", r.chip.name},           {"bf16_flops", peak}, {"int8_ops", r.chip.int8_ops},
                 {"fp8_flops", r.chip.fp8_flops}, {"memory_bps", bw},   {"link_bps", r.chip.link_bps},
                 {"ridge_flops_per_byte", ridge}};
  out["request"] = {{"model", p.model}, {"steps", p.steps}, {"parameters", p.parameters}};
  if (p.references > 0) out["request"]["references"] = p.references;
  if (p.cfg > 1) out["request"]["cfg"] = p.cfg;
  if (p.seconds > 0) out["request"]["seconds"] = p.seconds;
  else out["request"].update({{"width", p.width}, {"height", p.height}});
  out["conventions"] =
      "MAC = 2 FLOPs; GEMM 2mkn; attention score 4*head_dim+5 FLOPs over heads*queries*keys "
      "(causal at the full square); per element: rmsnorm 4, layernorm 6, rope 4, gated "
      "activation 5, modulate 2, residual add 1, silu 4; bf16 bytes; floor = max(FLOPs/peak (the int8 "
      "and fp8 tiers' products at the tier's rate where the chip has one), "
      "(weight + fused bytes)/bandwidth) per module, summed over modules; bound classified on "
      "the unfused bytes";
  OpCost total;
  double floor_total = 0;
  out["stages"] = nlohmann::json::array();
  for (const StageCost& s : p.stages) {
    const double per_call_floor = stage_floor_per_call(s, rates);
    const double stage_floor = double(s.calls) * per_call_floor;
    nlohmann::json js = {{"name", s.name},
                         {"calls", s.calls},
                         {"per_call", cost_json(s.per_call, rates)},
                         {"total", cost_json(times(s.per_call, double(s.calls)), rates)}};
    js["per_call"]["floor_s"] = per_call_floor;
    js["activation_bytes"] = s.activation_bytes;
    js["total"]["floor_s"] = stage_floor;
    js["floor_s"] = stage_floor;
    floor_total += stage_floor;
    total += times(s.per_call, double(s.calls));
    js["modules"] = nlohmann::json::array();
    for (const auto& m : s.modules) {
      nlohmann::json jm = cost_json(m.cost, rates);
      jm["name"] = m.path;
      const double fused = m.cost.weight_bytes + m.cost.bytes_fused;
      const double unfused = m.cost.weight_bytes + m.cost.bytes_unfused;
      jm["intensity_fused"] = fused > 0 ? m.cost.flops / fused : 0;
      jm["intensity_unfused"] = unfused > 0 ? m.cost.flops / unfused : 0;
      jm["bound"] = unfused > 0 && m.cost.flops / unfused < ridge ? "memory" : "compute";
      js["modules"].push_back(jm);
    }
    out["stages"].push_back(js);
  }
  out["total"] = cost_json(total, rates);
  out["total"]["floor_s"] = floor_total;

  // Collectives. At batch 1 only tensor and sequence (Ulysses) parallelism split the work of
  // one request, and cfg parallelism a guided one's two branches (the busiest chip runs
  // ceil(samples / N) of the steps' samples); both as apus runs them, on the transformer's steps
  // and SAME's chunks (each chip ceil(chunks / N) of them; the text encoder and klein's VAE whole
  // on every chip). FSDP shards memory but every chip still runs the
  // whole request, and depth sharding leaves N-1 chips idle (its (N-1)/N bubble). The VAE runs replicated.
  const int n = r.chips;
  const double link = r.chip.link_bps;
  auto seconds = [&](double bytes) { return link > 0 ? bytes / link : (bytes > 0 ? INFINITY : 0.0); };
  double split = 0, replicated = 0;       // floors of the shardable stages and the rest
  double divisible = 0;                   // floors of the stages whose forwards cfg and Ulysses divide
  double parted = 0, parted_busiest = 0;  // floors of those they deal out in parts: whole, the busiest rank's
  double fsdp = 0, tp = 0, ulysses = 0, cfg = 0, depth = 0;
  for (const StageCost& s : p.stages) {
    const double f = double(s.calls) * stage_floor_per_call(s, rates);
    (s.replicated ? replicated : split) += f;
    if (s.divisible) divisible += f;
    if (s.parts > 0) {
      parted += f;
      parted_busiest += f * double((s.parts + n - 1) / n) / double(s.parts);
    }
    fsdp += double(s.calls) * allgather_wire_bytes(s.per_call.weight_bytes, n);
    // A replicated stage runs whole on every chip: nothing of it is split or exchanged.
    if (!s.replicated) tp += double(s.calls) * allgather_wire_bytes(s.per_call.tp_bytes, n);
    // Both gather the velocities of the forwards they divide; Ulysses also exchanges every
    // attention's q, k, v and o.
    if (s.parts > 0) {
      cfg += double(s.calls) * allgather_wire_bytes(s.gather_bytes, n);
      ulysses += double(s.calls) * allgather_wire_bytes(s.gather_bytes, n);
    }
    if (s.divisible) {
      cfg += double(s.calls) * allgather_wire_bytes(s.gather_bytes, n);
      ulysses += double(s.calls) *
                 (all_to_all_wire_bytes(s.per_call.ulysses_bytes, n) + allgather_wire_bytes(s.gather_bytes, n));
    }
    depth += double(s.calls) * (n - 1) * s.boundary_bytes;
  }
  const double ideal = compute_seconds(total, rates) / double(n);
  const int samples = std::max(p.samples, 1);
  const double busiest_share = double((samples + n - 1) / n) / samples;
  // What cfg and Ulysses leave whole on every chip: the text encoder, klein's VAE.
  const double undivided = split + replicated - divisible - parted;
  auto strategy = [&](double wire, double compute_floor) {
    const double sec = seconds(wire);
    const double fl = compute_floor + sec;
    return nlohmann::json{
        {"wire_bytes_per_chip", wire}, {"seconds", sec}, {"floor_s", fl}, {"peak_share", fl > 0 ? ideal / fl : 0}};
  };
  out["collectives"] = {{"chips", n},
                        {"fsdp", strategy(fsdp, split + replicated)},
                        {"tensor_parallel", strategy(tp, split / n + replicated)},
                        {"ulysses", strategy(ulysses, divisible / n + parted_busiest + undivided)},
                        {"cfg", strategy(cfg, divisible * busiest_share + parted_busiest + undivided)},
                        {"depth", strategy(depth, split + replicated)}};
  return out;
}

std::string roofline_table(const PipelineCost& p, const Roofline& r) {
  const nlohmann::json j = roofline_json(p, r);
  std::string out;
  char line[256];
  char shape[64];
  if (p.seconds > 0) std::snprintf(shape, sizeof shape, "%g s", p.seconds);
  else std::snprintf(shape, sizeof shape, "%dx%d", p.width, p.height);
  std::snprintf(line, sizeof line, "%s %s, %d steps on %s (%.1f TFLOP/s bf16, %.0f GB/s, ridge %.0f FLOP/B)\n",
                p.model.c_str(), shape, p.steps, r.chip.name.c_str(), r.chip.bf16_flops / 1e12, r.chip.memory_bps / 1e9,
                j["chip"]["ridge_flops_per_byte"].get<double>());
  out += line;
  const double total_floor = j["total"]["floor_s"];
  for (const auto& s : j["stages"]) {
    std::snprintf(line, sizeof line,
                  "\n%s x%lld: %.3f TFLOP (%.3f per call), floor %.4f s (%.1f%% of request), "
                  "activations %.2f GB\n",
                  s["name"].get<std::string>().c_str(), (long long)s["calls"].get<int64_t>(),
                  s["total"]["flops"].get<double>() / 1e12, s["per_call"]["flops"].get<double>() / 1e12,
                  s["floor_s"].get<double>(), 100.0 * s["floor_s"].get<double>() / total_floor,
                  s["activation_bytes"].get<double>() / 1e9);
    out += line;
    out += "  module                       n   GFLOP  weight MB  fused MB unfused MB  AI(f) AI(u)  bound    floor ms\n";
    // Blocks of one kind collapse into one row (indices become *), summed.
    struct Row {
      int n = 0;
      double flops = 0, w = 0, f = 0, u = 0, floor = 0;
    };
    std::vector<std::string> order;
    std::map<std::string, Row> rows;
    for (const auto& m : s["modules"]) {
      std::string key = std::regex_replace(m["name"].get<std::string>(), std::regex("\\.[0-9]+"), ".*");
      key = key.substr(key.find('/') == std::string::npos ? 0 : key.find('/') + 1);
      if (!rows.count(key)) order.push_back(key);
      Row& row = rows[key];
      ++row.n;
      row.flops += m["flops"].get<double>();
      row.w += m["weight_bytes"].get<double>();
      row.f += m["bytes_fused"].get<double>();
      row.u += m["bytes_unfused"].get<double>();
      row.floor += m["floor_s"].get<double>();
    }
    for (const auto& key : order) {
      const Row& row = rows[key];
      const double aif = row.flops / std::max(row.w + row.f, 1.0);
      const double aiu = row.flops / std::max(row.w + row.u, 1.0);
      std::snprintf(line, sizeof line, "  %-26s %3d %8.1f %10.1f %9.1f %10.1f %6.0f %5.0f  %-7s %9.3f\n", key.c_str(),
                    row.n, row.flops / 1e9, row.w / 1e6, row.f / 1e6, row.u / 1e6, aif, aiu,
                    aiu < j["chip"]["ridge_flops_per_byte"].get<double>() ? "memory" : "compute", row.floor * 1e3);
      out += line;
    }
  }
  out += "\nconventions: " + j["conventions"].get<std::string>() + "\n";
  std::snprintf(line, sizeof line, "\nrequest: %.2f TFLOP, %.2f GB weights read, floor %.3f s\n",
                j["total"]["flops"].get<double>() / 1e12, j["total"]["weight_bytes"].get<double>() / 1e9, total_floor);
  out += line;
  const auto& col = j["collectives"];
  std::snprintf(line, sizeof line, "\n%d chips, %.0f GB/s per link each way:\n", col["chips"].get<int>(),
                r.chip.link_bps / 1e9);
  out += line;
  out += "  strategy          wire MB/chip  collective s   floor s  share of N-chip peak\n";
  for (const char* k : {"fsdp", "tensor_parallel", "ulysses", "cfg", "depth"}) {
    std::snprintf(line, sizeof line, "  %-16s %13.1f %13.4f %9.4f %8.1f%%\n", k,
                  col[k]["wire_bytes_per_chip"].get<double>() / 1e6, col[k]["seconds"].get<double>(),
                  col[k]["floor_s"].get<double>(), 100.0 * col[k]["peak_share"].get<double>());
    out += line;
  }
  return out;
}

}  // namespace apus
