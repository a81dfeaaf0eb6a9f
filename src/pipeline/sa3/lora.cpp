#include "pipeline/sa3/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <regex>

#include "core/error.h"
#include "io/model_dir.h"
#include "io/weights/peft_config.h"
#include "io/weights/safetensors.h"
#include "pipeline/sa3/official_checkpoint.h"

namespace apus::sa3 {

namespace {

constexpr const char* kParametrized = ".parametrizations.weight.";

// A tensor of adapter values: bf16, f16 or f32.
const Tensor& float_tensor(const Tensor& t, const std::string& path, const std::string& key) {
  APUS_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f16 || t.dtype == DType::f32, path, ": key '", key,
             "' has dtype ", dtype_name(t.dtype), ", expected bf16, f16 or f32");
  return t;
}

// A factor as a matrix: a convolution's [out, in, 1] (PEFT's lora_B of a Conv1d) as [out, in].
Tensor matrix(const Tensor& t, const std::string& path, const std::string& key) {
  float_tensor(t, path, key);
  if (t.rank() == 3 && t.dim(2) == 1) return t.reshape({t.dim(0), t.dim(1)});
  APUS_CHECK(t.rank() == 2, path, ": key '", key, "' has shape ", shape_str(t.shape), ", expected a matrix");
  return t;
}

// The official loader's _expand: each "[a-b]" of a pattern replaced by every number from a to b.
std::vector<std::string> expanded(const std::string& pattern) {
  static const std::regex range(R"(\[(\d+)-(\d+)\])");
  std::smatch m;
  if (!std::regex_search(pattern, m, range)) return {pattern};
  const int a = std::stoi(m[1]), b = std::stoi(m[2]), step = b >= a ? 1 : -1;
  std::vector<std::string> out;
  for (const std::string& rest : expanded(m.suffix()))
    for (int n = a;; n += step) {
      out.push_back(m.prefix().str() + std::to_string(n) + rest);
      if (n == b) break;
    }
  return out;
}

// Whether lora_config's include / exclude `patterns` name `module` (a substring, as the official loader matches).
bool matches_any(const std::string& module, const Json& patterns) {
  for (const Json& p : patterns)
    for (const std::string& e : expanded(p.get<std::string>()))
      if (module.find(e) != std::string::npos) return true;
  return false;
}

struct Module {
  Tensor down, up, magnitude;
  std::string key;  // lora_B's, for errors
};

// lora_config as the official save_lora_safetensors writes it (absent: the loader's defaults).
struct OfficialConfig {
  std::optional<int64_t> rank;
  std::optional<double> alpha;
  std::string adapter_type = "lora";
  Json include, exclude;
};

OfficialConfig read_official_config(const SafetensorsFile& file, const std::string& path) {
  OfficialConfig cfg;
  const auto it = file.metadata().find("lora_config");
  if (it == file.metadata().end()) return cfg;
  const std::string where = path + ": metadata 'lora_config'";
  const Json j = parse_json(it->second, where);
  APUS_CHECK(j.is_object(), where, " is not a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key == "rank") {
      APUS_CHECK(value.is_number_integer() && value.get<int64_t>() >= 1, where, " 'rank' is ", value.dump(),
                 ", expected a positive integer");
      cfg.rank = value.get<int64_t>();
    } else if (key == "alpha") {
      APUS_CHECK(value.is_number() && std::isfinite(value.get<double>()), where, " 'alpha' is ", value.dump(),
                 ", expected a number");
      cfg.alpha = value.get<double>();
    } else if (key == "adapter_type") {
      APUS_CHECK(value.is_string(), where, " 'adapter_type' is ", value.dump(), ", expected a string");
      cfg.adapter_type = value.get<std::string>();
    } else if (key == "include" || key == "exclude") {
      APUS_CHECK(value.is_null() || (value.is_array() && std::all_of(value.begin(), value.end(),
                                                                     [](const Json& v) { return v.is_string(); })),
                 where, " '", key, "' is ", value.dump(), ", expected a list of module name parts");
      (key == "include" ? cfg.include : cfg.exclude) = value;
    } else if (key != "dropout") {  // dropout only trains
      fail(where, " has key '", key, "', which the official loader does not read");
    }
  }
  return cfg;
}

