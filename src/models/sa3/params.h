#pragma once
// Where a Stable Audio 3 component's parameters live and under which names. diffusers' folders
// store each component under the diffusers class's names; the official single checkpoint
// (model.safetensors beside model_config.json) prefixes and renames them and orders the
// differential attention's fused projection differently. Models ask for diffusers names.
#include <functional>
#include <string>
#include <vector>

#include "io/model_dir.h"

namespace apus::sa3 {

struct ParamSource {
  WeightSet set;
  std::function<std::string(const std::string&)> name;  // diffusers name -> stored name
  // Fused to_qkv rows [q | k | v | q2 | k2] (official) instead of [q | q2 | k | k2 | v] (diffusers).
  bool official_qkv = false;

  static ParamSource diffusers(WeightSet set);
  // The official checkpoint's DiT (model.model.*, the padding embedding under conditioner.*),
  // SAME autoencoder (pretransform.model.*, or bare in a SAME-L/SAME-S repository) and duration
  // conditioner (conditioner.conditioners.seconds_total.*).
  static ParamSource official_dit(WeightSet set);
  static ParamSource official_same(WeightSet set, const std::string& prefix);
  static ParamSource official_duration(WeightSet set);
};

// Loads parameters converted to one compute dtype, once (the official model.to(dtype)), keeping the
// converted copies alive; in counting mode (no data) the shapes alone.
class ParamLoader {
 public:
  ParamLoader(const ParamSource& source, DType compute, std::vector<Tensor>& owned)
      : source_(source), compute_(compute), owned_(owned) {}
  Tensor get(const std::string& name, const Shape& shape) const;
  // A fused attention projection of `parts` blocks of `width` rows (5: differential, 3: plain),
  // returned in diffusers' order.
  Tensor fused_qkv(const std::string& name, int64_t parts, int64_t width, int64_t in) const;
  // The stored tensor as is, in host memory (buffers checked, or read to compute what the model
  // holds), and where such a computed tensor goes: its device copy on a device, itself on the CPU.
  const Tensor& raw(const std::string& name, const Shape& shape) const {
    return source_.set.host(source_.name(name), shape);
  }
  Tensor place(const Tensor& host) const { return source_.set.place(host); }
  // "FILE: tensor 'STORED NAME'" of a parameter, for errors about its values.
  std::string where(const std::string& name) const {
    const std::string stored = source_.name(name);
    return source_.set.file_of(stored) + ": tensor '" + stored + "'";
  }

 private:
  const ParamSource& source_;
  DType compute_;
  std::vector<Tensor>& owned_;
};

}  // namespace apus::sa3
