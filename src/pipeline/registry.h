#pragma once
// Which model family serves a model: a folder by its pipeline class or layout, a single file by
// what it holds, each family's own descriptor deciding (pipeline/family.h); no family is named here.
#include <memory>
#include <string>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "ops/backend.h"
#include "pipeline/family.h"

namespace apus {

// ImageModel::open and AudioModel::open on a backend rather than a device name (null: the CPU).
std::unique_ptr<ImageModel> open_image_model(const std::string& model, Weights weights, Backend* device);
std::unique_ptr<ImageModel> open_image_model(const ModelParts& parts, Weights weights, Backend* device);
std::unique_ptr<AudioModel> open_audio_model(const std::string& model, Weights weights, Backend* device);
std::unique_ptr<AudioModel> open_audio_model(const ModelParts& parts, Weights weights, Backend* device);

// "image" or "audio", as the server's routes and answers name a kind.
const char* kind_name(ModelKind kind);
// What `parts` (a directory, a published name for counting, or a single file with its parts)
// makes, from its configs or tensor names alone.
ModelKind model_kind(const ModelParts& parts);

// A model of either kind, opened with the family its directory names.
class AnyModel {
 public:
  static AnyModel open(const ModelParts& parts, Weights weights, const std::string& device = "cpu");
  ModelKind kind() const { return image_ ? ModelKind::image : ModelKind::audio; }
  const ImageModel* image() const { return image_.get(); }  // null for an audio model
  const AudioModel* audio() const { return audio_.get(); }  // null for an image model
  const std::string& label() const { return image_ ? image_->label() : audio_->label(); }

 private:
  std::unique_ptr<ImageModel> image_;
  std::unique_ptr<AudioModel> audio_;
};

}  // namespace apus
