#pragma once
// Adapter files for FLUX.2's transformer in the layouts users have, read into the adapters a
// request applies (ops/adapters.h), under diffusers' weight names:
//   diffusers / PEFT:   transformer.<module>.lora_A.weight / lora_B.weight, alpha from the file's
//                       lora_adapter_metadata (lora_alpha, alpha_pattern, use_rslora) or rank
//   BFL / ai-toolkit:   diffusion_model.<BFL module>.lora_A / lora_B (or lora_down / lora_up),
//                       the fused qkv's up split in three, the final adaLN's halves swapped
//   kohya / ComfyUI:    lora_unet_<BFL module with _>.lora_down / lora_up / alpha
// mapped as diffusers' Flux2LoraLoaderMixin maps them (lora_conversion_utils.py); and LyCORIS's
// LoHa (.hada_w1_a, _w1_b, _w2_a, _w2_b: ΔW = (w1_a·w1_b) ⊙ (w2_a·w2_b) · alpha / r1) and LoKr
// (.lokr_w1 or _w1_a/_w1_b, .lokr_w2 or _w2_a/_w2_b: ΔW = kron(w1, w2) · alpha / the rank of w2's
// pair, else w1's, else 1) under any of those names or lycoris_<module with _>, as LyCORIS and
// ComfyUI compute them. Keys that adapt the text encoder, DoRA, Tucker (convolution) factors,
// full diffs and biases are refused naming the key.
#include <map>
#include <string>

#include "apus/apus.h"
#include "core/tensor.h"
#include "ops/adapters.h"

namespace apus::flux2 {

// Adds `lora`'s factors to `into`; `weights` are the transformer's weights by name with their
// shapes (Transformer::weight_shapes), `double_blocks`/`single_blocks` its depth.
void read_lora(const Lora& lora, const std::map<std::string, Shape>& weights, int64_t double_blocks,
               int64_t single_blocks, Adapters& into);

}  // namespace apus::flux2
