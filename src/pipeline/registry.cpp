#include "pipeline/registry.h"

#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "io/hf_cache.h"
#include "ops/backend.h"

namespace apus {

const char* kind_name(ModelKind kind) { return kind == ModelKind::audio ? "audio" : "image"; }

namespace {

// A folder's family: the one serving its model_index.json's pipeline class (none for a class no
// family serves), or, without model_index.json, the one whose own layout's config it holds;
// refused naming both kinds of folder when it has neither.
struct FolderFamily {
  const FamilyDescriptor* family = nullptr;
  std::string pipeline_class;  // empty for a family's own layout
};
FolderFamily folder_family(const std::string& root) {
  if (!path_exists(root + "/model_index.json")) {
    std::string layouts;
    for (const FamilyDescriptor& f : families()) {
      if (!f.own_layout_config) continue;
      if (path_exists(root + "/" + f.own_layout_config)) return {&f, ""};
      layouts += std::string(" nor a ") + f.name + " checkpoint (" + f.own_layout_config + ")";
    }
    fail(root, ": neither a diffusers folder (model_index.json)", layouts);
  }
  FolderFamily found{nullptr, ModelDir::open(root, false).pipeline_class()};
  for (const FamilyDescriptor& f : families())
    for (const std::string& c : f.pipeline_classes)
      if (c == found.pipeline_class) found.family = &f;
  return found;
}

// The first family (of `kind`, or of any kind when null) that claims a single file; refused naming
// what each looks for.
const FamilyDescriptor& claiming_family(const std::string& path, const ModelKind* kind) {
  std::string holds;
  for (const FamilyDescriptor& f : families()) {
    if (kind && f.kind != *kind) continue;
    if (f.claims_single_file(path)) return f;
    holds += std::string(holds.empty() ? "" : ", nor ") + f.single_file_holds;
  }
  fail(path, ": neither ", holds);
}

// The family of `kind` that opens a single file: the kind's only family (whose own checks name
// what is wrong with a file it cannot read), else the first that claims it.
const FamilyDescriptor& single_file_family(const std::string& path, ModelKind kind) {
  const FamilyDescriptor* only = nullptr;
  int of_kind = 0;
  for (const FamilyDescriptor& f : families())
    if (f.kind == kind) ++of_kind, only = &f;
  return of_kind == 1 ? *only : claiming_family(path, &kind);
}

// Opens `parts` as a model of Model's kind with the family that serves it, or says which command
// does.
template <typename Model>
std::unique_ptr<Model> open_model(ModelKind kind, const ModelParts& parts, Weights weights, Backend* device) {
  auto open_with = [&](const FamilyDescriptor& f, const std::string& root) {
    if constexpr (std::is_same_v<Model, ImageModel>) return f.open_image(parts, root, weights, device);
    else return f.open_audio(parts, root, weights, device);
  };
  if (is_single_file(parts.model)) return open_with(single_file_family(parts.model, kind), "");
  const std::string root = resolve_model_dir(parts.model, weights);
  const auto [family, pipeline_class] = folder_family(root);
  if (family && family->kind != kind) {
    const std::string command = std::string("`apus ") + kind_name(family->kind) + "`";
    if (!pipeline_class.empty()) fail(root, "/model_index.json: ", pipeline_class, " is served by ", command);
    fail(root, "/", family->own_layout_config, ": a ", family->name, " checkpoint, served by ", command);
  }
  if (!family) {
    std::string known;
    for (const FamilyDescriptor& f : families())
      if (f.kind == kind)
        for (const std::string& c : f.pipeline_classes) known += (known.empty() ? "" : ", ") + c;
    fail(root, "/model_index.json: _class_name '", pipeline_class, "' is not supported (supported: ", known, ")");
  }
  return open_with(*family, root);
}

}  // namespace

ModelKind model_kind(const ModelParts& parts) {
  if (is_single_file(parts.model)) return claiming_family(parts.model, nullptr).kind;
  const std::string& model = parts.model;
  const std::string root = resolve_model_dir(model, is_directory(model) ? Weights::per_stage : Weights::none);
  const FamilyDescriptor* family = folder_family(root).family;
  return family ? family->kind : ModelKind::image;  // an unknown class: `apus image` names the supported ones
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
  return open_model<ImageModel>(ModelKind::image, parts, weights, device);
}

std::unique_ptr<AudioModel> open_audio_model(const std::string& model, Weights weights, Backend* device) {
  return open_audio_model(ModelParts{model}, weights, device);
}

std::unique_ptr<AudioModel> open_audio_model(const ModelParts& parts, Weights weights, Backend* device) {
  return open_model<AudioModel>(ModelKind::audio, parts, weights, device);
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
