#pragma once
// klein from one transformer file (BFL's, ComfyUI's, a GGUF, fp8): the configs it runs with (of
// --config, or the published layout of the file's shape), and the tokenizer found for it.
#include <string>

#include "apus/apus.h"
#include "pipeline/klein/single_file.h"

namespace apus {

struct KleinSingleFile {
  flux2::TransformerFile transformer;
  std::string root;       // the folder of configs (and, from --config, the other parts' weights)
  std::string tokenizer;  // --tokenizer, a text encoder GGUF's own, or the Hugging Face cache's; may be empty
};

// Refuses a file of a shape no published layout has (without --config), blocks that disagree with
// --config's, and missing parts where weights are to be read, each naming what to pass.
KleinSingleFile klein_single_file(const ModelParts& parts, Weights weights);

}  // namespace apus
