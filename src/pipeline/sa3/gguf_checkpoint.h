#pragma once
// sa3.cpp's GGUF files (thepatch/stable-audio-3-*-GGUF and t5gemma-b-b-ul2-GGUF) under the names
// apus's other Stable Audio 3 layouts use: the DiT, SAME and duration conditioner under the
// official checkpoint's names (OfficialCheckpoint renames diffusers' names to them), T5Gemma's
// encoder under transformers' (encoder.*). sa3.cpp renames every tensor (dit.*, ae.*, te.*),
// squeezes unit dimensions, folds SAME's weight norm (a k=3 mapping stored as one matrix a tap,
// w0..w2), stores Gemma's RMSNorm weights as 1 + w and drops the DiT's RoPE buffer; each is
// undone here (docs/notes/sa3cpp-gguf.md has the rules and where in sa3.cpp they were read).
#include <memory>
#include <string>
#include <vector>

#include "io/weights/single_file.h"
#include "io/weights/weight_source.h"

namespace apus::sa3 {

// general.architecture of each of sa3.cpp's files.
inline constexpr const char* kGgufDit = "sa3-dit";
inline constexpr const char* kGgufAutoencoder = "sa3-ae";
inline constexpr const char* kGgufConditioner = "sa3-conditioner";
inline constexpr const char* kGgufTextEncoder = "sa3-t5gemma";
inline constexpr const char* kGgufVocabulary = "sa3-tokenizer";

// A GGUF file's general.architecture: "" for a file that is no GGUF or has none.
std::string gguf_architecture(const std::string& path);

// Any of sa3.cpp's model files (sa3-dit, sa3-ae, sa3-conditioner, sa3-t5gemma; an older
// sa3-t5gemma file carries the conditioner's tensors, which a sa3-conditioner file given too
// replaces) under the official names. A tensor of no known name, or one in a file of another part,
// is refused naming the file and tensor.
std::shared_ptr<const WeightSource> gguf_checkpoint(const std::vector<std::shared_ptr<SingleFile>>& files);

}  // namespace apus::sa3
