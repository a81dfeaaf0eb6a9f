#include "models/flux2/lora.h"

#include <cmath>
#include <cstring>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "models/flux2/single_file.h"

namespace apus::flux2 {

namespace {


// One adapted module's tensors as the file stores them.
struct Module {
  std::string down_key, up_key;
  Tensor down, up;
  std::optional<float> alpha;
};

// PEFT's adapter config as diffusers' save_lora_weights writes it into the file's metadata
// (lora_adapter_metadata, keys under "transformer."): the alpha of each module.
struct PeftConfig {
  std::optional<double> alpha;
  std::map<std::string, double> alpha_pattern;
  bool rslora = false;
};

PeftConfig read_peft_config(const SafetensorsFile& file, const std::string& path) {
  PeftConfig cfg;
  const auto it = file.metadata().find("lora_adapter_metadata");
  if (it == file.metadata().end()) return cfg;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
  } catch (const std::exception& e) {
    fail(path, ": metadata 'lora_adapter_metadata' is not JSON (", e.what(), ")");
  }
  APUS_CHECK(j.is_object(), path, ": metadata 'lora_adapter_metadata' is not a JSON object");
  for (const auto& [key, value] : j.items()) {
    std::string k = key;
    if (k.starts_with("transformer.")) k = k.substr(12);
    if (k == "lora_alpha") {
      APUS_CHECK(value.is_number(), path, ": lora_adapter_metadata '", key, "' is ", value.dump(), ", expected a number");
      cfg.alpha = value.get<double>();
    } else if (k == "alpha_pattern") {
      APUS_CHECK(value.is_object(), path, ": lora_adapter_metadata '", key, "' is not an object");
      for (const auto& [pattern, a] : value.items()) {
        APUS_CHECK(a.is_number(), path, ": lora_adapter_metadata alpha_pattern '", pattern, "' is not a number");
        APUS_CHECK(pattern.find_first_of("*+?[](){}|^$\\") == std::string::npos, path,
                   ": lora_adapter_metadata alpha_pattern '", pattern, "' is a regular expression; apus matches ",
                   "module names only");
        cfg.alpha_pattern[pattern] = a.get<double>();
      }
    } else if (k == "use_rslora") {
      cfg.rslora = value.is_boolean() && value.get<bool>();
    } else if (k == "use_dora") {
      APUS_CHECK(!(value.is_boolean() && value.get<bool>()), path,
                 ": lora_adapter_metadata use_dora is true; apus does not apply DoRA adapters");
    } else if (k == "lora_bias") {
      APUS_CHECK(!(value.is_boolean() && value.get<bool>()), path,
                 ": lora_adapter_metadata lora_bias is true; apus does not apply adapter biases");
    }
  }
  return cfg;
}

// PEFT's alpha for `module`: the alpha_pattern entry it ends with (as PEFT's "(.*\.)?key$"), else lora_alpha.
std::optional<double> peft_alpha(const PeftConfig& cfg, const std::string& module) {
  for (const auto& [pattern, alpha] : cfg.alpha_pattern)
    if (module == pattern || module.ends_with("." + pattern)) return alpha;
  return cfg.alpha;
}

}  // namespace

