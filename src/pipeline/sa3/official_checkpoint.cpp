#include "pipeline/sa3/official_checkpoint.h"

#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "io/weights/renamed_source.h"

namespace apus::sa3 {

namespace {

// Replaces the first of `renames` found in s.
std::string renamed(std::string s, const std::vector<std::pair<std::string, std::string>>& renames) {
  for (const auto& [from, to] : renames) {
    const size_t at = s.find(from);
    if (at != std::string::npos) return s.replace(at, from.size(), to);
  }
  return s;
}

// `file` under diffusers' names, `name` giving the stored one; a differential fused projection
// comes reordered to diffusers' rows.
std::shared_ptr<const WeightSource> under_diffusers_names(std::shared_ptr<const WeightSource> file,
                                                          std::function<std::string(const std::string&)> name,
                                                          bool differential) {
  auto rule = [name = std::move(name), differential](const std::string& asked) -> std::optional<StoredAs> {
    StoredAs s{.name = name(asked)};
    if (differential && asked.ends_with("attn.to_qkv.weight")) s.row_blocks = kDiffusersQkvOrder;
    return s;
  };
  return std::make_shared<RenamedSource>(std::vector<std::shared_ptr<const WeightSource>>{std::move(file)}, rule,
                                         "the official checkpoint");
}

}  // namespace

std::string OfficialCheckpoint::dit_name(const std::string& n) {
  if (n == "prompt_padding_embedding") return "conditioner.conditioners.prompt.padding_embedding";
  if (n == "proj_in.weight") return "model.model.transformer.project_in.weight";
  if (n == "proj_out.weight") return "model.model.transformer.project_out.weight";
  if (n.starts_with("transformer_blocks."))
    return "model.model.transformer.layers." +
           renamed(n.substr(19), {{"ff.proj_in.", "ff.ff.0.proj."}, {"ff.proj_out.", "ff.ff.2."}});
  for (const char* inner : {"memory_tokens", "rotary_pos_emb.", "global_cond_embedder."})
    if (n.starts_with(inner)) return "model.model.transformer." + n;
  return "model.model." + n;
}

std::string OfficialCheckpoint::duration_name(const std::string& n) {
  return "conditioner.conditioners.seconds_total.embedder.embedding.1." + n.substr(n.find('.') + 1);
}

std::shared_ptr<const WeightSource> OfficialCheckpoint::dit(std::shared_ptr<const WeightSource> file,
                                                            bool differential) {
  return under_diffusers_names(std::move(file), dit_name, differential);
}

std::shared_ptr<const WeightSource> OfficialCheckpoint::same(std::shared_ptr<const WeightSource> file,
                                                             const std::string& prefix, bool differential) {
  // The resampling block sits at layers.0 of the encoder (before its projection at layers.2) and
  // at layers.3 of the decoder (after its projection at layers.1).
  auto block = [](const std::string& inner) {
    return renamed(inner, {{"norm_attn.", "pre_norm."},
                           {"attn.to_qkv.", "self_attn.to_qkv."},
                           {"attn.to_out.", "self_attn.to_out."},
                           {"attn.q_norm.", "self_attn.q_norm."},
                           {"attn.k_norm.", "self_attn.k_norm."},
                           {"norm_ff.", "ff_norm."},
                           {"ff.proj_in.", "ff.ff.0.proj."},
                           {"ff.proj_out.", "ff.ff.2."}});
  };
  auto name = [prefix, block](const std::string& n) -> std::string {
    if (n.starts_with("decoder.proj.")) return prefix + "decoder.layers.1." + n.substr(13);
    if (n.starts_with("decoder.blocks.0.")) return prefix + "decoder.layers.3." + block(n.substr(17));
    if (n.starts_with("encoder.proj.")) return prefix + "encoder.layers.2." + n.substr(13);
    if (n.starts_with("encoder.blocks.0.")) return prefix + "encoder.layers.0." + block(n.substr(17));
    if (n == "bottleneck.scale") return prefix + "bottleneck.scaling_factor";
    return prefix + n;
  };
  return under_diffusers_names(std::move(file), name, differential);
}

std::shared_ptr<const WeightSource> OfficialCheckpoint::duration(std::shared_ptr<const WeightSource> file) {
  return under_diffusers_names(std::move(file), duration_name, false);
}

}  // namespace apus::sa3
