#!/usr/bin/env python3
"""Oracle for ComfyUI's quantised checkpoints: klein_tiny_a's DiT (BFL names under ComfyUI's
"model.diffusion_model." prefix, as its split files and ModelSave lay them out) and its Qwen3 text
encoder (transformers' names, as qwen_3_4b_fp8_mixed.safetensors) with their linears quantised by
comfy-kitchen (ComfyUI's kernel library, the code ComfyUI quantises and dequantises with) in every
layout ComfyUI's mixed-precision loader reads, written as ComfyUI's _quantized_weight_state_dict
writes them: the layout's state_dict tensors (weight, weight_scale, nvfp4's weight_scale_2) and a
`.comfy_quant` U8 tensor holding json.dumps of the layer's config.

The formats rotate over the 2-D weights (float8_e4m3fn with an .input_scale, float8_e5m2,
int8_tensorwise with one scale and with one a row, mxfp8, nvfp4), so each format lands on fused qkv
rows, MLPs, modulations and the final adaLN (whose halves BFL orders (shift, scale)); the image
and text embeddings stay bf16, untagged, as ComfyUI leaves layers it does not quantise.

Writes, under tests/fixtures/klein_single/:
  flux-2-klein-tiny-comfy-mixed.safetensors        per-layer .comfy_quant tags
  flux-2-klein-tiny-comfy-header.safetensors       the same tensors with the tags in the header's
                                                   _quantization_metadata instead (comfy/utils.py
                                                   convert_old_quants reads it)
  flux-2-klein-tiny-comfy-mixed-dequantized.safetensors   comfy-kitchen's dequantize() of every
                                                   weight, f32 (the layouts' orig_dtype), same names
  flux-2-klein-tiny-scaled-fp8.safetensors         ComfyUI's older scaled fp8: a scaled_fp8 marker,
                                                   .scale_weight and .scale_input, the fp8 file's
                                                   values (its reference is
                                                   flux-2-klein-tiny-fp8-dequantized.safetensors)
  qwen3-tiny-comfy-mixed.safetensors               the text encoder, tags per layer
  qwen3-tiny-comfy-mixed-dequantized.safetensors   its dequantisation, f32
and tests/fuzz/safetensors_corpus/comfy_quant.safetensors, a seed for fuzz_safetensors: one small
layer in each layout, tagged, and an untagged fp8 one.

Usage: make_comfy_quant_fixtures.py --out DIR (after make_klein_single_file_fixtures.py)
"""

import argparse
import json
import os

import torch
from comfy_kitchen.tensor import QuantizedTensor
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "..", "tests", "fixtures", "klein_tiny_a")
PREFIX = "model.diffusion_model."

# (ComfyUI's format name, comfy-kitchen layout, quantize kwargs, extra config keys)
FORMATS = [
    ("float8_e4m3fn", "TensorCoreFP8Layout", {"dtype": torch.float8_e4m3fn}, {}),
    ("float8_e5m2", "TensorCoreFP8Layout", {"dtype": torch.float8_e5m2}, {"full_precision_matrix_mult": True}),
    ("int8_tensorwise", "TensorWiseINT8Layout", {}, {}),
    ("int8_tensorwise", "TensorWiseINT8Layout", {"per_channel": True}, {}),
    ("mxfp8", "TensorCoreMXFP8Layout", {}, {}),
    ("nvfp4", "TensorCoreNVFP4Layout", {}, {}),
]


def quantize(name, weight, fmt, tensors, dequantized, tags):
    """ComfyUI's state dict of one quantised Linear (comfy/ops.py _quantized_weight_state_dict)."""
    format_name, layout, kwargs, extra = fmt
    qt = QuantizedTensor.from_float(weight.float(), layout, **kwargs)
    layer = name[: -len(".weight")]
    tensors.update(qt.state_dict(name))
    conf = {"format": format_name, **extra}
    tags[layer] = conf
    if format_name == "float8_e4m3fn":  # BFL's and ComfyUI's fp8 files carry activation scales
        tensors[layer + ".input_scale"] = torch.tensor(1.0)
    dequantized[name] = qt.dequantize().float().contiguous()
    assert dequantized[name].shape == weight.shape, (name, dequantized[name].shape)


