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
  bfl_lokr.safetensors, bfl_loha.safetensors   LoKr (r 2, alpha 3) and LoHa (r 4, alpha 2) in BFL's
                             names, on the fused modules diffusers splits or reorders: every double
                             block's img_attn.qkv and txt_attn.qkv and the final adaLN (whose rows
                             BFL orders (shift, scale))
  lycoris_bfl_reference.safetensors / .json   their images: PEFT's layer of that kind on each
                             fused BFL linear (get_delta_weight, in the run's dtype), its rows added
                             to the outputs of the diffusers modules they land on (to_q / to_k /
                             to_v, norm_out.linear with the halves swapped) as PEFT's unmerged
                             forward adds them; cases bfl_lokr, bfl_loha and both (0.6, 0.8)

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
from peft import LoHaConfig, LoKrConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402
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


# kind -> (PEFT kind, factor magnitude): the fused modules alone move the image less than every
# linear does, so their factors are larger.
BFL_KINDS = {"bfl_lokr": ("lokr", 0.4), "bfl_loha": ("loha", 0.5)}
BFL_CASES = {
    "none": [],
    "bfl_lokr": [("bfl_lokr", 1.0)],
    "bfl_loha": [("bfl_loha", 1.0)],
    "bfl_pair": [("bfl_lokr", 0.6), ("bfl_loha", 0.8)],
}


def bfl_fused(transformer):
    """BFL's fused modules -> (out, in, [(diffusers module, row begin, row end)], swap halves)."""
    cfg = transformer.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    dim = inner
    out = {}
    for n in range(cfg.num_layers):
        for stream, names in (("img", ("to_q", "to_k", "to_v")), ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
            parts = [(f"transformer_blocks.{n}.attn.{m}", i * inner, (i + 1) * inner) for i, m in enumerate(names)]
            out[f"double_blocks.{n}.{stream}_attn.qkv"] = (3 * inner, dim, parts, False)
    out["final_layer.adaLN_modulation.1"] = (2 * dim, dim, [("norm_out.linear", 0, 2 * dim)], True)
    modules = dict(transformer.named_modules())
    for rows, cols, parts, _ in out.values():
        for target, begin, end in parts:
            assert tuple(modules[target].weight.shape) == (end - begin, cols), target
    return out


def bfl_holder(fused, dtype):
    """A module tree with one Linear per fused BFL module, under BFL's names."""
    root = torch.nn.Module()
    for name, (rows, cols, _, _) in fused.items():
        parent = root
        parts = name.split(".")
        for p in parts[:-1]:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.add_module(parts[-1], torch.nn.Linear(cols, rows, bias=False, dtype=dtype))
    return root


def bfl_peft(kind, fused, dtype, state=None, seed=0):
    """PEFT's layers of `kind` on the BFL-named fused linears: (model, its adapter state)."""
    cls, args, _ = KINDS[BFL_KINDS[kind][0]]
    magnitude = BFL_KINDS[kind][1]
    model = get_peft_model(bfl_holder(fused, dtype), cls(target_modules=sorted(fused), init_weights=False, **args))
    if state is None:
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if ".hada_" in name or ".lokr_" in name:
                p.data = torch.randn_like(p) * magnitude
    else:
        result = set_peft_model_state_dict(model, {k: v.to(dtype) for k, v in state.items()})
        assert not result.unexpected_keys, result.unexpected_keys
    return model


def make_bfl(kind, seed, fused):
    model = bfl_peft(kind, fused, torch.float32, seed=seed)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    prefix = "base_model.model."
    assert sorted({k[len(prefix):].rsplit(".", 1)[0] for k in state}) == sorted(fused)
    if kind == "bfl_lokr":  # the fused parts and the halves are rows of the outer factor
        for name, (_, _, parts, swap) in fused.items():
            assert state[prefix + name + ".lokr_w1"].shape[0] % (2 if swap else len(parts)) == 0, name
    tensors = {}
    for k, v in state.items():
        module, param = k[len(prefix):].rsplit(".", 1)
        tensors["lycoris_" + module.replace(".", "_") + "." + param] = v
    for m in fused:
        tensors["lycoris_" + m.replace(".", "_") + ".alpha"] = torch.tensor(float(KINDS[BFL_KINDS[kind][0]][1]["alpha"]),
                                                                              dtype=torch.bfloat16)
    return state, tensors


def render_bfl(dtype, adapters, states):
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    fused = bfl_fused(pipe.transformer)
    modules = dict(pipe.transformer.named_modules())
    for kind, scale in adapters:
        model = bfl_peft(kind, fused, dtype, state=states[kind])
        for name, (_, _, parts, swap) in fused.items():
            layer = model.get_submodule("base_model.model." + name)
            delta = layer.get_delta_weight("default") * scale
            if swap:  # BFL's (shift, scale) rows are diffusers' (scale, shift)
                delta = torch.cat(delta.chunk(2, dim=0)[::-1])
            for target, begin, end in parts:
                part = delta[begin:end].detach()
                # As PEFT's LyCORIS forward: the input cast to the adapter's dtype (PEFT keeps adapters
                # in fp32 beside bf16 layers), the sum back in the layer's.
                modules[target].register_forward_hook(
                    lambda m, inputs, output, part=part: (
                        output + torch.nn.functional.linear(inputs[0].to(part.dtype), part)).to(output.dtype))
    return generate(pipe, dtype)


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
    pipe = Flux2KleinPipeline.from_pretrained(ROOT, torch_dtype=torch.float32)
    fused = bfl_fused(pipe.transformer)
    del pipe
    for seed, kind in enumerate(BFL_KINDS, start=31):
        states[kind], tensors = make_bfl(kind, seed, fused)
        save_file(tensors, os.path.join(out, kind + ".safetensors"))
    images = render_cases(BFL_CASES, lambda dtype, adapters: render_bfl(dtype, adapters, states))
    save_file(images, os.path.join(out, "lycoris_bfl_reference.safetensors"))
    with open(os.path.join(out, "lycoris_bfl_reference.json"), "w") as f:
        json.dump({"request": REQUEST,
                   "cases": {k: [{"file": a + ".safetensors", "scale": s} for a, s in v] for k, v in BFL_CASES.items()}},
                  f, indent=2)
    with open(os.path.join(out, "lycoris_reference.json"), "w") as f:
        json.dump({"request": REQUEST,
                   "cases": {k: [{"file": a + ".safetensors", "scale": s} for a, s in v] for k, v in CASES.items()}},
                  f, indent=2)
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)


if __name__ == "__main__":
    main()
