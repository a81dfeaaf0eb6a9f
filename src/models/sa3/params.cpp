#include "models/sa3/params.h"

#include <cstring>

#include "core/error.h"

namespace apus::sa3 {

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// Replaces the first of `renames` found in s.
std::string renamed(std::string s, const std::vector<std::pair<std::string, std::string>>& renames) {
  for (const auto& [from, to] : renames) {
    const size_t at = s.find(from);
    if (at != std::string::npos) return s.replace(at, from.size(), to);
  }
  return s;
}

}  // namespace

ParamSource ParamSource::diffusers(WeightSet set) {
  return {std::move(set), [](const std::string& n) { return n; }, false};
}

ParamSource ParamSource::official_dit(WeightSet set) {
  auto name = [](const std::string& n) -> std::string {
    if (n == "prompt_padding_embedding") return "conditioner.conditioners.prompt.padding_embedding";
    if (n == "proj_in.weight") return "model.model.transformer.project_in.weight";
    if (n == "proj_out.weight") return "model.model.transformer.project_out.weight";
    if (starts_with(n, "transformer_blocks."))
      return "model.model.transformer.layers." +
             renamed(n.substr(19), {{"ff.proj_in.", "ff.ff.0.proj."}, {"ff.proj_out.", "ff.ff.2."}});
    for (const char* inner : {"memory_tokens", "rotary_pos_emb.", "global_cond_embedder."})
      if (starts_with(n, inner)) return "model.model.transformer." + n;
    return "model.model." + n;
  };
  return {std::move(set), name, true};
}

ParamSource ParamSource::official_same(WeightSet set, const std::string& prefix) {
  // The resampling block sits at layers.0 of the encoder (before its projection at layers.2) and
  // at layers.3 of the decoder (after its projection at layers.1).
  auto block = [](const std::string& inner) {
    return renamed(inner, {{"norm_attn.", "pre_norm."}, {"attn.to_qkv.", "self_attn.to_qkv."},
                           {"attn.to_out.", "self_attn.to_out."}, {"attn.q_norm.", "self_attn.q_norm."},
                           {"attn.k_norm.", "self_attn.k_norm."}, {"norm_ff.", "ff_norm."},
                           {"ff.proj_in.", "ff.ff.0.proj."}, {"ff.proj_out.", "ff.ff.2."}});
  };
  auto name = [prefix, block](const std::string& n) -> std::string {
    if (starts_with(n, "decoder.proj.")) return prefix + "decoder.layers.1." + n.substr(13);
    if (starts_with(n, "decoder.blocks.0.")) return prefix + "decoder.layers.3." + block(n.substr(17));
    if (starts_with(n, "encoder.proj.")) return prefix + "encoder.layers.2." + n.substr(13);
    if (starts_with(n, "encoder.blocks.0.")) return prefix + "encoder.layers.0." + block(n.substr(17));
    if (n == "bottleneck.scale") return prefix + "bottleneck.scaling_factor";
    return prefix + n;
  };
  return {std::move(set), name, true};
}

ParamSource ParamSource::official_duration(WeightSet set) {
  auto name = [](const std::string& n) {
    return "conditioner.conditioners.seconds_total.embedder.embedding.1." + n.substr(n.find('.') + 1);
  };
  return {std::move(set), name, false};
}

std::string ParamLoader::where(const std::string& name) const {
  const std::string stored = source_.name(name);
  return source_.set.file_of(stored) + ": tensor '" + stored + "'";
}

Tensor ParamLoader::get(const std::string& name, const Shape& shape) const {
  const std::string stored = source_.name(name);
  const Tensor& t = source_.set.host(stored, shape);
  if (!t.data || t.dtype == compute_) return source_.set.get(stored, shape);
  // Converted where it is stored, then placed (on a device, its copy).
  owned_.push_back(source_.set.place(to_dtype(t, compute_)));
  source_.set.release(stored);  // the model reads the converted copy only
  return owned_.back();
}

Tensor ParamLoader::fused_qkv(const std::string& name, int64_t parts, int64_t width, int64_t in) const {
  if (!source_.official_qkv || parts != 5) return get(name, {parts * width, in});
  const Tensor& t = source_.set.host(source_.name(name), {parts * width, in});
  if (!t.data) return t;
  const Tensor c = t.dtype == compute_ ? t : to_dtype(t, compute_);
  // [q | k | v | q2 | k2] -> [q | q2 | k | k2 | v]
  Tensor out = Tensor::heap(c.shape, c.dtype);
  const size_t block = size_t(width * in) * dtype_size(c.dtype);
  const int order[5] = {0, 3, 1, 4, 2};
  for (int i = 0; i < 5; ++i)
    std::memcpy(static_cast<char*>(out.data) + size_t(i) * block,
                static_cast<const char*>(c.data) + size_t(order[i]) * block, block);
  owned_.push_back(source_.set.place(out));
  source_.set.release(source_.name(name));
  return owned_.back();
}

}  // namespace apus::sa3
