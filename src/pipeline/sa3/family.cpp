// Stable Audio 3's descriptor (pipeline/family.h): diffusers folders, the official checkpoint
// folder (model_config.json beside model.safetensors), and one file: the official keys
// (ComfyUI's stable_audio_3_*.safetensors) or sa3.cpp's DiT GGUF, with the other parts.
#include "pipeline/family.h"

#include "core/error.h"
#include "io/files.h"
#include "io/model_dir.h"
#include "io/weights/gguf.h"
#include "io/weights/quant_weights.h"
#include "io/weights/single_file.h"
#include "pipeline/sa3/gguf_checkpoint.h"
#include "pipeline/sa3/sa3_model.h"

namespace apus {

namespace {

std::unique_ptr<AudioModel> open_parts(const ModelParts& parts, const std::string& root, Weights weights,
                                       Backend* device) {
  if (root.empty()) return open_sa3_single_file(parts, weights, device);
  for (const std::string* part : {&parts.text_encoder, &parts.vae, &parts.tokenizer, &parts.config})
    APUS_CHECK(part->empty(), parts.model, ": a Stable Audio 3 folder takes no --text-encoder, --vae, --tokenizer ",
               "or --config (", *part, "); they are for a single-file --model");
  if (!path_exists(root + "/model_index.json"))
    return open_sa3_official(root, weights, device, parts.quant, parts.tensor_ranks);
  ModelDir dir = ModelDir::open(root, weights != Weights::none, device);
  use_quant_linears(dir, parts.quant, device);
  if (const auto decoder = same_decoder_tier(parts.quant)) dir.use_transform("vae", decoder);
  return open_sa3(dir, weights, parts.tensor_ranks);
}

}  // namespace

FamilyDescriptor sa3_family() {
  return {"Stable Audio 3",
          ModelKind::audio,
          {"StableAudio3Pipeline"},
          "model_config.json",
          "a Stable Audio 3 checkpoint (the official keys, or sa3.cpp's GGUF)",
          [](const std::string& path) {
            return is_gguf_file(path) ? sa3::gguf_architecture(path).starts_with("sa3-")
                                      : SingleFile::open(path)->contains(kSa3SingleFileKey);
          },
          nullptr,
          open_parts};
}

}  // namespace apus