void read_lora(const Lora& lora, const std::map<std::string, Shape>& weights, int64_t double_blocks,
               int64_t single_blocks, Adapters& into) {
  const std::string& path = lora.file;
  APUS_CHECK(std::isfinite(lora.scale), path, ": LoRA scale ", lora.scale, " is not a finite number");
  const auto file = std::make_shared<SafetensorsFile>(SafetensorsFile::open(path));
  // kohya's underscored module names -> BFL's or diffusers' dotted ones.
  std::map<std::string, std::string> underscored;
  auto underscore = [](std::string s) {
    for (char& ch : s)
      if (ch == '.') ch = '_';
    return s;
  };
  for (const std::string& m : bfl_modules(double_blocks, single_blocks)) underscored["lora_unet_" + underscore(m)] = m;
  // Trainers that name diffusers' modules the kohya way use either prefix.
  for (const auto& [name, shape] : weights)
    if (name.ends_with(".weight"))
      for (const char* prefix : {"lora_transformer_", "lora_unet_"})
        underscored.emplace(prefix + underscore(name.substr(0, name.size() - 7)), name.substr(0, name.size() - 7));

  std::map<std::string, Module> modules;  // dotted module name -> its tensors
  for (const std::string& key : file->names()) {
    for (const char* te : {"text_encoder.", "lora_te_", "lora_te1_", "lora_te2_", "te."})
      APUS_CHECK(!key.starts_with(te), path, ": key '", key,
                 "' adapts the text encoder; apus applies adapters to the transformer only");
    // Adapter kinds other than plain LoRA, by the marker in their keys.
    static const std::pair<const char*, const char*> kOtherKinds[] = {{".dora_scale", "DoRA"},
                                                                      {".lokr_", "LyCORIS LoKr"},
                                                                      {".hada_", "LyCORIS LoHa"},
                                                                      {".diff", "full-difference"},
                                                                      {".lora_mid", "LoCon mid"}};
    for (const auto& [marker, kind] : kOtherKinds)
      APUS_CHECK(key.find(marker) == std::string::npos, path, ": key '", key, "' is a ", kind,
                 " tensor; apus applies plain low-rank (LoRA) adapters only");
    std::string name = key;
    for (const char* prefix : {"base_model.model.", "transformer.", "model.diffusion_model.", "diffusion_model."})
      if (name.starts_with(prefix)) name = name.substr(std::strlen(prefix));
    std::string role;
    for (const char* suffix : {".lora_A.weight", ".lora_B.weight", ".lora_down.weight", ".lora_up.weight", ".alpha"})
      if (name.ends_with(suffix)) {
        role = suffix;
        name = name.substr(0, name.size() - role.size());
        break;
      }
    APUS_CHECK(!role.empty(), path, ": key '", key, "' is no LoRA tensor (expected .lora_A.weight / .lora_B.weight, ",
               ".lora_down.weight / .lora_up.weight or .alpha)");
    if (name.starts_with("lora_unet_") || name.starts_with("lora_transformer_")) {
      const auto it = underscored.find(name);
      APUS_CHECK(it != underscored.end(), path, ": key '", key, "' names no module of this FLUX.2 transformer");
      name = it->second;
    }
    Module& m = modules[name];
    const Tensor& t = file->get(key);
    if (role == ".alpha") {
      APUS_CHECK(t.numel() == 1, path, ": key '", key, "' has shape ", shape_str(t.shape), ", expected one value");
      m.alpha = load_f32(t, 0);
      continue;
    }
    APUS_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f16 || t.dtype == DType::f32, path, ": key '", key,
               "' has dtype ", dtype_name(t.dtype), ", expected bf16, f16 or f32");
    const bool down = role == ".lora_A.weight" || role == ".lora_down.weight";
    (down ? m.down_key : m.up_key) = key;
    (down ? m.down : m.up) = t;
  }
  APUS_CHECK(!modules.empty(), path, ": holds no LoRA tensors");
  const PeftConfig peft = read_peft_config(*file, path);
  std::vector<DiffusersTarget> targets;
  for (auto& [name, m] : modules) {
    APUS_CHECK(m.down.defined() && m.up.defined(), path, ": key '", m.down.defined() ? m.down_key : m.up_key,
               "' has ", m.down.defined() ? "no up (lora_B / lora_up)" : "no down (lora_A / lora_down)",
               " tensor beside it");
    APUS_CHECK(m.down.rank() == 2 && m.up.rank() == 2 && m.down.dim(0) == m.up.dim(1), path, ": '", m.down_key,
               "' ", shape_str(m.down.shape), " and '", m.up_key, "' ", shape_str(m.up.shape),
               " are no low-rank pair (expected [r, in] and [out, r])");
    const double rank = double(m.down.dim(0));
    const std::optional<double> alpha = m.alpha ? std::optional<double>(*m.alpha) : peft_alpha(peft, name);
    const double per_rank = alpha ? *alpha / (peft.rslora ? std::sqrt(rank) : rank) : 1.0;
    const float scale = float(double(lora.scale) * per_rank);
    if (weights.count(name + ".weight")) {
      targets = {{name}};
    } else {
      APUS_CHECK(bfl_module_targets(name, targets), path, ": key '", m.up_key,
                 "' names no module of this FLUX.2 transformer (in diffusers' or BFL's names)");
    }
    for (const DiffusersTarget& t : targets) {
      const auto w = weights.find(t.module + ".weight");
      APUS_CHECK(w != weights.end(), path, ": key '", m.up_key, "' adapts '", t.module,
                 "', which this FLUX.2 transformer does not have");
      Tensor up = m.up;
      if (t.parts > 1) {
        APUS_CHECK(up.dim(0) % t.parts == 0, path, ": '", m.up_key, "' has ", up.dim(0), " rows, expected ", t.parts,
                   " stacked parts");
        up = up.rows(t.part * up.dim(0) / t.parts, (t.part + 1) * up.dim(0) / t.parts);
      }
      if (t.swap_halves) {
        // BFL's (shift, scale) rows as diffusers' (scale, shift), as its weight is swapped.
        APUS_CHECK(up.dim(0) % 2 == 0, path, ": '", m.up_key, "' has ", up.dim(0), " rows, expected two halves");
        const int64_t half = up.dim(0) / 2;
        Tensor swapped = Tensor::heap(up.shape, up.dtype);
        const size_t bytes = up.rows(0, half).nbytes();
        std::memcpy(swapped.data, up.rows(half, 2 * half).data, bytes);
        std::memcpy(swapped.rows(half, 2 * half).data, up.data, bytes);
        up = swapped;
      }
      // The views keep the file mapped for as long as the request's adapters live.
      into.add(t.module + ".weight", w->second, LowRank{m.down, up, scale, path + ": '" + m.up_key + "'"});
    }
  }
}

}  // namespace apus::flux2
