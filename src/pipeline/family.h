#pragma once
// One descriptor per model family: what it recognises (the diffusers pipeline classes it serves,
// its own folder layout, its single files) and how it opens them. The registry (registry.cpp)
// walks the table (families.cpp) and names no family: a new family is its folder, its descriptor
// there, and one line of the table.
#include <memory>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "ops/backend.h"

namespace apus {

// What a model makes; each front end asks the registry rather than deciding from the files itself.
enum class ModelKind { image, audio };

struct FamilyDescriptor {
  const char* name;  // "Stable Audio 3": how refusals name the family
  ModelKind kind;
  std::vector<std::string> pipeline_classes;  // the _class_name values of a model_index.json it serves
  // The config file marking a folder in the family's own layout (one without model_index.json),
  // or null where the family has none.
  const char* own_layout_config;
  const char* single_file_holds;  // what its single files hold, for the refusal naming every family's
  bool (*claims_single_file)(const std::string& path);
  // Opens `parts` on the device (null: the CPU): `root` is the folder parts.model resolved to (its
  // pipeline class or layout matched to this family by the registry), empty for a single file.
  // Only the opener of the family's kind is set.
  std::unique_ptr<ImageModel> (*open_image)(const ModelParts& parts, const std::string& root, Weights weights,
                                            Backend* device);
  std::unique_ptr<AudioModel> (*open_audio)(const ModelParts& parts, const std::string& root, Weights weights,
                                            Backend* device);
};

// Every family, in the order a single file is offered to them (the most specific test first).
const std::vector<FamilyDescriptor>& families();
// A family built outside the engine (a plug-in's, a test's), asked after the engine's own. Add it
// before any model is opened: the table is not guarded against a concurrent open.
void add_family(FamilyDescriptor family);

}  // namespace apus
