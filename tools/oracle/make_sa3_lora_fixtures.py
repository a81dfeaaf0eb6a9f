#!/usr/bin/env python3
"""Oracle for apus's adapters on Stable Audio 3: LoRA files in the official format, made and
loaded by the official code (stable_audio_3.models.lora) on the committed tiny official checkpoint
(tests/fixtures/sa3_tiny/original), the clips the official StableAudioModel.generate() renders
with them (load_lora, set_lora_strength: the adapters merged into each weight as it is used), and
one of them in PEFT's layout on diffusers' transformer.

Writes, under tests/fixtures/sa3_lora/:
  official.safetensors  every Linear and Conv1d the official loader adapts (the DiT under
                        model.model, the duration conditioner under model.conditioner), rank 4,
                        lora_config {rank 4, alpha 8, adapter_type lora}: the differential
                        attention's fused to_qkv rows in the official order [q|k|v|q2|k2]
  layer1.safetensors    the second DiT block only (lora_config include ["transformer.layers.1."]),
                        rank 2 and alpha left to the loader's defaults (the rank inferred, alpha = rank)
  dora.safetensors      DoRA-rows (the official trainer's default adapter_type) on every Linear and
                        Conv1d, rank 2, alpha 4, its magnitude per output row
  peft/adapter_model.safetensors, peft/adapter_config.json
                        layer1's factors on diffusers' StableAudio3DiTModel as PEFT saves them
                        (get_peft_model + save_pretrained): diffusers' module names, the fused rows
                        [q|q2|k|k2|v], fp32, the config beside the file
  reference.safetensors {case}.fp32.audio [1, 2, samples] for the cases in reference.json

The official loader ignores keys it does not find (load_state_dict strict=False) and adapts only
Linear and Conv1d layers; T5Gemma is no submodule of the conditioner, so it is never adapted.
Needs APUS_SA3_OFFICIAL (a checkout of Stability-AI/stable-audio-3, commit 636f906 was used).

Usage: make_sa3_lora_fixtures.py [--out DIR]
"""

import json
import os
import sys
import tempfile
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle_env  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import make_sa3_official_fixtures as sa3  # noqa: E402

CASES = {
    "none": [],
    "official": [("official.safetensors", 1.0)],
    "strength": [("official.safetensors", 0.6)],
    "layer1": [("layer1.safetensors", 1.0)],
    "pair": [("official.safetensors", 0.7), ("layer1.safetensors", 0.5)],
    "dora": [("dora.safetensors", 1.0)],
    "dora_strength": [("dora.safetensors", 0.4)],
}


def lora_layer_config(rank, alpha, adapter_type):
    from stable_audio_3.models.lora.model import LoRAParametrization

    return {
        kind: {"weight": partial(make, rank=rank, lora_alpha=alpha, adapter_type=adapter_type)}
        for kind, make in ((torch.nn.Linear, LoRAParametrization.from_linear),
                           (torch.nn.Conv1d, LoRAParametrization.from_conv1d))
    }


def make_lora(model, path, gen, rank, alpha, adapter_type="lora", include=None, config=None):
    """Adds adapters to the official model as the trainer does, draws their factors (each change
    about 0.3 of its weight's norm; DoRA's magnitudes 0.7..1.3 of the row norms), saves them with
    save_lora_safetensors (fp16) and removes them again."""
    from stable_audio_3.models.lora.model import LoRAParametrization, add_lora
    from stable_audio_3.models.lora.utils import get_lora_state_dict, save_lora_safetensors

    wrapper = model.model
    parts = (wrapper.model, wrapper.conditioner)
    for part in parts:
        add_lora(part, lora_layer_config(rank, alpha, adapter_type), include=include)
    state = {}
    with torch.no_grad():
        for part in parts:
            for name, module in part.named_modules():
                plist = getattr(getattr(module, "parametrizations", None), "weight", None)
                if plist is None:
                    continue
                p = plist[0]
                assert isinstance(p, LoRAParametrization)
                w = plist.original.reshape(plist.original.shape[0], -1)
                a = torch.randn(p.lora_A.shape, generator=gen) / p.lora_A.shape[1] ** 0.5
                b = torch.randn(p.lora_B.shape, generator=gen)
                b *= 0.3 * w.norm() / (p.scaling * (b @ a)).norm()
                p.lora_A.copy_(a)
                p.lora_B.copy_(b)
                if hasattr(p, "magnitude"):
                    p.magnitude.copy_(w.norm(dim=1) * (0.7 + 0.6 * torch.rand(w.shape[0], generator=gen)))
            state.update(get_lora_state_dict(part))
        for part in parts:
            strip_adapters(part)
    save_lora_safetensors(state, config, path)
    os.chmod(path, 0o644)
    return state


def strip_adapters(part):
    """Every parametrization removed, the original weights restored (the official remove_lora
    iterates a dict it changes)."""
    from torch.nn.utils import parametrize

    for module in list(part.modules()):
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


