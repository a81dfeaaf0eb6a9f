// FLUX.2 [klein]'s descriptor (pipeline/family.h): diffusers folders of its three pipelines and
// one transformer file (BFL's, ComfyUI's or diffusers' names, or a GGUF) with its other parts.
#include "pipeline/family.h"

#include <filesystem>
#include <optional>

#include "core/error.h"
#include "io/model_dir.h"
#include "io/weights/quant_weights.h"
#include "io/weights/single_file.h"
#include "pipeline/klein/klein_model.h"
#include "pipeline/klein/single_file.h"
#include "pipeline/klein/single_file_layout.h"

namespace apus {

namespace {

std::unique_ptr<ImageModel> open_parts(const ModelParts& parts, const std::string& folder, Weights weights,
                                       Backend* device) {
  std::optional<KleinSingleFile> single;
  std::string root = folder, tokenizer = parts.tokenizer;
  if (root.empty()) {
    single = klein_single_file(parts, weights);
    root = single->root;
    tokenizer = single->tokenizer;
  } else {
    APUS_CHECK(parts.config.empty(), "--config ", parts.config, ": only for a single-file --model (", parts.model,
               " is a folder with its own configs)");
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
  use_quant_linears(dir, parts.quant, device);
  return open_klein(dir, weights, parts.tensor_ranks);
}

}  // namespace

FamilyDescriptor klein_family() {
  return {"FLUX.2 [klein]",
          ModelKind::image,
          {"Flux2KleinPipeline", "Flux2KleinKVPipeline"},
          nullptr,
          "a FLUX.2 transformer (BFL's, ComfyUI's or diffusers' names, or a GGUF)",
          [](const std::string& path) { return flux2::holds_transformer(*SingleFile::open(path)); },
          open_parts,
          nullptr};
}

}  // namespace apus
