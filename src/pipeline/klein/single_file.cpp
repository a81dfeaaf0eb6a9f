#include "pipeline/klein/single_file.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "core/error.h"

namespace apus::flux2 {

namespace {

// ComfyUI's and diffusers' prefixes for a checkpoint's diffusion model.
const char* const kPrefixes[] = {"model.diffusion_model.", "diffusion_model."};

std::string strip_prefix(const std::string& name) {
  for (const char* p : kPrefixes)
    if (name.starts_with(p)) return name.substr(std::strlen(p));
  return name;
}

// BFL's names of whole tensors -> diffusers', within a double block, a single block, and at the top.
const std::map<std::string, std::string> kDouble = {
    {"img_attn.norm.query_norm", "attn.norm_q"},
    {"img_attn.norm.key_norm", "attn.norm_k"},
    {"img_attn.proj", "attn.to_out.0"},
    {"img_mlp.0", "ff.linear_in"},
    {"img_mlp.2", "ff.linear_out"},
    {"txt_attn.norm.query_norm", "attn.norm_added_q"},
    {"txt_attn.norm.key_norm", "attn.norm_added_k"},
    {"txt_attn.proj", "attn.to_add_out"},
    {"txt_mlp.0", "ff_context.linear_in"},
    {"txt_mlp.2", "ff_context.linear_out"},
};
const std::map<std::string, std::string> kSingle = {
    {"linear1", "attn.to_qkv_mlp_proj"},
    {"linear2", "attn.to_out"},
    {"norm.query_norm", "attn.norm_q"},
    {"norm.key_norm", "attn.norm_k"},
};
const std::map<std::string, std::string> kTop = {
    {"img_in", "x_embedder"},
    {"txt_in", "context_embedder"},
    {"time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_1"},
    {"time_in.out_layer", "time_guidance_embed.timestep_embedder.linear_2"},
    {"guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_1"},
    {"guidance_in.out_layer", "time_guidance_embed.guidance_embedder.linear_2"},
    {"double_stream_modulation_img.lin", "double_stream_modulation_img.linear"},
    {"double_stream_modulation_txt.lin", "double_stream_modulation_txt.linear"},
    {"single_stream_modulation.lin", "single_stream_modulation.linear"},
    {"final_layer.linear", "proj_out"},
};

// "double_blocks.3.img_attn.qkv.weight" -> {"double_blocks", "3", "img_attn.qkv", "weight"}.
struct Parts {
  std::string group, index, module, param;
};
bool split_block_name(const std::string& name, Parts& p) {
  const size_t a = name.find('.'), b = a == std::string::npos ? a : name.find('.', a + 1);
  const size_t last = name.rfind('.');
  if (b == std::string::npos || last <= b) return false;
  p = {name.substr(0, a), name.substr(a + 1, b - a - 1), name.substr(b + 1, last - b - 1), name.substr(last + 1)};
  return p.index.find_first_not_of("0123456789") == std::string::npos && !p.index.empty();
}

}  // namespace

bool bfl_module_targets(const std::string& module, std::vector<DiffusersTarget>& out) {
  out.clear();
  Parts p;
  if (split_block_name(module + ".x", p) && p.group == "double_blocks") {
    const std::string to = "transformer_blocks." + p.index + ".";
    if (p.module == "img_attn.qkv" || p.module == "txt_attn.qkv") {
      const bool img = p.module[0] == 'i';
      const char* names[3] = {img ? "attn.to_q" : "attn.add_q_proj", img ? "attn.to_k" : "attn.add_k_proj",
                              img ? "attn.to_v" : "attn.add_v_proj"};
      for (int i = 0; i < 3; ++i) out.push_back({to + names[i], i, 3});
      return true;
    }
    const auto it = kDouble.find(p.module);
    if (it == kDouble.end()) return false;
    out.push_back({to + it->second});
    return true;
  }
  if (split_block_name(module + ".x", p) && p.group == "single_blocks") {
    const auto it = kSingle.find(p.module);
    if (it == kSingle.end()) return false;
    out.push_back({"single_transformer_blocks." + p.index + "." + it->second});
    return true;
  }
  if (module == "final_layer.adaLN_modulation.1") {
    out.push_back({"norm_out.linear", 0, 1, /*swap_halves=*/true});
    return true;
  }
  const auto it = kTop.find(module);
  if (it == kTop.end()) return false;
  out.push_back({it->second});
  return true;
}

std::vector<std::string> bfl_modules(int64_t double_blocks, int64_t single_blocks) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < double_blocks; ++i) {
    const std::string p = "double_blocks." + std::to_string(i) + ".";
    out.push_back(p + "img_attn.qkv");
    out.push_back(p + "txt_attn.qkv");
    for (const auto& [bfl, diffusers] : kDouble) out.push_back(p + bfl);
  }
  for (int64_t i = 0; i < single_blocks; ++i)
    for (const auto& [bfl, diffusers] : kSingle) out.push_back("single_blocks." + std::to_string(i) + "." + bfl);
  for (const auto& [bfl, diffusers] : kTop) out.push_back(bfl);
  out.push_back("final_layer.adaLN_modulation.1");
  return out;
}

