#pragma once
// Stable Audio 3's official single checkpoint (model.safetensors beside model_config.json) under
// diffusers' names: it prefixes and renames each component's parameters and orders the
// differential attention's fused projection differently. Models ask for diffusers names, so they
// load from either layout alike.
#include <memory>
#include <string>
#include <vector>

#include "io/weights/weight_source.h"

namespace apus::sa3 {

// A differential fused to_qkv in diffusers' rows [q | q2 | k | k2 | v]: the blocks of the official
// [q | k | v | q2 | k2] in this order.
inline const std::vector<int> kDiffusersQkvOrder = {0, 3, 1, 4, 2};

// The official checkpoint's names (io/weights/renamed_source.h renames them to diffusers').
struct OfficialCheckpoint {
  // The DiT (model.model.*, the padding embedding under conditioner.*), the SAME autoencoder
  // (pretransform.model.*, or bare in a SAME-L/SAME-S repository) and the duration conditioner
  // (conditioner.conditioners.seconds_total.*) of `file`. differential: the attention is
  // differential, its fused to_qkv rows stored [q | k | v | q2 | k2] (diffusers: [q | q2 | k | k2 | v]).
  static std::shared_ptr<const WeightSource> dit(std::shared_ptr<const WeightSource> file, bool differential);
  static std::shared_ptr<const WeightSource> same(std::shared_ptr<const WeightSource> file, const std::string& prefix,
                                                  bool differential);
  static std::shared_ptr<const WeightSource> duration(std::shared_ptr<const WeightSource> file);
  // The official checkpoint's name of a DiT or duration-conditioner weight named as diffusers
  // names it ("transformer_blocks.0.ff.proj_in.weight" -> "model.model.transformer.layers.0.ff.ff.0.proj.weight").
  static std::string dit_name(const std::string& diffusers);
  static std::string duration_name(const std::string& diffusers);
};

}  // namespace apus::sa3