def quantized_file(sd, keep_bf16, forced):
    tensors, dequantized, tags = {}, {}, {}
    weights = sorted(n for n, t in sd.items() if t.ndim == 2 and n.endswith(".weight"))
    for i, name in enumerate(weights):
        if any(k in name for k in keep_bf16):
            continue
        fmt = FORMATS[forced[name]] if name in forced else FORMATS[i % len(FORMATS)]
        quantize(name, sd[name], fmt, tensors, dequantized, tags)
    for name, t in sd.items():
        if name not in dequantized:
            tensors[name] = t
            dequantized[name] = t.float()
    return tensors, dequantized, tags


def with_tag_tensors(tensors, tags):
    out = dict(tensors)
    for layer, conf in tags.items():
        out[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = os.path.join(ap.parse_args().out, "klein_single")
    torch.manual_seed(0)

    bfl = load_file(os.path.join(out, "flux-2-klein-tiny.safetensors"))
    sd = {PREFIX + k: v for k, v in bfl.items()}
    forced = {PREFIX + "final_layer.adaLN_modulation.1.weight": 5}  # nvfp4 factors follow the swapped halves
    tensors, dequantized, tags = quantized_file(sd, keep_bf16=("img_in", "txt_in"), forced=forced)
    formats = {(c["format"], len(tensors.get(l + ".weight_scale", torch.zeros(())).shape)) for l, c in tags.items()}
    assert len(formats) == 6, formats  # every layout, both int8 scale shapes
    save_file(with_tag_tensors(tensors, tags), os.path.join(out, "flux-2-klein-tiny-comfy-mixed.safetensors"))
    save_file(tensors, os.path.join(out, "flux-2-klein-tiny-comfy-header.safetensors"),
              metadata={"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": tags})})
    save_file(dequantized, os.path.join(out, "flux-2-klein-tiny-comfy-mixed-dequantized.safetensors"))

    # The older scaled fp8 layout of the fp8 file's very values.
    fp8 = load_file(os.path.join(out, "flux-2-klein-tiny-fp8.safetensors"))
    legacy = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for k, v in fp8.items():
        k = k.replace(".weight_scale", ".scale_weight").replace(".input_scale", ".scale_input")
        legacy[PREFIX + k] = v
    save_file(legacy, os.path.join(out, "flux-2-klein-tiny-scaled-fp8.safetensors"))

    folder = os.path.join(TINY, "text_encoder")
    te = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            te.update(load_file(os.path.join(folder, name)))
    tensors, dequantized, tags = quantized_file(te, keep_bf16=("embed_tokens",), forced={})
    save_file(with_tag_tensors(tensors, tags), os.path.join(out, "qwen3-tiny-comfy-mixed.safetensors"))
    save_file(dequantized, os.path.join(out, "qwen3-tiny-comfy-mixed-dequantized.safetensors"))
    write_fuzz_seed()


def write_fuzz_seed():
    gen = torch.Generator().manual_seed(1)
    sd = {f"l{i}.weight": torch.randn(32, 64, generator=gen) for i in range(len(FORMATS))}
    tensors, _, tags = {}, {}, {}
    for i, fmt in enumerate(FORMATS):
        quantize(f"l{i}.weight", sd[f"l{i}.weight"], fmt, tensors, {}, tags)
    tensors["bfl.weight"] = torch.randn(32, 32, generator=gen).to(torch.float8_e4m3fn)
    tensors["bfl.weight_scale"] = torch.tensor(0.01)
    save_file(with_tag_tensors(tensors, tags), os.path.join(HERE, "..", "..", "tests", "fuzz", "safetensors_corpus",
                                                            "comfy_quant.safetensors"))


if __name__ == "__main__":
    main()
