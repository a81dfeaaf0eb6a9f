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

const char* kind_name(ModelKind kind) { return kind == ModelKind::audio ? "audio" : "image"; }

namespace {

// The transformer's and text encoder's weights through `linears` (none when null).
void use_linear_weights(ModelDir& dir, const std::shared_ptr<const WeightTransform>& linears) {
  if (!linears) return;
  dir.use_transform("transformer", linears);
  dir.use_transform("text_encoder", linears);
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
  use_linear_weights(dir, int8_linears(parts.quant, device));
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
  const std::shared_ptr<const WeightTransform> linears = int8_linears(parts.quant, device);
  const std::string root = resolve_model_dir(parts.model, weights);
  if (single_checkpoint(root)) return open_sa3_official(root, weights, device, parts.quant);
  ModelDir dir = ModelDir::open(root, weights != Weights::none, device);
  use_linear_weights(dir, linears);
  if (const auto decoder = same_decoder_int8(parts.quant)) dir.use_transform("vae", decoder);
  return open_family(dir, weights, kAudioFamilies, kImageFamilies, "image");
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
