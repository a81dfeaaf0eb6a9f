#!/usr/bin/env python3
"""Oracle for apus's LyCORIS adapters on klein: LoHa and LoKr on every linear of klein_tiny_a's
transformer, built and run by PEFT (LoHaConfig / LoKrConfig, whose layers compute LyCORIS's
ΔW: (w1_a·w1_b) ⊙ (w2_a·w2_b) and kron(w1, w2), times alpha / r, beside the base layer), and
the images Flux2KleinPipeline renders with them, in bf16 from the seed and in fp32 from the bf16
draw. diffusers' load_lora_weights reads neither kind for FLUX.2, so PEFT is the reference.

The files are written as SimpleTuner / LyCORIS save them: lycoris_<module with _>.<tensor> and a
0-dim .alpha per module. Every LoKr module has w2 factorised (w2_a · w2_b of rank r), where
LyCORIS's scale alpha / rank(w2) and PEFT's alpha / r agree.

Writes, under tests/fixtures/klein_lora/:
  loha.safetensors           LoHa, r 4, alpha 2
  lokr.safetensors           LoKr, r 2, alpha 3, w1 whole
  lokr_both.safetensors      LoKr, r 2, alpha 2, decompose_both (w1 = w1_a · w1_b too)
  lycoris_reference.safetensors   {case}.{bf16,fp32}.image_u8 for cases none, loha, lokr,
                             lokr_both (scale 1) and pair (lokr at 0.6 then loha at 0.8); fp32.noise
  lycoris_reference.json     the request and each case's adapters

Usage: make_klein_lycoris_fixtures.py [--out DIR]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_env import FIXTURES  # noqa: E402
from make_klein_lora_fixtures import REQUEST, generate, render_cases  # noqa: E402

import torch  # noqa: E402
from diffusers import Flux2KleinPipeline  # noqa: E402
from peft import LoHaConfig, LoKrConfig, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = os.path.join(FIXTURES, "klein_tiny_a")
KINDS = {
    "loha": (LoHaConfig, dict(r=4, alpha=2), 0.35),
    "lokr": (LoKrConfig, dict(r=2, alpha=3), 0.22),
    "lokr_both": (LoKrConfig, dict(r=2, alpha=2, decompose_both=True), 0.35),
}
CASES = {
    "none": [],
    "loha": [("loha", 1.0)],
    "lokr": [("lokr", 1.0)],
    "lokr_both": [("lokr_both", 1.0)],
    "pair": [("lokr", 0.6), ("loha", 0.8)],
}


def config_of(kind, transformer):
    cls, args, _ = KINDS[kind]
    # The model's own linears (a second adapter sees the first's wrappers around them).
    names = [n.removesuffix(".base_layer") for n, m in transformer.named_modules()
             if isinstance(m, torch.nn.Linear) and (n.endswith(".base_layer") or not hasattr(m, "base_layer"))]
    names = sorted(set(names))
    return cls(target_modules=names, init_weights=False, **args)


def make(kind, seed):
    """The adapter's PEFT state dict (module.param -> tensor, bf16) and its file's tensors."""
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=torch.float32)
    config = config_of(kind, pipe.transformer)
    pipe.transformer.add_adapter(config)
    torch.manual_seed(seed)
    magnitude = KINDS[kind][2]
    for name, p in pipe.transformer.named_parameters():
        if ".hada_" in name or ".lokr_" in name:
            p.data = torch.randn_like(p) * magnitude
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(pipe.transformer).items()}
    modules = sorted({k.rsplit(".", 1)[0] for k in state})
    if kind.startswith("lokr"):
        for m in modules:  # w2 factorised everywhere: LyCORIS's scale rule and PEFT's agree
            assert m + ".lokr_w2_a" in state and m + ".lokr_w2" not in state, m
            assert (m + ".lokr_w1_a" in state) == (kind == "lokr_both"), m
    tensors = {}
    for k, v in state.items():
        module, param = k.rsplit(".", 1)
        tensors["lycoris_" + module.replace(".", "_") + "." + param] = v
    for m in modules:
        tensors["lycoris_" + m.replace(".", "_") + ".alpha"] = torch.tensor(float(config.alpha), dtype=torch.bfloat16)
    return state, tensors


def render(dtype, adapters, states):
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    names = []
    for n, (kind, _) in enumerate(adapters):
        name = f"a{n}"
        pipe.transformer.add_adapter(config_of(kind, pipe.transformer), adapter_name=name)
        result = set_peft_model_state_dict(pipe.transformer, {k: v.to(dtype) for k, v in states[kind].items()},
                                           adapter_name=name)
        assert not result.unexpected_keys, result.unexpected_keys
        names.append(name)
    if names:
        pipe.transformer.set_adapters(names, [s for _, s in adapters])
    return generate(pipe, dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=FIXTURES)
    out = os.path.join(ap.parse_args().out, "klein_lora")
    os.makedirs(out, exist_ok=True)
    states = {}
    for seed, kind in enumerate(KINDS, start=21):
        states[kind], tensors = make(kind, seed)
        save_file(tensors, os.path.join(out, kind + ".safetensors"))
    images = render_cases(CASES, lambda dtype, adapters: render(dtype, adapters, states))
    save_file(images, os.path.join(out, "lycoris_reference.safetensors"))
    with open(os.path.join(out, "lycoris_reference.json"), "w") as f:
        json.dump({"request": REQUEST,
                   "cases": {k: [{"file": a + ".safetensors", "scale": s} for a, s in v] for k, v in CASES.items()}},
                  f, indent=2)
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)


if __name__ == "__main__":
    main()
