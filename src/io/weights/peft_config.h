#pragma once
// PEFT's LoRA config as adapter files carry it: in the file's lora_adapter_metadata (diffusers'
// save_lora_weights, its keys under "transformer."), or, for PEFT's own adapter_model.safetensors,
// in the adapter_config.json PeftModel.save_pretrained writes beside it. What apus takes from it is
// each module's alpha; DoRA and adapter biases are refused naming the key.
#include <map>
#include <optional>
#include <string>

#include "io/weights/safetensors.h"

namespace apus {

struct PeftConfig {
  std::optional<double> alpha;
  std::map<std::string, double> alpha_pattern;
  bool rslora = false;
  // The alpha of `module`: the alpha_pattern entry it ends with (as PEFT's "(.*\.)?key$"), else lora_alpha.
  std::optional<double> alpha_of(const std::string& module) const;
  // PEFT's scaling of a rank-r adapter with this alpha: alpha / r, or alpha / sqrt(r) with rslora.
  double scaling(double alpha, double rank) const;
};

// The config of the adapter file `file` at `path` (empty where it has none).
PeftConfig read_peft_config(const SafetensorsFile& file, const std::string& path);

}  // namespace apus
