#pragma once
// Which model family serves a directory. A family registers one line in registry.cpp: the
// pipeline class its model_index.json names and the function that opens it.
#include <memory>
#include <string>

#include "apus/apus.h"
#include "io/model_dir.h"
#include "ops/backend.h"

namespace apus {

std::unique_ptr<ImageModel> open_klein(const ModelDir& dir, Weights weights);
std::unique_ptr<AudioModel> open_sa3(const ModelDir& dir, Weights weights);
// Stable Audio 3's official single-checkpoint layout (model_config.json beside model.safetensors).
std::unique_ptr<AudioModel> open_sa3_official(const std::string& root, Weights weights, Backend* device, Quant quant);
// What `--quant` makes of SAME's decoder: the int8 tier on its attention projections alone (null
// for Quant::none).
std::shared_ptr<const WeightTransform> same_decoder_int8(Quant quant);
// A Stable Audio 3 checkpoint as one file under the official model.safetensors keys (ComfyUI's
// stable_audio_3_*.safetensors), told by this key.
inline constexpr const char* kSa3SingleFileKey = "model.model.transformer.layers.0.self_attn.to_qkv.weight";
// Its configs from --config (an official folder) or the published layout of its shape, T5Gemma
// from --text-encoder, the tokenizer from --tokenizer or the text encoder file's spiece_model.
std::unique_ptr<AudioModel> open_sa3_single_file(const ModelParts& parts, Weights weights, Backend* device);
// sa3.cpp's GGUF files: --model the DiT (general.architecture sa3-dit), the other parts from
// --vae, --text-encoder and --tokenizer or beside it (pipeline/sa3/gguf_layout.cpp).
std::unique_ptr<AudioModel> open_sa3_gguf(const ModelParts& parts, Weights weights, Backend* device);

// ImageModel::open and AudioModel::open on a backend rather than a device name (null: the CPU).
std::unique_ptr<ImageModel> open_image_model(const std::string& model, Weights weights, Backend* device);
std::unique_ptr<ImageModel> open_image_model(const ModelParts& parts, Weights weights, Backend* device);
std::unique_ptr<AudioModel> open_audio_model(const std::string& model, Weights weights, Backend* device);
std::unique_ptr<AudioModel> open_audio_model(const ModelParts& parts, Weights weights, Backend* device);

// Whether --model names one file (a transformer checkpoint) rather than a folder or a name.
bool is_single_file(const std::string& model);

// What a model makes; each front end asks the registry rather than deciding from the files itself.
enum class ModelKind { image, audio };
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
