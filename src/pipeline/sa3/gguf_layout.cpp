// sa3.cpp's GGUF files as a Stable Audio 3 pipeline: the DiT named by --model, the other parts by
// --vae, --text-encoder and --tokenizer or found beside it by what they are (general.architecture,
// and for the variant's own parts general.finetune), the configs of the published layout the
// DiT's variant names (or --config), each of the files' metadata checked against them.
#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "io/files.h"
#include "io/hf_cache.h"
#include "io/weights/single_file.h"
#include "io/weights/synth.h"
#include "pipeline/sa3/gguf_checkpoint.h"
#include "pipeline/sa3/sa3_model.h"

namespace apus {

namespace {

namespace fs = std::filesystem;

// The variant a DiT or autoencoder file names ("medium", "small-music", "small-sfx"), with
// whether it is a -base (training) DiT.
struct Variant {
  std::string name;
  bool base = false;
};

Variant variant_of(const GgufFile& f) {
  std::string finetune = f.metadata_string("general.finetune");
  Variant v;
  if (finetune.ends_with("-base")) {
    v.base = true;
    finetune.resize(finetune.size() - 5);
  }
  v.name = finetune;
  return v;
}

// A GGUF file beside the DiT: what it is (general.architecture) and the variant it names.
struct Sibling {
  std::string path, arch, variant;
};

// The GGUF files in `anchor`'s folder that are sa3.cpp's (a string general.architecture), read
// once, in name order. Others, corrupt ones too, are skipped: they are only searched for the
// parts no flag names, and a part a flag names is checked where it is opened.
std::vector<Sibling> siblings_of(const std::string& anchor) {
  std::vector<Sibling> found;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(fs::absolute(anchor).parent_path(), ec)) {
    const std::string path = e.path().string();
    if (!path.ends_with(".gguf") || !e.is_regular_file(ec) || !is_gguf_file(path)) continue;
    try {
      const GgufFile f = GgufFile::open(path);
      found.push_back({path, f.metadata_string("general.architecture"), variant_of(f).name});
    } catch (const Error&) {
      continue;  // not a GGUF apus can read, or no architecture: not one of sa3.cpp's parts
    }
  }
  std::sort(found.begin(), found.end(), [](const Sibling& a, const Sibling& b) { return a.path < b.path; });
  return found;
}

// The part `given` names (checked to be `arch`), or the one sibling of the DiT that is `arch`
// (and, where `finetune` is not empty, of that variant); empty when there is none and `required`
// is false.
std::string find_part(const std::string& given, const std::vector<Sibling>& siblings, const std::string& dit,
                      const char* arch, const std::string& finetune, const char* flag, const char* what,
                      bool required) {
  if (!given.empty()) {
    const std::string a = sa3::gguf_architecture(given);
    APUS_CHECK(a == arch, given, ": ", a.empty() ? "not a GGUF file" : "general.architecture is '" + a + "'",
               ", expected ", arch, " (sa3.cpp's ", what, ")");
    return given;
  }
  std::vector<std::string> found;
  for (const Sibling& f : siblings)
    if (f.arch == arch && (finetune.empty() || f.variant == finetune)) found.push_back(f.path);
  std::string list;
  for (const std::string& f : found) list += " " + f;
  // The conditioner has no flag: it is always the one beside the DiT.
  const std::string choose = *flag ? std::string("name one with ") + flag : "keep only one beside the DiT";
  APUS_CHECK(found.size() <= 1, dit, ": ", found.size(), " files beside it are sa3.cpp's ", what, ":", list, "; ",
             choose);
  APUS_CHECK(!found.empty() || !required, dit, ": no ", what, " beside it (a GGUF whose general.architecture is ", arch,
             finetune.empty() ? "" : " and general.finetune " + finetune, "); ", choose);
  return found.empty() ? "" : found.front();
}

// Refuses a metadata number of `file` that differs from what the layout's config says.
class MetadataCheck {
 public:
  MetadataCheck(const GgufFile& file, std::string config) : file_(file), config_(std::move(config)) {}
  void operator()(const std::string& key, double expected) const {
    const nlohmann::json& m = file_.metadata();
    if (!m.contains(key)) return;
    const nlohmann::json& v = m[key];
    APUS_CHECK(v.is_number() || v.is_boolean(), file_.path(), ": ", key, " is ", v.dump(), ", expected a number");
    const double got = v.is_boolean() ? double(v.get<bool>()) : v.get<double>();
    APUS_CHECK(got == expected || std::fabs(got - expected) <= 1e-6 * std::fabs(expected), file_.path(), ": ", key,
               " is ", v.dump(), " but ", config_, " says ", expected,
               "; pass --config DIR, the official folder (model_config.json beside its T5Gemma folder) of this model");
  }

 private:
  const GgufFile& file_;
  std::string config_;
};

}  // namespace

