#pragma once
// FLUX.2's transformer as one file: BFL's original key names (flux-2-klein-4b.safetensors, its
// GGUF quantisations, ComfyUI's split file under "model.diffusion_model."), or diffusers' names in
// one file, handed under the names Transformer::load asks for. BFL's names map as diffusers'
// convert_flux2_transformer_checkpoint_to_diffusers maps them: fused qkv split in three row
// ranges, the final adaLN's (shift, scale) swapped to (scale, shift), norms' .scale as .weight.
#include <memory>
#include <string>
#include <vector>

#include "io/weights/renamed_source.h"
#include "io/weights/single_file.h"

namespace apus::flux2 {

struct TransformerFile {
  std::shared_ptr<const WeightSource> weights;
  int64_t double_blocks = 0, single_blocks = 0, hidden = 0;
  std::string layout;  // "BFL" or "diffusers"
};

// Where the weight of a module in BFL's names ("double_blocks.3.img_attn.qkv") lands in
// diffusers': rows part/parts of it (the fused qkv's three), or with its halves of rows swapped
// (the final adaLN's (shift, scale) as diffusers' (scale, shift)).
struct DiffusersTarget {
  std::string module;
  int part = 0, parts = 1;
  bool swap_halves = false;
};
// False when `module` is no FLUX.2 transformer module in BFL's names.
bool bfl_module_targets(const std::string& module, std::vector<DiffusersTarget>& out);
// Every module of a transformer of that depth in BFL's names.
std::vector<std::string> bfl_modules(int64_t double_blocks, int64_t single_blocks);

// Whether a file holds a FLUX.2 transformer (BFL's or diffusers' names, bare or under ComfyUI's
// prefixes): what open_transformer_file looks for first.
bool holds_transformer(const SingleFile& file);
// Refuses a file that holds no FLUX.2 transformer, or a BFL key it does not know, naming both.
TransformerFile open_transformer_file(const std::string& path);

// FLUX.2's VAE as one file: diffusers' names, or BFL's ldm names (ae.safetensors, ComfyUI's
// split flux2-vae.safetensors; bare or under "vae." / "first_stage_model.", the quant convs nested
// in encoder/decoder or at the top) mapped as diffusers' convert_ldm_vae_checkpoint maps them.
// Refuses a file that holds no FLUX.2 VAE, or an ldm key it does not know, naming both.
std::shared_ptr<const WeightSource> open_vae_file(const std::string& path);

// The Qwen3 text encoder as one file: transformers' names (ComfyUI's qwen_3_4b.safetensors), or
// llama.cpp's GGUF (general.architecture qwen3; blk.N.attn_q.weight ... as convert_hf_to_gguf
// names them, unsloth/Qwen3-4B-GGUF), handed under transformers' names. Refuses a file that holds
// neither, another GGUF architecture, or a GGUF name it does not know, naming the file and tensor.
std::shared_ptr<const WeightSource> open_text_encoder_file(const std::string& path);

}  // namespace apus::flux2