bool holds_transformer(const SingleFile& file) {
  for (const std::string& s : file.stored_names()) {
    const std::string name = strip_prefix(s);
    if (name == "single_stream_modulation.lin.weight" || name == "single_stream_modulation.linear.weight") return true;
  }
  return false;
}

TransformerFile open_transformer_file(const std::string& path) {
  auto file = SingleFile::open(path);
  TransformerFile out;
  std::map<std::string, StoredAs> entries;
  std::map<std::string, std::string> stripped;  // stripped name -> stored
  for (const std::string& s : file->stored_names()) stripped[strip_prefix(s)] = s;
  const bool bfl = stripped.count("single_stream_modulation.lin.weight") > 0;
  const bool diffusers = stripped.count("single_stream_modulation.linear.weight") > 0;
  APUS_CHECK(bfl || diffusers, path,
             ": not a FLUX.2 transformer (expected BFL's 'single_stream_modulation.lin.weight' ",
             "or diffusers' 'single_stream_modulation.linear.weight'; the file holds ", file->stored_names().size(),
             " tensors", file->stored_names().empty() ? "" : ", the first '" + file->stored_names().front() + "'", ")");
  out.layout = bfl ? "BFL" : "diffusers";
  int64_t doubles = -1, singles = -1;
  std::vector<DiffusersTarget> targets;
  for (const auto& [name, stored] : stripped) {
    Parts p;
    const bool in_block = split_block_name(name, p);
    if (in_block && (p.group == "double_blocks" || p.group == "transformer_blocks"))
      doubles = std::max<int64_t>(doubles, std::stoll(p.index.substr(0, 9)));
    if (in_block && (p.group == "single_blocks" || p.group == "single_transformer_blocks"))
      singles = std::max<int64_t>(singles, std::stoll(p.index.substr(0, 9)));
    if (!bfl) {
      entries[name] = {.name = stored};
      continue;
    }
    const size_t dot = name.rfind('.');
    const std::string module = dot == std::string::npos ? name : name.substr(0, dot);
    const std::string param = dot == std::string::npos ? "" : name.substr(dot + 1);
    APUS_CHECK(param == "weight" || param == "bias" || param == "scale", path, ": tensor '", stored,
               "' is not a FLUX.2 transformer key (expected .weight, .bias or .scale)");
    APUS_CHECK(bfl_module_targets(module, targets), path, ": tensor '", stored, "' is not a FLUX.2 ",
               in_block && p.group == "double_blocks"   ? "double-block key"
               : in_block && p.group == "single_blocks" ? "single-block key"
                                                        : "transformer key");
    const Shape shape = file->stored_shape(stored);
    const int64_t rows = shape.at(0);
    for (const DiffusersTarget& t : targets) {
      APUS_CHECK(rows % t.parts == 0, path, ": tensor '", stored, "' has ", rows, " rows, expected ", t.parts,
                 " stacked parts");
      StoredAs e{.name = stored};
      if (t.parts > 1) {
        e.shape = shape;
        e.begin = t.part * rows / t.parts;
        e.end = (t.part + 1) * rows / t.parts;
      }
      if (t.swap_halves) e.row_blocks = {1, 0};
      entries[t.module + "." + (param == "scale" ? "weight" : param)] = e;
    }
  }
  out.double_blocks = doubles + 1;
  out.single_blocks = singles + 1;
  const std::string embed = stripped.count("img_in.weight") ? "img_in.weight" : "x_embedder.weight";
  APUS_CHECK(stripped.count(embed), path, ": no '", embed, "' (the image embedding)");
  out.hidden = file->stored_shape(stripped[embed]).at(0);
  out.weights = std::make_shared<RenamedSource>(std::vector<std::shared_ptr<const WeightSource>>{file},
                                                RenamedSource::table(std::move(entries)), path);
  return out;
}