std::unique_ptr<AudioModel> open_sa3_gguf(const ModelParts& parts, Weights weights, Backend* device) {
  const std::string& dit_path = parts.model;
  auto dit = SingleFile::open(dit_path);
  const GgufFile& dit_meta = *dit->gguf();
  const std::string arch = dit_meta.metadata_string("general.architecture");
  APUS_CHECK(arch == sa3::kGgufDit, dit_path, ": general.architecture is '", arch, "', expected ", sa3::kGgufDit,
             " (sa3.cpp's DiT: --model names the DiT, the other parts go to --vae, --text-encoder and --tokenizer)");
  const Variant variant = variant_of(dit_meta);
  std::string root;
  if (!parts.config.empty()) {
    root = resolve_model_dir(parts.config, Weights::none);
  } else {
    static const char* const kVariants[] = {"medium", "small-music", "small-sfx"};
    std::string names;
    for (const char* v : kVariants) names += std::string(names.empty() ? "" : ", ") + v;
    APUS_CHECK(std::find(std::begin(kVariants), std::end(kVariants), variant.name) != std::end(kVariants), dit_path,
               ": general.finetune is '", dit_meta.metadata_string("general.finetune"), "', none of the published ",
               "variants (", names, "); pass --config DIR, the official folder of this model");
    APUS_CHECK(!variant.base, dit_path, ": a -base (training) DiT; its sampler and guidance are in the official ",
               "folder's model_config.json: pass --config DIR");
    root = published_layout_dir("stable-audio-3-" + variant.name);
  }
  Sa3Layout l = official_layout(root);
  use_quant(l, parts.quant, device);
  const std::string config = root + "/model_config.json";
  {
    const MetadataCheck check(dit_meta, config);
    const sa3::DitConfig& d = l.dit;
    check("dit.io", double(d.io_channels));
    check("dit.dim", double(d.dim));
    check("dit.depth", double(d.depth));
    check("dit.heads", double(d.heads));
    check("dit.head_dim", double(d.head_dim));
    check("dit.rot", double(d.rope_dim));
    check("dit.cond_dim", double(d.cond_dim));
    check("dit.mem_tokens", double(d.memory_tokens));
    check("dit.time_dim", double(d.timestep_features));
    check("dit.differential", d.differential ? 1 : 0);
    check("dit.local_dim", double(d.local_dim));
    check("dit.norm_eps", d.norm_eps);
    check("dit.qk_eps", d.qk_norm_eps);
  }
  const std::vector<Sibling> siblings = siblings_of(dit_path);
  const std::string same_path =
      find_part(parts.vae, siblings, dit_path, sa3::kGgufAutoencoder, variant.name, "--vae", "SAME autoencoder", true);
  auto same = SingleFile::open(same_path);
  {
    const MetadataCheck check(*same->gguf(), config);
    const sa3::SameConfig& s = l.same;
    check("sa3.ae.latent_dim", double(s.latent_dim));
    check("sa3.ae.dim", double(s.dim));
    check("sa3.ae.dim_heads", double(s.head_dim));
    check("sa3.ae.depth", double(s.depth));
    check("sa3.ae.stride", double(s.stride));
    check("sa3.ae.sinusoidal_blocks", double(s.sin_blocks));
    check("sa3.ae.patch_size", double(s.patch_size));
    check("sa3.ae.audio_channels", double(s.audio_channels));
    check("sa3.ae.sample_rate", double(s.sample_rate));
    check("sa3.ae.chunk", s.midpoint_shift ? 1 : 0);
    check("sa3.ae.dec_conv_mapping", s.mapping_kernel == 3 ? 1 : 0);
  }
  std::vector<std::shared_ptr<SingleFile>> files = {dit, same};
  // T5Gemma: sa3.cpp's encoder file, or a safetensors file in transformers' names as the other
  // single-file layouts take.
  const bool text_gguf = parts.text_encoder.empty() || is_gguf_file(parts.text_encoder);
  std::shared_ptr<SingleFile> text;
  if (text_gguf) {
    text = SingleFile::open(find_part(parts.text_encoder, siblings, dit_path, sa3::kGgufTextEncoder, "",
                                      "--text-encoder", "T5Gemma encoder", true));
    files.push_back(text);
    l.text_weights.clear();
    const sa3::T5GemmaConfig t = sa3::T5GemmaConfig::read(read_config(l.text_dir + "/config.json"));
    const MetadataCheck check(*text->gguf(), l.text_dir + "/config.json");
    check("t5g.dim", double(t.hidden));
    check("t5g.layers", double(t.layers));
    check("t5g.heads", double(t.heads));
    check("t5g.head_dim", double(t.head_dim));
    check("t5g.intermediate", double(t.intermediate));
    check("t5g.vocab", double(t.vocab));
    check("t5g.eps", t.eps);
    check("t5g.rope_theta", t.rope_theta);
    check("t5g.attn_softcap", t.softcap);
    check("t5g.max_length", l.max_tokens);
  } else {
    l.text_weights = parts.text_encoder;
  }
  // The duration conditioner and prompt padding: their own file, or (older files) the encoder's.
  const std::string conditioner_path =
      find_part("", siblings, dit_path, sa3::kGgufConditioner, variant.name, "", "conditioner", false);
  if (!conditioner_path.empty()) {
    files.push_back(SingleFile::open(conditioner_path));
  } else {
    APUS_CHECK(text && text->gguf()->contains("te.secs.weight"), dit_path, ": no conditioner beside it (sa3.cpp's ",
               "stable-audio-3-", variant.name, "-conditioner-v1.0-F32.gguf: general.architecture ",
               sa3::kGgufConditioner, "), and the text encoder carries none (te.secs.weight)");
  }
  {
    const SingleFile& holder = conditioner_path.empty() ? *text : *files.back();
    const MetadataCheck check(*holder.gguf(), config);
    check("t5g.secs_min", l.duration.min_val);
    check("t5g.secs_max", l.duration.max_val);
  }
  l.gguf = sa3::gguf_checkpoint(files);
  l.label = fs::path(dit_path).filename().string();
  l.checkpoint = dit_path;
  // The tokenizer: named, or the config folder's own (the layouts apus carries have a stand-in),
  // or sa3.cpp's vocabulary beside the DiT.
  if (!tokenizer_from_parts(parts, l) && (parts.config.empty() || !path_exists(l.tokenizer_model)))
    l.tokenizer_model =
        find_part("", siblings, dit_path, sa3::kGgufVocabulary, "", "--tokenizer", "tokenizer vocabulary", true);
  l.tensor_ranks = parts.tensor_ranks;
  return std::make_unique<Sa3Model>(std::move(l), weights, device);
}

}  // namespace apus
