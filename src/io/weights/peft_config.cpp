#include "io/weights/peft_config.h"

#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "io/model_dir.h"

namespace apus {

namespace {

PeftConfig parse(const Json& j, const std::string& where) {
  APUS_CHECK(j.is_object(), where, " is not a JSON object");
  PeftConfig cfg;
  for (auto item = j.begin(); item != j.end(); ++item) {
    const std::string& key = item.key();
    const Json& value = item.value();
    std::string k = key;
    if (k.starts_with("transformer.")) k = k.substr(12);
    auto flag_off = [&](const char* what) {
      APUS_CHECK(!(value.is_boolean() && value.get<bool>()), where, " '", key, "' is true; apus does not apply ", what);
    };
    if (k == "lora_alpha") {
      APUS_CHECK(value.is_number(), where, " '", key, "' is ", value.dump(), ", expected a number");
      cfg.alpha = value.get<double>();
    } else if (k == "alpha_pattern") {
      APUS_CHECK(value.is_object(), where, " '", key, "' is not an object");
      for (const auto& [pattern, a] : value.items()) {
        APUS_CHECK(a.is_number(), where, " alpha_pattern '", pattern, "' is not a number");
        APUS_CHECK(pattern.find_first_of("*+?[](){}|^$\\") == std::string::npos, where, " alpha_pattern '", pattern,
                   "' is a regular expression; apus matches module names only");
        cfg.alpha_pattern[pattern] = a.get<double>();
      }
    } else if (k == "use_rslora") {
      cfg.rslora = value.is_boolean() && value.get<bool>();
    } else if (k == "use_dora") {
      flag_off("DoRA adapters in PEFT's layout");
    } else if (k == "lora_bias") {
      flag_off("adapter biases");
    } else if (k == "peft_type") {
      APUS_CHECK(value == "LORA", where, " 'peft_type' is ", value.dump(), "; apus reads PEFT's LORA adapters");
    }
  }
  return cfg;
}

}  // namespace

std::optional<double> PeftConfig::alpha_of(const std::string& module) const {
  for (const auto& [pattern, a] : alpha_pattern)
    if (module == pattern || module.ends_with("." + pattern)) return a;
  return alpha;
}

double PeftConfig::scaling(double a, double rank) const { return a / (rslora ? std::sqrt(rank) : rank); }

PeftConfig read_peft_config(const SafetensorsFile& file, const std::string& path) {
  const auto it = file.metadata().find("lora_adapter_metadata");
  if (it != file.metadata().end()) {
    const std::string where = path + ": metadata 'lora_adapter_metadata'";
    return parse(parse_json(it->second, where), where);
  }
  const std::filesystem::path p(path);
  const std::string beside = (p.parent_path() / "adapter_config.json").string();
  if (p.filename() == "adapter_model.safetensors" && std::filesystem::exists(beside))
    return parse(read_json(beside), beside);
  return {};
}

}  // namespace apus