namespace {

// "up.3.block.1.conv1.weight" after `head` ("up.") -> {3, "block.1.conv1.weight"}.
bool split_index(const std::string& name, const std::string& head, int64_t& index, std::string& rest) {
  if (!name.starts_with(head)) return false;
  const size_t dot = name.find('.', head.size());
  const std::string digits = name.substr(head.size(), dot == std::string::npos ? dot : dot - head.size());
  if (dot == std::string::npos || digits.empty() || digits.size() > 6 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return false;
  index = std::stoll(digits);
  rest = name.substr(dot + 1);
  return true;
}

// A resnet's parameter in ldm names ("conv1.weight", "nin_shortcut.bias") in diffusers'.
std::string resnet_param(const std::string& p) {
  return p.rfind("nin_shortcut.", 0) == 0 ? "conv_shortcut." + p.substr(13) : p;
}

// An ldm VAE name (prefix and quant-conv placement already normalised) in diffusers' names;
// false if it is no FLUX.2 VAE key. `up_blocks` reverses the decoder's block order.
bool ldm_vae_name(const std::string& name, int64_t up_blocks, std::string& to, bool& conv_as_linear) {
  static const std::map<std::string, std::string> attention = {
      {"norm", "group_norm"}, {"q", "to_q"}, {"k", "to_k"}, {"v", "to_v"}, {"proj_out", "to_out.0"}};
  static const std::map<std::string, std::string> same = {{"quant_conv", ""},
                                                          {"post_quant_conv", ""},
                                                          {"encoder.conv_in", ""},
                                                          {"encoder.conv_out", ""},
                                                          {"decoder.conv_in", ""},
                                                          {"decoder.conv_out", ""},
                                                          {"encoder.norm_out", "encoder.conv_norm_out"},
                                                          {"decoder.norm_out", "decoder.conv_norm_out"}};
  conv_as_linear = false;
  if (name == "bn.running_mean" || name == "bn.running_var" || name == "bn.num_batches_tracked") {
    to = name;
    return true;
  }
  const size_t last = name.rfind('.');
  if (last == std::string::npos) return false;
  const std::string module = name.substr(0, last), param = name.substr(last + 1);
  if (param != "weight" && param != "bias") return false;
  if (const auto it = same.find(module); it != same.end()) {
    to = (it->second.empty() ? module : it->second) + "." + param;
    return true;
  }
  const std::string coder = name.substr(0, 8);  // "encoder." or "decoder."
  if (coder != "encoder." && coder != "decoder.") return false;
  const std::string inner = name.substr(8);
  int64_t i = 0, j = 0;
  std::string rest, tail;
  if (split_index(inner, "mid.block_", i, rest) && (i == 1 || i == 2)) {
    to = coder + "mid_block.resnets." + std::to_string(i - 1) + "." + resnet_param(rest);
    return true;
  }
  if (inner.starts_with("mid.attn_1.")) {
    const std::string sub = inner.substr(11, inner.size() - 11 - param.size() - 1);
    const auto it = attention.find(sub);
    if (it == attention.end()) return false;
    to = coder + "mid_block.attentions.0." + it->second + "." + param;
    conv_as_linear = sub != "norm" && param == "weight";
    return true;
  }
  const bool down = coder == "encoder.";
  if (!split_index(inner, down ? "down." : "up.", i, rest)) return false;
  const std::string blocks = down ? "down_blocks." : "up_blocks.";
  if (!down) {
    if (i >= up_blocks) return false;
    i = up_blocks - 1 - i;
  }
  const std::string at = coder + blocks + std::to_string(i) + ".";
  if (split_index(rest, "block.", j, tail)) {
    to = at + "resnets." + std::to_string(j) + "." + resnet_param(tail);
    return true;
  }
  const std::string sampler = down ? "downsample.conv." : "upsample.conv.";
  if (!rest.starts_with(sampler)) return false;
  to = at + (down ? "downsamplers.0.conv." : "upsamplers.0.conv.") + rest.substr(sampler.size());
  return true;
}

}  // namespace

std::shared_ptr<const WeightSource> open_vae_file(const std::string& path) {
  auto file = SingleFile::open(path);
  std::map<std::string, std::string> bare;  // name without prefix, quant convs at the top -> stored
  for (const std::string& s : file->stored_names()) {
    std::string n = s;
    for (const char* p : {"first_stage_model.", "vae."})
      if (n.starts_with(p)) n = n.substr(std::strlen(p));
    for (const char* nested : {"encoder.quant_conv.", "decoder.post_quant_conv."})
      if (n.starts_with(nested)) n = n.substr(8);
    bare[n] = s;
  }
  const bool diffusers = bare.count("decoder.up_blocks.0.resnets.0.conv1.weight") > 0;
  const bool ldm = bare.count("decoder.up.0.block.0.conv1.weight") > 0;
  APUS_CHECK(diffusers || ldm, path,
             ": not a FLUX.2 VAE (expected diffusers' 'decoder.up_blocks.0.resnets.0.conv1.weight' ",
             "or BFL's 'decoder.up.0.block.0.conv1.weight'; the file holds ", file->stored_names().size(), " tensors",
             file->stored_names().empty() ? "" : ", the first '" + file->stored_names().front() + "'", ")");
  APUS_CHECK(bare.count("bn.running_mean") && bare.count("bn.running_var"), path,
             ": a VAE without FLUX.2's latent batch norm ('bn.running_mean', 'bn.running_var'): not a FLUX.2 VAE");
  int64_t up_blocks = 0, index = 0;
  std::string rest;
  for (const auto& [name, stored] : bare)
    if (split_index(name, "decoder.up.", index, rest)) up_blocks = std::max(up_blocks, index + 1);
  std::map<std::string, StoredAs> entries;
  for (const auto& [name, stored] : bare) {
    if (diffusers) {
      entries[name] = {.name = stored};
      continue;
    }
    std::string to;
    bool conv_as_linear = false;
    APUS_CHECK(ldm_vae_name(name, up_blocks, to, conv_as_linear), path, ": tensor '", stored,
               "' is not a FLUX.2 VAE key in BFL's names");
    entries[to] = {.name = stored, .shape = conv_as_linear ? file->stored_shape(stored) : Shape{}};
  }
  return std::make_shared<RenamedSource>(std::vector<std::shared_ptr<const WeightSource>>{file},
                                         RenamedSource::table(std::move(entries)), path);
}

std::shared_ptr<const WeightSource> open_text_encoder_file(const std::string& path) {
  auto file = SingleFile::open(path);
  const std::vector<std::string>& names = file->stored_names();
  auto holds = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  if (holds("model.embed_tokens.weight") || holds("embed_tokens.weight")) return file;
  APUS_CHECK(holds("token_embd.weight"), path, ": not a Qwen3 text encoder (expected transformers' ",
             "'model.embed_tokens.weight' or llama.cpp's 'token_embd.weight'; the file holds ", names.size(),
             " tensors", names.empty() ? "" : ", the first '" + names.front() + "'", ")");
  if (file->is_gguf()) {
    const std::string arch = file->gguf()->metadata_string("general.architecture");
    APUS_CHECK(arch == "qwen3", path, ": general.architecture is '", arch, "', expected qwen3 (FLUX.2 [klein]'s ",
               "text encoder)");
  }
  // llama.cpp's names within a block -> transformers'.
  static const std::map<std::string, std::string> block = {
      {"attn_norm", "input_layernorm"},    {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},      {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"}, {"attn_q_norm", "self_attn.q_norm"},
      {"attn_k_norm", "self_attn.k_norm"}, {"ffn_norm", "post_attention_layernorm"},
      {"ffn_gate", "mlp.gate_proj"},       {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"}};
  std::map<std::string, StoredAs> entries;
  for (const std::string& stored : names) {
    if (stored == "token_embd.weight") {
      entries["model.embed_tokens.weight"] = {.name = stored};
    } else if (stored == "output_norm.weight") {
      entries["model.norm.weight"] = {.name = stored};
    } else if (stored == "output.weight") {
      continue;  // the language-model head: klein reads hidden states only
    } else {
      Parts p;
      const auto it = split_block_name(stored, p) && p.group == "blk" ? block.find(p.module) : block.end();
      APUS_CHECK(it != block.end() && p.param == "weight", path, ": tensor '", stored,
                 "' is not a Qwen3 GGUF key (expected blk.N.attn_q.weight ... as llama.cpp names them)");
      entries["model.layers." + p.index + "." + it->second + ".weight"] = {.name = stored};
    }
  }
  return std::make_shared<RenamedSource>(std::vector<std::shared_ptr<const WeightSource>>{file},
                                         RenamedSource::table(std::move(entries)), path);
}

}  // namespace apus::flux2
