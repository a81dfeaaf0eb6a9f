#pragma once
// Adapter files for Stable Audio 3, read into the adapters a request applies (ops/adapters.h) under
// the names the models fetch (diffusers'):
//   official:  <module>.parametrizations.weight.0.lora_A / lora_B (DoRA: and .magnitude), the
//              modules of the DiT wrapper (model.transformer.layers.N.self_attn.to_qkv ...) and of
//              the conditioner (conditioners.seconds_total.embedder.embedding.1), as
//              stable_audio_3.models.lora saves them: lora_config in the metadata (rank, else the
//              factors' rank; alpha, else the rank; adapter_type lora or dora-rows; include/exclude)
//   PEFT:      [base_model.model.|transformer.]<diffusers module>.lora_A.weight / lora_B.weight of
//              diffusers' StableAudio3DiTModel, alpha from the config (io/weights/peft_config.h)
// ΔW = strength · alpha / rank · B A as the official parametrization merges it; the differential
// attention's fused to_qkv rows come reordered as its weight. Other adapter types (bora, -xs,
// dora-cols), keys of no module, ranks that disagree and modules lora_config's filters leave out are
// refused naming the file and key.
#include <map>
#include <string>

#include "apus/apus.h"
#include "core/tensor.h"
#include "ops/adapters.h"

namespace apus::sa3 {

// A weight adapters can change: its name as the model fetches it, its [out, in] (a convolution's
// [out, in x kernel]) and whether its rows are a differential fused to_qkv's.
struct LoraTarget {
  std::string weight;
  Shape shape;
  bool differential_qkv = false;
};

struct LoraTargets {
  // By official module name, relative to the DiT wrapper (model.model) or the conditioner.
  std::map<std::string, LoraTarget> official;
  std::map<std::string, LoraTarget> diffusers;  // the DiT's, by diffusers module name
};

// The targets of a DiT and duration conditioner with these fetched weights.
LoraTargets lora_targets(const std::map<std::string, Shape>& dit, const std::map<std::string, Shape>& duration,
                         bool differential);

// Adds `lora`'s factors to `into`.
void read_lora(const Lora& lora, const LoraTargets& targets, Adapters& into);

}  // namespace apus::sa3
