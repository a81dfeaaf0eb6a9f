#include "pipeline/klein/single_file_layout.h"

#include <optional>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "io/files.h"
#include "io/hf_cache.h"
#include "io/model_dir.h"
#include "io/weights/gguf.h"
#include "io/weights/synth.h"

namespace apus {

namespace {

// The repositories that publish a klein layout's tokenizer (the distilled and -base models share it).
std::vector<std::string> klein_repos(const std::string& layout) {
  if (layout == "flux2-klein-9b" || layout == "flux2-klein-9b-kv")
    return {"black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-klein-base-9B"};
  return {"black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-base-4B"};
}

// The tokenizer/ folder of the first of those repositories the Hugging Face cache holds; empty if none.
std::string cached_klein_tokenizer(const std::string& layout) {
  for (const std::string& repo : klein_repos(layout))
    if (const std::optional<std::string> snapshot = hf_cached_snapshot(repo))
      if (path_exists(*snapshot + "/tokenizer/tokenizer.json")) return *snapshot + "/tokenizer";
  return "";
}

// A text encoder GGUF that carries its tokenizer, as llama.cpp's converter writes them.
bool carries_tokenizer(const std::string& text_encoder) {
  return is_single_file(text_encoder) && is_gguf_file(text_encoder) &&
         GgufFile::open(text_encoder).metadata().contains("tokenizer.ggml.tokens");
}

// The first published layout of a single-file transformer's shape (configs only), refused naming
// the shapes there are.
std::string published_layout_of(const flux2::TransformerFile& transformer, const std::string& file) {
  std::string shapes;
  for (const std::string& name : kPublishedModels) {
    const std::string config = published_layout_dir(name) + "/transformer/config.json";
    if (!path_exists(config)) continue;
    const Config c = read_config(config);
    const int64_t doubles = c.get_int("num_layers"), singles = c.get_int("num_single_layers");
    const int64_t hidden = c.get_int("num_attention_heads") * c.get_int("attention_head_dim");
    if (doubles == transformer.double_blocks && singles == transformer.single_blocks && hidden == transformer.hidden)
      return name;
    shapes += " " + name + " (" + std::to_string(doubles) + ", " + std::to_string(singles) + ")";
  }
  fail(file, ": a FLUX.2 transformer of ", transformer.double_blocks, " double and ", transformer.single_blocks,
       " single blocks, none of the published layouts':", shapes,
       "; pass --config DIR, a diffusers folder of its configs");
}

// A single transformer file holds the blocks its --config folder's transformer/config.json says,
// no more (extra blocks would be dropped without a word) and no fewer.
void check_blocks_match(const flux2::TransformerFile& transformer, const std::string& file, const std::string& root) {
  const std::string config = root + "/transformer/config.json";
  const Config c = read_config(config);
  for (const auto& [key, held, kind] : {std::tuple{"num_layers", transformer.double_blocks, "double"},
                                        std::tuple{"num_single_layers", transformer.single_blocks, "single"}})
    APUS_CHECK(held == c.get_int(key), file, ": holds ", kind, " blocks up to index ", held - 1, " (", held, "), but ",
               config, " says ", key, " ", c.get_int(key));
}

}  // namespace

KleinSingleFile klein_single_file(const ModelParts& parts, Weights weights) {
  KleinSingleFile out{flux2::open_transformer_file(parts.model), "", parts.tokenizer};
  if (!parts.config.empty()) {
    out.root = resolve_model_dir(parts.config, Weights::none);
    check_blocks_match(out.transformer, parts.model, out.root);
    return out;
  }
  const std::string layout = published_layout_of(out.transformer, parts.model);
  out.root = published_layout_dir(layout);
  // The layout's tokenizer is a stand-in: the real one from --tokenizer, the text encoder's GGUF or
  // the model's repository in the Hugging Face cache.
  if (out.tokenizer.empty() && carries_tokenizer(parts.text_encoder)) out.tokenizer = parts.text_encoder;
  if (out.tokenizer.empty()) out.tokenizer = cached_klein_tokenizer(layout);
  APUS_CHECK(weights == Weights::none || (!parts.text_encoder.empty() && !parts.vae.empty() && !out.tokenizer.empty()),
             parts.model, ": a single transformer file needs --text-encoder FILE, --vae FILE and --tokenizer DIR ",
             "(or --config DIR, a diffusers folder holding them); the tokenizer is also read from a text encoder ",
             "GGUF that carries one, or found in the Hugging Face cache as ", klein_repos(layout).front(),
             "'s tokenizer/ folder");
  return out;
}

}  // namespace apus