void read_official(const Lora& lora, const SafetensorsFile& file, const LoraTargets& targets, Adapters& into) {
  const std::string& path = lora.file;
  OfficialConfig cfg = read_official_config(file, path);
  std::map<std::string, Module> modules;
  int64_t inferred = 0;
  for (const std::string& key : file.names()) {
    const size_t at = key.find(kParametrized);
    APUS_CHECK(at != std::string::npos, path, ": key '", key, "' is no adapter tensor of the official format ",
               "(expected <module>.parametrizations.weight.0.lora_A / lora_B)");
    const std::string module = key.substr(0, at), rest = key.substr(at + std::strlen(kParametrized));
    APUS_CHECK(rest.starts_with("0."), path, ": key '", key, "' is a stacked adapter's (index ",
               rest.substr(0, rest.find('.')), "); the official checkpoints save index 0");
    const std::string param = rest.substr(2);
    Module& m = modules[module];
    const Tensor& t = file.get(key);
    if (param == "lora_A") {
      m.down = matrix(t, path, key);
      if (!inferred) inferred = m.down.dim(0);
    } else if (param == "lora_B") {
      m.up = matrix(t, path, key);
      m.key = key;
      if (!inferred) inferred = m.up.dim(1);
    } else if (param == "magnitude") {
      APUS_CHECK(cfg.adapter_type.starts_with("dora"), path, ": key '", key,
                 "' is a DoRA magnitude but lora_config's adapter_type is '", cfg.adapter_type, "'");
      float_tensor(t, path, key);
      // The legacy "dora" is dora-cols when its magnitudes are [1, fan_in], as the official loader resolves it.
      if (cfg.adapter_type == "dora" && t.rank() == 2 && t.dim(0) == 1 && t.dim(1) != 1) cfg.adapter_type = "dora-cols";
      APUS_CHECK(t.rank() == 1 || (t.rank() == 2 && t.dim(1) == 1), path, ": key '", key, "' has shape ",
                 shape_str(t.shape), ", expected one magnitude per output row");
      m.magnitude = t.reshape({t.dim(0)});
    } else {
      fail(path, ": key '", key, "' is a '", param, "' tensor; apus applies the official lora and dora-rows adapters ",
           "(lora_A, lora_B, magnitude)");
    }
  }
  APUS_CHECK(!modules.empty(), path, ": holds no adapter tensors");
  if (cfg.adapter_type == "dora") cfg.adapter_type = "dora-rows";
  APUS_CHECK(cfg.adapter_type == "lora" || cfg.adapter_type == "dora-rows", path, ": lora_config adapter_type '",
             cfg.adapter_type, "' is not supported (apus applies lora and dora-rows adapters)");
  const bool dora = cfg.adapter_type == "dora-rows";
  const int64_t rank = cfg.rank.value_or(inferred);
  APUS_CHECK(rank >= 1, path, ": its factors have rank 0");
  const double scaling = cfg.alpha.value_or(double(rank)) / double(rank);
  for (const auto& [module, m] : modules) {
    const std::string key = m.key.empty() ? module + kParametrized + "0.lora_A" : m.key;
    APUS_CHECK(m.down.defined() && m.up.defined(), path, ": module '", module, "' lacks its ",
               m.down.defined() ? "lora_B" : "lora_A", " (", key, ")");
    APUS_CHECK(m.down.dim(0) == rank && m.up.dim(1) == rank, path, ": key '", key, "' has rank ", m.up.dim(1),
               " (lora_A ", shape_str(m.down.shape), "), but the file's ",
               cfg.rank ? "lora_config rank is " : "first factor has rank ", rank);
    APUS_CHECK(dora == m.magnitude.defined(), path, ": module '", module, "' ",
               dora ? "has no magnitude, which a dora-rows adapter needs" : "has a magnitude but the adapter is lora");
    APUS_CHECK((cfg.include.is_null() || matches_any(module, cfg.include)) &&
                   (cfg.exclude.is_null() || !matches_any(module, cfg.exclude)),
               path, ": key '", key, "' adapts '", module,
               "', which lora_config's include / exclude leave without an adapter");
    const auto target = targets.official.find(module);
    APUS_CHECK(target != targets.official.end(), path, ": key '", key,
               "' names no Linear or Conv1d of this Stable Audio 3 model that apus adapts (the DiT and duration ",
               "conditioner, in the official module names)");
    const LoraTarget& t = target->second;
    APUS_CHECK(m.up.dim(0) == t.shape[0] && m.down.dim(1) == t.shape[1], path, ": key '", key, "' (lora_B ",
               shape_str(m.up.shape), ", lora_A ", shape_str(m.down.shape), ") does not fit '", module, "' ",
               shape_str(t.shape));
    APUS_CHECK(!dora || m.magnitude.numel() == t.shape[0], path, ": key '", module, kParametrized, "0.magnitude' has ",
               m.magnitude.numel(), " values, expected one per output row (", t.shape[0], ")");
    LowRank change;
    change.inner = Factor{m.down, t.differential_qkv ? row_blocks_permuted(m.up, kDiffusersQkvOrder) : m.up};
    if (dora)
      change.magnitude = t.differential_qkv ? row_blocks_permuted(m.magnitude, kDiffusersQkvOrder) : m.magnitude;
    change.scale = float(double(lora.scale) * scaling);
    change.source = path + ": '" + key + "'";
    into.add(t.weight, t.shape, std::move(change));
  }
}

