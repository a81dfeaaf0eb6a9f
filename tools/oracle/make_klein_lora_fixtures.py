#!/usr/bin/env python3
"""Oracle for apus's LoRAs on klein: adapters for klein_tiny_a's transformer in the three layouts
users have, and the images diffusers' Flux2KleinPipeline renders with them (load_lora_weights +
set_adapters, PEFT's unmerged LoRA layers), in bf16 from the seed and in fp32 from the bf16 draw.

Writes, under tests/fixtures/klein_lora/:
  peft.safetensors    diffusers' own save_lora_weights of a PEFT LoRA on every linear of the
                      transformer (rank 4, lora_alpha 8, one module at alpha 2 through
                      alpha_pattern), the adapter config in the file's lora_adapter_metadata
  bfl.safetensors     ai-toolkit / BFL names (diffusion_model.double_blocks.N.img_attn.qkv ...,
                      one lora_A per fused qkv), rank 8 without alpha
  kohya.safetensors   kohya / ComfyUI names (lora_unet_double_blocks_N_img_attn_qkv.lora_down /
                      lora_up / alpha), rank 4, alpha 2
  reference.safetensors   {case}.{bf16,fp32}.image_u8 for cases none, peft, bfl, kohya (scale 1)
                      and pair (peft at 0.7 then kohya at 0.5); fp32.noise
  reference.json      the request (prompt, size, seed, steps) and each case's adapters

The modules each layout carries are the ones diffusers' converters map (lora_conversion_utils.py:
the kohya converter drops the modulation layers, and neither maps BFL's final adaLN with its
(shift, scale) halves swapped, so those stay out of the reference).

Usage: make_klein_lora_fixtures.py [--out DIR]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_env import FIXTURES  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import Flux2KleinPipeline  # noqa: E402
from diffusers.utils.torch_utils import randn_tensor  # noqa: E402
from peft import LoraConfig, get_peft_model_state_dict  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = os.path.join(FIXTURES, "klein_tiny_a")
REQUEST = dict(prompt="a red fox in tall grass", width=64, height=48, seed=7, steps=4)
CASES = {
    "none": [],
    "peft": [("peft.safetensors", 1.0)],
    "bfl": [("bfl.safetensors", 1.0)],
    "kohya": [("kohya.safetensors", 1.0)],
    "pair": [("peft.safetensors", 0.7), ("kohya.safetensors", 0.5)],
}


def linear_names(transformer):
    return [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]


def make_peft(out):
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=torch.float32)
    names = linear_names(pipe.transformer)
    special = "single_transformer_blocks.0.attn.to_out"
    assert special in names
    config = LoraConfig(r=4, lora_alpha=8, target_modules=names, init_lora_weights=False,
                        alpha_pattern={special: 2})
    pipe.transformer.add_adapter(config)
    torch.manual_seed(11)
    for name, p in pipe.transformer.named_parameters():
        if "lora_" in name:  # values large enough that the image visibly moves
            p.data = torch.randn_like(p) * (0.1 if "lora_A" in name else 0.05)
    layers = {k: v.to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(pipe.transformer).items()}
    Flux2KleinPipeline.save_lora_weights(out, transformer_lora_layers=layers,
                                         transformer_lora_adapter_metadata=config.to_dict(),
                                         weight_name="peft.safetensors")


def random_pair(gen, rank, out_features, in_features, a=0.1, b=0.05):
    down = torch.randn(rank, in_features, generator=gen) * a
    up = torch.randn(out_features, rank, generator=gen) * b
    return down.to(torch.bfloat16), up.to(torch.bfloat16)


def bfl_modules(tr):
    """BFL module name -> (out, in) for the modules both converters map."""
    h = tr.config.num_attention_heads * tr.config.attention_head_dim
    f = int(h * tr.config.mlp_ratio)
    mods = {}
    for i in range(tr.config.num_layers):
        for s in ("img", "txt"):
            mods[f"double_blocks.{i}.{s}_attn.qkv"] = (3 * h, h)
            mods[f"double_blocks.{i}.{s}_attn.proj"] = (h, h)
            mods[f"double_blocks.{i}.{s}_mlp.0"] = (2 * f, h)
            mods[f"double_blocks.{i}.{s}_mlp.2"] = (h, f)
    for i in range(tr.config.num_single_layers):
        mods[f"single_blocks.{i}.linear1"] = (3 * h + 2 * f, h)
        mods[f"single_blocks.{i}.linear2"] = (h, h + f)
    mods["img_in"] = (h, tr.config.in_channels)
    mods["txt_in"] = (h, tr.config.joint_attention_dim)
    mods["time_in.in_layer"] = (h, tr.config.timestep_guidance_channels)
    mods["time_in.out_layer"] = (h, h)
    mods["final_layer.linear"] = (tr.config.out_channels or tr.config.in_channels, h)
    return mods


def make_bfl(out, mods):
    gen = torch.Generator().manual_seed(12)
    sd = {}
    for m, (o, i) in mods.items():
        down, up = random_pair(gen, 8, o, i)
        sd[f"diffusion_model.{m}.lora_A.weight"] = down
        sd[f"diffusion_model.{m}.lora_B.weight"] = up
    save_file(sd, os.path.join(out, "bfl.safetensors"))


def make_kohya(out, mods):
    gen = torch.Generator().manual_seed(13)
    sd = {}
    for m, (o, i) in mods.items():
        down, up = random_pair(gen, 4, o, i, 0.15, 0.08)
        key = "lora_unet_" + m.replace(".", "_")
        sd[key + ".lora_down.weight"] = down
        sd[key + ".lora_up.weight"] = up
        sd[key + ".alpha"] = torch.tensor(2.0, dtype=torch.bfloat16)  # alpha / rank = 1/2, exact in bf16
    save_file(sd, os.path.join(out, "kohya.safetensors"))


def render(out, dtype, adapters):
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    names = []
    for n, (file, scale) in enumerate(adapters):
        name = f"a{n}"
        pipe.load_lora_weights(out, weight_name=file, adapter_name=name)
        names.append(name)
    if names:
        pipe.set_adapters(names, [s for _, s in adapters])
        # Every tensor of the file reached a LoRA layer (none dropped by a converter).
        lora_params = sum(1 for k in pipe.transformer.state_dict() if "lora_" in k)
        assert lora_params > 0
    return generate(pipe, dtype)


def generate(pipe, dtype):
    """REQUEST's image (u8) and its noise from the pipeline as it stands."""
    r = REQUEST
    # As make_klein_fixtures: fp32 starts from the bf16 draw the bf16 pipeline makes from the seed.
    lh, lw = 2 * (r["height"] // 16), 2 * (r["width"] // 16)
    shape = (1, pipe.transformer.config.in_channels, lh // 2, lw // 2)
    noise = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(r["seed"]), device=torch.device("cpu"),
                         dtype=torch.bfloat16)
    result = pipe(prompt=r["prompt"], height=r["height"], width=r["width"], num_inference_steps=r["steps"],
                  guidance_scale=1.0, latents=noise.to(dtype), output_type="pil")
    return np.asarray(result.images[0].convert("RGB"), dtype=np.uint8).copy(), noise


def render_cases(cases, render_one):
    """{case}.{bf16,fp32}.image_u8 and fp32.noise, render_one(dtype, adapters) -> (image, noise)
    giving each; every adapted case checked to move the image well past its bf16/fp32 gap."""
    tensors = {}
    for case, adapters in cases.items():
        for tag, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            image, noise = render_one(dtype, adapters)
            tensors[f"{case}.{tag}.image_u8"] = torch.from_numpy(image)
            tensors["fp32.noise"] = noise.to(torch.float32)
    base = tensors["none.fp32.image_u8"].float()
    for case in cases:
        moved = (tensors[f"{case}.fp32.image_u8"].float() - base).abs().mean().item()
        gap = (tensors[f"{case}.fp32.image_u8"].float() - tensors[f"{case}.bf16.image_u8"].float()).abs().mean().item()
        print(f"{case}: mean |image - no adapter| {moved:.2f} levels, bf16 vs fp32 {gap:.2f}")
        assert case == "none" or moved > 4 * gap, f"{case}: the adapter barely moves the image"
    return tensors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=FIXTURES)
    out = os.path.join(ap.parse_args().out, "klein_lora")
    os.makedirs(out, exist_ok=True)
    make_peft(out)
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=torch.float32)
    mods = bfl_modules(pipe.transformer)
    del pipe
    make_bfl(out, mods)
    make_kohya(out, mods)
    tensors = render_cases(CASES, lambda dtype, adapters: render(out, dtype, adapters))
    save_file(tensors, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"request": REQUEST, "cases": {k: [{"file": a, "scale": s} for a, s in v] for k, v in CASES.items()}},
                  f, indent=2)
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)


if __name__ == "__main__":
    main()
