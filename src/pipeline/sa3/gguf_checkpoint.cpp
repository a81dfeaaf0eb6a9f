#include "pipeline/sa3/gguf_checkpoint.h"

#include <utility>

#include "core/error.h"
#include "io/files.h"
#include "io/weights/gguf.h"
#include "io/weights/renamed_source.h"

namespace apus::sa3 {

namespace {

using Renames = std::vector<std::pair<std::string, std::string>>;

// `name` with its first matching prefix replaced; false when none matches.
bool replace_prefix(const std::string& name, const Renames& renames, std::string& out) {
  for (const auto& [from, to] : renames)
    if (name.starts_with(from)) {
      out = to + name.substr(from.size());
      return true;
    }
  return false;
}

// "7.self.qkv.weight" -> index 7 and "self.qkv.weight".
bool split_block(const std::string& rest, std::string& index, std::string& inner) {
  const size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789") != dot) return false;
  index = rest.substr(0, dot);
  inner = rest.substr(dot + 1);
  return true;
}

std::string dit_official(const std::string& name) {
  std::string out;
  if (replace_prefix(name,
                     {{"dit.pre_conv.", "model.model.preprocess_conv."},
                      {"dit.post_conv.", "model.model.postprocess_conv."},
                      {"dit.cond_embed.", "model.model.to_cond_embed."},
                      {"dit.global_embed.", "model.model.to_global_embed."},
                      {"dit.time_embed.", "model.model.to_timestep_embed."},
                      {"dit.gce.", "model.model.transformer.global_cond_embedder."},
                      {"dit.memory_tokens", "model.model.transformer.memory_tokens"},
                      {"dit.proj_in.", "model.model.transformer.project_in."},
                      {"dit.proj_out.", "model.model.transformer.project_out."}},
                     out))
    return out;
  std::string index, inner;
  if (!name.starts_with("dit.") || !split_block(name.substr(4), index, inner)) return "";
  const std::string block = "model.model.transformer.layers." + index + ".";
  if (inner == "ssg") return block + "to_scale_shift_gate";
  if (replace_prefix(inner,
                     {{"pre_norm.", "pre_norm."},
                      {"ff_norm.", "ff_norm."},
                      {"cross_norm.", "cross_attend_norm."},
                      {"self.qkv.", "self_attn.to_qkv."},
                      {"self.out.", "self_attn.to_out."},
                      {"self.q_norm.", "self_attn.q_norm."},
                      {"self.k_norm.", "self_attn.k_norm."},
                      {"cross.q.", "cross_attn.to_q."},
                      {"cross.kv.", "cross_attn.to_kv."},
                      {"cross.out.", "cross_attn.to_out."},
                      {"cross.q_norm.", "cross_attn.q_norm."},
                      {"cross.k_norm.", "cross_attn.k_norm."},
                      {"ff.proj.", "ff.ff.0.proj."},
                      {"ff.out.", "ff.ff.2."},
                      {"local.", "to_local_embed."}},
                     out))
    return block + out;
  return "";
}

// SAME's names; `taps` is set for a mapping tap (w0, w1, ...), whose official name is its
// convolution's weight.
std::string ae_official(const std::string& name, int& tap) {
  const std::string p = "pretransform.model.";
  tap = -1;
  for (const char* side : {"dec", "enc"}) {
    const std::string mapping = std::string("ae.") + side + ".mapping.";
    const std::string at = p + (side == std::string("dec") ? "decoder.layers.3." : "encoder.layers.0.");
    if (name.starts_with(mapping)) {
      const std::string rest = name.substr(mapping.size());
      if (rest == "bias" || rest == "weight") return at + "mapping." + rest;
      if (rest.size() >= 2 && rest[0] == 'w' && rest.find_first_not_of("0123456789", 1) == std::string::npos &&
          rest.size() < 4) {
        tap = std::stoi(rest.substr(1));
        return at + "mapping.weight";
      }
      return "";
    }
    if (name == std::string("ae.") + side + ".new_tokens") return at + "new_tokens";
    std::string index, inner;
    const std::string blocks = std::string("ae.") + side + ".";
    if (name.starts_with(blocks) && split_block(name.substr(blocks.size()), index, inner)) {
      std::string out = inner;
      replace_prefix(inner, {{"ff.proj.", "ff.ff.0.proj."}, {"ff.out.", "ff.ff.2."}}, out);
      return at + "transformers." + index + "." + out;
    }
  }
  std::string out;
  if (name == "ae.running_std" || name == "ae.scaling_factor" || name == "ae.bias")
    return p + "bottleneck." + name.substr(3);
  if (replace_prefix(name, {{"ae.in_proj.", p + "decoder.layers.1."}, {"ae.out_proj.", p + "encoder.layers.2."}}, out))
    return out;
  return "";
}

std::string conditioner_official(const std::string& name) {
  if (name == "te.padding_embedding") return "conditioner.conditioners.prompt.padding_embedding";
  if (name == "te.secs.weight" || name == "te.secs.bias")
    return "conditioner.conditioners.seconds_total.embedder.embedding.1." + name.substr(8);
  return "";
}

// T5Gemma's names; `norm` is set for Gemma's RMSNorm weights, stored as 1 + w.
std::string t5gemma_official(const std::string& name, bool& norm) {
  norm = false;
  if (name == "te.embed.weight") return "encoder.embed_tokens.weight";
  if (name == "te.norm.weight") {
    norm = true;
    return "encoder.norm.weight";
  }
  std::string index, inner;
  if (!name.starts_with("te.") || !split_block(name.substr(3), index, inner)) return "";
  const std::string layer = "encoder.layers." + index + ".";
  static const std::map<std::string, std::string> norms = {
      {"attn_norm.weight", "pre_self_attn_layernorm.weight"},
      {"attn_post_norm.weight", "post_self_attn_layernorm.weight"},
      {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
      {"ffn_post_norm.weight", "post_feedforward_layernorm.weight"}};
  static const std::map<std::string, std::string> linears = {
      {"q.weight", "self_attn.q_proj.weight"}, {"k.weight", "self_attn.k_proj.weight"},
      {"v.weight", "self_attn.v_proj.weight"}, {"o.weight", "self_attn.o_proj.weight"},
      {"gate.weight", "mlp.gate_proj.weight"}, {"up.weight", "mlp.up_proj.weight"},
      {"down.weight", "mlp.down_proj.weight"}};
  if (const auto it = norms.find(inner); it != norms.end()) {
    norm = true;
    return layer + it->second;
  }
  if (const auto it = linears.find(inner); it != linears.end()) return layer + it->second;
  return "";
}

}  // namespace

std::string gguf_architecture(const std::string& path) {
  if (!is_gguf_file(path)) return "";
  return GgufFile::open(path).metadata_string("general.architecture");
}

namespace {

// The official name of `stored` in `file` (of sa3.cpp's architecture `arch`, the i-th of the
// checkpoint's files) and where its values come from: entries[official], or the convolution its
// tap is one of.
void add_entry(const SingleFile& file, size_t i, const std::string& arch, const std::string& stored,
               std::map<std::string, StoredAs>& entries) {
  std::string official;
  StoredAs s{.name = stored, .file = i, .shape = file.stored_shape(stored)};
  if (arch == kGgufDit) {
    official = dit_official(stored);
  } else if (arch == kGgufAutoencoder) {
    int tap = -1;
    official = ae_official(stored, tap);
    if (tap >= 0) {
      const std::string stem = stored.substr(0, stored.size() - std::to_string(tap).size() - 2);
      StoredAs& taps = entries.try_emplace(official, StoredAs{.name = stem, .file = i}).first->second;
      taps.taps = std::max(taps.taps, tap + 1);
      return;
    }
  } else if (arch == kGgufConditioner || arch == kGgufTextEncoder) {
    official = conditioner_official(stored);
    if (official.empty() && arch == kGgufTextEncoder) {
      bool norm = false;
      official = t5gemma_official(stored, norm);
      if (norm) s = {.name = stored, .file = i, .offset = -1};
    }
  } else {
    fail(file.path(), ": general.architecture is '", arch, "', expected one of sa3.cpp's model files (", kGgufDit, ", ",
         kGgufAutoencoder, ", ", kGgufConditioner, ", ", kGgufTextEncoder, ")");
  }
  APUS_CHECK(!official.empty(), file.path(), ": tensor '", stored, "' is no tensor of sa3.cpp's ", arch, " files");
  entries[official] = s;
}

}  // namespace

std::shared_ptr<const WeightSource> gguf_checkpoint(const std::vector<std::shared_ptr<SingleFile>>& files) {
  std::string origin;
  for (const auto& f : files) {
    APUS_CHECK(f->is_gguf(), f->path(), ": not a GGUF file (expected one of sa3.cpp's)");
    origin += (origin.empty() ? "" : ", ") + f->path();
  }
  // The conditioner's own file goes last, so its tensors replace an older encoder file's.
  std::vector<std::shared_ptr<SingleFile>> order;
  std::map<std::string, StoredAs> entries;
  for (const bool conditioner : {false, true})
    for (const auto& f : files) {
      const std::string arch = f->gguf()->metadata_string("general.architecture");
      if ((arch == kGgufConditioner) != conditioner) continue;
      order.push_back(f);
      for (const std::string& stored : f->stored_names()) add_entry(*f, order.size() - 1, arch, stored, entries);
    }
  for (const auto& [official, s] : entries)
    for (int t = 0; t < s.taps; ++t)
      APUS_CHECK(order[s.file]->contains(s.name + ".w" + std::to_string(t)), order[s.file]->path(), ": tensor '",
                 s.name, ".w", t, "' is missing (the mapping's taps are w0..w", s.taps - 1, ")");
  return std::make_shared<RenamedSource>(std::vector<std::shared_ptr<const WeightSource>>(order.begin(), order.end()),
                                         RenamedSource::table(std::move(entries)), origin);
}

}  // namespace apus::sa3