void read_peft(const Lora& lora, const SafetensorsFile& file, const LoraTargets& targets, Adapters& into) {
  const std::string& path = lora.file;
  const PeftConfig peft = read_peft_config(file, path);
  APUS_CHECK(peft.alpha, path, ": a PEFT adapter needs its lora_alpha: in the file's ",
             "lora_adapter_metadata, or in the adapter_config.json beside an adapter_model.safetensors");
  std::map<std::string, Module> modules;
  for (const std::string& key : file.names()) {
    std::string name = key;
    for (const char* prefix : {"base_model.model.", "transformer."})
      if (name.starts_with(prefix)) name = name.substr(std::strlen(prefix));
    const bool down = name.ends_with(".lora_A.weight"), up = name.ends_with(".lora_B.weight");
    APUS_CHECK(down || up, path, ": key '", key, "' is no PEFT LoRA tensor (expected <module>.lora_A.weight / ",
               ".lora_B.weight)");
    Module& m = modules[name.substr(0, name.size() - 14)];
    (down ? m.down : m.up) = matrix(file.get(key), path, key);
    if (up) m.key = key;
  }
  APUS_CHECK(!modules.empty(), path, ": holds no adapter tensors");
  for (const auto& [module, m] : modules) {
    const std::string key = m.key.empty() ? module + ".lora_A.weight" : m.key;
    APUS_CHECK(m.down.defined() && m.up.defined() && m.down.dim(0) == m.up.dim(1) && m.down.dim(0) >= 1, path,
               ": key '", key, "' has no lora_A / lora_B pair beside it (expected [r, in] and [out, r], r >= 1)");
    const auto target = targets.diffusers.find(module);
    APUS_CHECK(target != targets.diffusers.end(), path, ": key '", key,
               "' names no linear of this Stable Audio 3 transformer (in diffusers' module names)");
    const double rank = double(m.down.dim(0)), alpha = *peft.alpha_of(module);
    LowRank change;
    change.inner = Factor{m.down, m.up};
    change.scale = float(double(lora.scale) * peft.scaling(alpha, rank));
    change.source = path + ": '" + key + "'";
    into.add(target->second.weight, target->second.shape, std::move(change));
  }
}

}  // namespace

LoraTargets lora_targets(const std::map<std::string, Shape>& dit, const std::map<std::string, Shape>& duration,
                         bool differential) {
  LoraTargets t;
  auto add = [&](const std::string& name, const Shape& shape, const std::string& official, const char* root,
                 bool peft) {
    if (!name.ends_with(".weight") || !(shape.size() == 2 || (shape.size() == 3 && shape[2] == 1))) return;
    const LoraTarget target{name, {shape[0], shape[1]}, differential && name.ends_with("self_attn.to_qkv.weight")};
    t.official.emplace(official.substr(std::strlen(root), official.size() - std::strlen(root) - 7), target);
    if (peft) t.diffusers.emplace(name.substr(0, name.size() - 7), target);
  };
  for (const auto& [name, shape] : dit) add(name, shape, OfficialCheckpoint::dit_name(name), "model.", true);
  for (const auto& [name, shape] : duration)
    add(name, shape, OfficialCheckpoint::duration_name(name), "conditioner.", false);
  return t;
}

void read_lora(const Lora& lora, const LoraTargets& targets, Adapters& into) {
  APUS_CHECK(std::isfinite(lora.scale), lora.file, ": LoRA scale ", lora.scale, " is not a finite number");
  const auto file = std::make_shared<SafetensorsFile>(SafetensorsFile::open(lora.file));
  // The official DoRA at strength 0 leaves its weights as they are (checked, then dropped).
  Adapters dropped;
  Adapters& to = lora.scale == 0 ? dropped : into;
  bool official = false;
  for (const std::string& key : file->names()) official = official || key.find(kParametrized) != std::string::npos;
  // Anything else is read as PEFT's: a file of other keys (kohya's lora_unet_*, an image model's
  // LyCORIS) is named for what it is not before PEFT's own requirements are asked of it.
  if (!official)
    for (const std::string& key : file->names())
      APUS_CHECK(key.ends_with(".lora_A.weight") || key.ends_with(".lora_B.weight"), lora.file,
                 ": not a Stable Audio 3 adapter (the official code's parametrized LoRA/DoRA or PEFT's lora_A / ",
                 "lora_B): key '", key, "' is neither",
                 key.starts_with("lora_unet_") ? " (kohya's layout, an image model's)" : "");
  if (official) read_official(lora, *file, targets, to);
  else read_peft(lora, *file, targets, to);
}

}  // namespace apus::sa3