def generate(model, config, loras, out):
    """The official generate() with `loras` [(file, strength)] loaded in order."""
    if loras:
        model.load_lora([os.path.join(out, f) for f, _ in loras])
        for i, (_, strength) in enumerate(loras):
            model.set_lora_strength(strength, lora_index=i)
    audio = sa3.official_generate(model, config).contiguous()
    if loras:
        strip_adapters(model.model.model)
        strip_adapters(model.model.conditioner)
    return audio


def diffusers_names(state):
    """The DiT's official LoRA keys (relative to the DiT wrapper) as PEFT names them on diffusers'
    StableAudio3DiTModel: the fixtures' own renaming (make_sa3_official_fixtures.to_diffusers),
    lora_B of a fused to_qkv reordered as its weight."""
    out = {}
    for key, value in state.items():
        module, role = key.removeprefix("model.").split(".parametrizations.weight.0.")
        tag = ".weight" if role == "lora_B" else ".factor"
        (name, converted), = sa3.to_diffusers({module + tag: value.float()}, True, 128).items()
        out[f"base_model.model.{name.removesuffix(tag)}.{role}.weight"] = converted
    return out


def make_peft(layer1, out):
    from diffusers import StableAudio3DiTModel
    from peft import LoraConfig, get_peft_model

    tensors = diffusers_names(layer1)
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in tensors})
    dit = StableAudio3DiTModel.from_pretrained(os.path.join(oracle_env.FIXTURES, "sa3_tiny", "dit_diff"))
    peft_model = get_peft_model(dit, LoraConfig(r=2, lora_alpha=2, target_modules=modules, init_lora_weights=False))
    with torch.no_grad():
        params = dict(peft_model.named_parameters())
        for key, value in tensors.items():
            params[key.replace(".weight", ".default.weight")].copy_(value)
    root = os.path.join(out, "peft")
    peft_model.save_pretrained(root)
    os.remove(os.path.join(root, "README.md"))  # PEFT's model card
    saved = load_file(os.path.join(root, "adapter_model.safetensors"))
    assert saved.keys() == tensors.keys(), sorted(set(saved) ^ set(tensors))
    assert all(torch.equal(saved[k], tensors[k]) for k in tensors)
    for f in os.listdir(root):
        os.chmod(os.path.join(root, f), 0o644)
    return len(saved)


def main():
    args = oracle_env.official_sa3_args("make_sa3_lora_fixtures")
    out = os.path.join(args.out, "sa3_lora")
    os.makedirs(out, exist_ok=True)
    original = os.path.join(oracle_env.FIXTURES, "sa3_tiny", "original")
    with open(os.path.join(original, "model_config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(original, "model.safetensors"))
    with tempfile.TemporaryDirectory() as root:
        model, _ = sa3.official_checkpoint(oracle_env.FIXTURES, config, root, 31,
                                           lambda wrapper: wrapper.load_state_dict(weights, strict=True))
    gen = torch.Generator().manual_seed(71)
    full = make_lora(model, os.path.join(out, "official.safetensors"), gen, 4, 8,
                     config={"rank": 4, "alpha": 8, "adapter_type": "lora", "dropout": 0.0,
                             "include": None, "exclude": None})
    layer1 = make_lora(model, os.path.join(out, "layer1.safetensors"), gen, 2, 2, include=["transformer.layers.1."],
                       config={"adapter_type": "lora", "include": ["transformer.layers.1."]})
    dora = make_lora(model, os.path.join(out, "dora.safetensors"), gen, 2, 4, adapter_type="dora-rows",
                     config={"rank": 2, "alpha": 4, "adapter_type": "dora-rows", "dropout": 0.0})
    # PEFT's copy of the factors as the official file holds them (rounded to fp16).
    peft_tensors = make_peft(load_file(os.path.join(out, "layer1.safetensors")), out)
    ref = {f"{case}.fp32.audio": generate(model, config, loras, out) for case, loras in CASES.items()}
    save_file(ref, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"request": sa3.PIPELINE, "cases": CASES}, f, indent=1)
    for name in ("reference.safetensors", "reference.json"):
        os.chmod(os.path.join(out, name), 0o644)
    pipeline = load_file(os.path.join(args.out, "sa3_pipeline_ref.safetensors"))["fp32.audio"]
    none = ref["none.fp32.audio"]
    print(f"sa3 lora: official {len(full)} tensors, layer1 {len(layer1)}, dora {len(dora)}, peft {peft_tensors}; "
          f"no adapters vs the pipeline fixture max |d| {(none - pipeline).abs().max().item():.3e}; rel L2 from "
          "no adapters: " + ", ".join(f"{c} {sa3.rel(ref[c + '.fp32.audio'], none):.3e}" for c in CASES if c != "none"))
    assert sa3.rel(none, pipeline) < 1e-5  # the same clip, up to this CPU's torch kernels


if __name__ == "__main__":
    main()
