#include "pipeline/registry.h"

#include <filesystem>
#include <optional>
#include <string>

#include "core/error.h"
#include "io/gguf.h"
#include "io/hf_cache.h"
#include "io/int8_weights.h"
#include "io/single_file.h"
#include "io/synth.h"
#include "models/flux2/single_file.h"
#include "models/sa3/gguf_checkpoint.h"
#include "ops/backend.h"
#include "ops/cpu/cpu_ops.h"
#include "pipeline/klein/single_file_layout.h"

namespace apus {

namespace {

template <typename Model> struct Family {
  const char* pipeline_class;
  std::unique_ptr<Model> (*open)(const ModelDir&, Weights);
};

const Family<ImageModel> kImageFamilies[] = {
    {"Flux2KleinPipeline", open_klein},
    {"Flux2KleinKVPipeline", open_klein},
};
const Family<AudioModel> kAudioFamilies[] = {
    {"StableAudio3Pipeline", open_sa3},
};

// Whether a model directory is in the official single-checkpoint layout (model_config.json, no
// model_index.json) rather than diffusers' (model_index.json); a directory with neither is refused
// naming both.
bool single_checkpoint(const std::string& root) {
  if (path_exists(root + "/model_index.json")) return false;
  APUS_CHECK(path_exists(root + "/model_config.json"), root, ": neither a diffusers folder (model_index.json) ",
             "nor a Stable Audio 3 checkpoint (model_config.json)");
  return true;
}

// Opens `model` with the family its model_index.json names, or says which command serves it.
template <typename Model, size_t N, size_t M, typename Other>
std::unique_ptr<Model> open_family(const ModelDir& dir, Weights weights, const Family<Model> (&families)[N],
                                   const Family<Other> (&others)[M], const char* other_command) {
  const std::string& root = dir.root();
  for (const Family<Model>& f : families)
    if (dir.pipeline_class() == f.pipeline_class) return f.open(dir, weights);
  for (const Family<Other>& f : others)
    APUS_CHECK(dir.pipeline_class() != f.pipeline_class, root, "/model_index.json: ", dir.pipeline_class(),
               " is served by `apus ", other_command, "`");
  std::string known;
  for (const Family<Model>& f : families) known += std::string(known.empty() ? "" : ", ") + f.pipeline_class;
  fail(root, "/model_index.json: _class_name '", dir.pipeline_class(), "' is not supported (supported: ", known, ")");
}

}  // namespace

std::string resolve_model_dir(const std::string& model, Weights weights) {
  if (is_directory(model)) return model;
  APUS_CHECK(!path_exists(model), model, ": is a file, expected a model directory");
  // A repository id as Hugging Face users name models: its snapshot of main in the local cache.
  if (const std::optional<std::string> snapshot = hf_cached_snapshot(model)) return *snapshot;
  APUS_CHECK(!is_repo_id(model), model, ": not a directory, and not in the Hugging Face cache ", hf_repo_dir(model),
             " (download it with `apus pull ", model, "` or huggingface-cli download)");
  // Counting may name a published model whose configs ship in data/ ("flux2-klein-4b",
  // "stable-audio-3-medium").
  const bool plain_name = !model.empty() && model.find('/') == std::string::npos && model[0] != '.';
  const std::string published = plain_name ? published_layout_dir(model) : "";
  std::string names;
  for (const std::string& name : kPublishedModels) names += (names.empty() ? "" : ", ") + name;
  APUS_CHECK(weights == Weights::none && plain_name &&
                 (path_exists(published + "/model_index.json") || path_exists(published + "/model_config.json")),
             model, ": model directory does not exist",
             weights == Weights::none ? " (nor is it a published name: " + names + ")" : "");
  return published;
}

std::string model_label(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  for (const auto& part : p) {
    const std::string s = part.string();
    if (s.rfind("models--", 0) == 0) {
      std::string id = s.substr(8);
      const size_t sep = id.find("--");
      if (sep != std::string::npos) id.replace(sep, 2, "/");
      return id;
    }
  }
  const std::string name = (p.has_filename() ? p : p.parent_path()).filename().string();
  return name.empty() ? dir : name;
}

const char* kind_name(ModelKind kind) { return kind == ModelKind::audio ? "audio" : "image"; }

namespace {

// The transformer's and text encoder's weights through `linears` (none when null).
void use_linear_weights(ModelDir& dir, const std::shared_ptr<const WeightTransform>& linears) {
  if (!linears) return;
  dir.use_transform("transformer", linears);
  dir.use_transform("text_encoder", linears);
}

// Whether `quant` asks for the int8 tier, refused where its products would not be exact.
bool int8_tier(Quant quant, Backend* device) {
  if (quant == Quant::none) return false;
  APUS_CHECK(!device, "--quant int8 runs on the CPU only so far (the device is ", device ? device->name() : "", ")");
  APUS_CHECK(cpu::exact_int8_products(), "--quant int8 needs a CPU with VNNI (AVX512-VNNI, AVX-VNNI or AMX), where ",
             "oneDNN's int8 products are exact; this one has none");
  return true;
}

}  // namespace

bool is_single_file(const std::string& model) { return !model.empty() && path_exists(model) && !is_directory(model); }

namespace {

// The single files each family reads, recognised by what they hold (never by the file's name), in
// the order they are asked: a new family's files are one more line.
struct SingleFileFamily {
  ModelKind kind;
  const char* holds;  // what the family looks for, for the refusal
  bool (*claims)(const std::string& path);
};
const SingleFileFamily kSingleFileFamilies[] = {
    {ModelKind::audio, "a Stable Audio 3 checkpoint (the official keys, or sa3.cpp's GGUF)",
     [](const std::string& path) {
       return is_gguf_file(path) ? sa3::gguf_architecture(path).starts_with("sa3-")
                                 : SingleFile::open(path)->contains(kSa3SingleFileKey);
     }},
    {ModelKind::image, "a FLUX.2 transformer (BFL's, ComfyUI's or diffusers' names, or a GGUF)",
     [](const std::string& path) { return flux2::holds_transformer(*SingleFile::open(path)); }},
};

}  // namespace

ModelKind model_kind(const ModelParts& parts) {
  if (is_single_file(parts.model)) {
    std::string holds;
    for (const SingleFileFamily& f : kSingleFileFamilies) {
      if (f.claims(parts.model)) return f.kind;
      holds += std::string(holds.empty() ? "" : ", nor ") + f.holds;
    }
    fail(parts.model, ": neither ", holds);
  }
  const std::string& model = parts.model;
  const std::string root = resolve_model_dir(model, is_directory(model) ? Weights::per_stage : Weights::none);
  if (single_checkpoint(root)) return ModelKind::audio;
  const ModelDir dir = ModelDir::open(root, false);
  for (const Family<AudioModel>& f : kAudioFamilies)
    if (dir.pipeline_class() == f.pipeline_class) return ModelKind::audio;
  return ModelKind::image;
}

AnyModel AnyModel::open(const ModelParts& parts, Weights weights, const std::string& device) {
  AnyModel m;
  if (model_kind(parts) == ModelKind::audio) {
    m.audio_ = AudioModel::open(parts, weights, device);
  } else {
    m.image_ = ImageModel::open(parts, weights, device);
  }
  return m;
}

std::unique_ptr<ImageModel> open_image_model(const std::string& model, Weights weights, Backend* device) {
  return open_image_model(ModelParts{model}, weights, device);
}

std::unique_ptr<ImageModel> open_image_model(const ModelParts& parts, Weights weights, Backend* device) {
  std::optional<KleinSingleFile> single;
  std::string root, tokenizer = parts.tokenizer;
  if (is_single_file(parts.model)) {
    single = klein_single_file(parts, weights);
    root = single->root;
    tokenizer = single->tokenizer;
  } else {
    APUS_CHECK(parts.config.empty(), "--config ", parts.config, ": only for a single-file --model (", parts.model,
               " is a folder with its own configs)");
    root = resolve_model_dir(parts.model, weights);
    APUS_CHECK(!single_checkpoint(root), root, "/model_config.json: a Stable Audio 3 checkpoint, served by ",
               "`apus audio`");
  }
  ModelDir dir = ModelDir::open(root, weights != Weights::none, device);
  if (single) {
    dir.use_weights("transformer", single->transformer.weights);
    dir.set_label(std::filesystem::path(parts.model).filename().string());
  }
  if (weights != Weights::none) {
    if (!parts.text_encoder.empty()) dir.use_weights("text_encoder", flux2::open_text_encoder_file(parts.text_encoder));
    if (!parts.vae.empty()) dir.use_weights("vae", flux2::open_vae_file(parts.vae));
  }
  if (!tokenizer.empty()) dir.use_part("tokenizer", tokenizer);
  use_linear_weights(dir, quant_transforms(parts.quant, device).linears);
  return open_family(dir, weights, kImageFamilies, kAudioFamilies, "audio");
}

std::unique_ptr<AudioModel> open_audio_model(const std::string& model, Weights weights, Backend* device) {
  return open_audio_model(ModelParts{model}, weights, device);
}

std::unique_ptr<AudioModel> open_audio_model(const ModelParts& parts, Weights weights, Backend* device) {
  if (is_single_file(parts.model)) return open_sa3_single_file(parts, weights, device);
  for (const std::string* part : {&parts.text_encoder, &parts.vae, &parts.tokenizer, &parts.config})
    APUS_CHECK(part->empty(), parts.model, ": a Stable Audio 3 folder takes no --text-encoder, --vae, --tokenizer ",
               "or --config (", *part, "); they are for a single-file --model");
  const QuantTransforms quant = quant_transforms(parts.quant, device);
  const std::string root = resolve_model_dir(parts.model, weights);
  if (single_checkpoint(root)) return open_sa3_official(root, weights, device, quant);
  ModelDir dir = ModelDir::open(root, weights != Weights::none, device);
  use_linear_weights(dir, quant.linears);
  if (quant.decoder) dir.use_transform("vae", quant.decoder);
  return open_family(dir, weights, kAudioFamilies, kImageFamilies, "image");
}

QuantTransforms quant_transforms(Quant quant, Backend* device) {
  if (!int8_tier(quant, device)) return {};
  // Token embeddings feed a lookup, not a linear. SAME's feed-forward stays in bf16: with it the
  // tiny model's MR-STFT median in `apus gate` went from 0.50 to 0.66 against a threshold of 0.48,
  // where the attention projections moved it no further than the DiT's share does (docs/SPEED.md).
  // A decoder stored quantised keeps its own formats.
  return {std::make_shared<Int8Linears>(Int8Scope{{"embed_tokens.weight"}}),
          std::make_shared<Int8Linears>(Int8Scope{{}, {"attn.to_qkv.weight", "attn.to_out.weight"}, true})};
}

std::unique_ptr<ImageModel> ImageModel::open(const std::string& model, Weights weights, const std::string& device) {
  return open_image_model(model, weights, backend_for(device));
}

std::unique_ptr<ImageModel> ImageModel::open(const ModelParts& parts, Weights weights, const std::string& device) {
  return open_image_model(parts, weights, backend_for(device));
}

std::unique_ptr<AudioModel> AudioModel::open(const std::string& model, Weights weights, const std::string& device) {
  return open_audio_model(model, weights, backend_for(device));
}

std::unique_ptr<AudioModel> AudioModel::open(const ModelParts& parts, Weights weights, const std::string& device) {
  return open_audio_model(parts, weights, backend_for(device));
}

}  // namespace apus
