#!/usr/bin/env python3
"""Layouts of black-forest-labs/FLUX.2-klein-4B, -9B and -9b-kv for `apus synth`, taken from the
official classes.

Instantiates Flux2Transformer2DModel, AutoencoderKLFlux2 and transformers' Qwen3ForCausalLM at full
published size on the meta device (no memory, no weights) and writes data/<name>/:

  model_index.json, scheduler/, tokenizer/        copied from tests/fixtures/klein_tiny_a (see README.md)
  transformer/config.json, vae/config.json        each class's own save_config
  text_encoder/config.json, generation_config.json, model.safetensors.index.json
  manifest.json                                   every weight file: its tensors (name, dtype, shape)
                                                  in on-disk order, and its safetensors metadata

The 9B sizes are the public record's (8 double and 24 single blocks of 32 heads of 128, text
width 3 x 4096; Qwen/Qwen3-8B's config): the repositories are gated, so their files were not read
here. Shard counts follow the libraries' default shard sizes; apus reads any sharding through the
index files.

Usage: make_klein_manifest.py [--model flux2-klein-4b|flux2-klein-9b|flux2-klein-9b-kv] [--out DIR]
       make_klein_manifest.py [--model ...] --verify CHECKPOINT_DIR   (headers of a synthesized or
                                                         downloaded checkpoint against the meta models)
"""

import argparse
import json
import os
import shutil
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_env import FIXTURES, REPO  # noqa: E402

FIXTURE = os.path.join(FIXTURES, "klein_tiny_a")

TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    out_channels=None,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=7680,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)

# Qwen/Qwen3-4B as published (klein ships it unchanged as its text encoder).
QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=40960,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    attention_bias=False,
    attention_dropout=0.0,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=36,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)

# Qwen/Qwen3-8B as published (the 9B models' text encoder).
QWEN3_8B = dict(
    QWEN3_4B,
    hidden_size=4096,
    intermediate_size=12288,
    tie_word_embeddings=False,
)

TRANSFORMER_9B = dict(TRANSFORMER, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288)

MODELS = {
    "flux2-klein-4b": dict(repo="black-forest-labs/FLUX.2-klein-4B", transformer=TRANSFORMER, qwen=QWEN3_4B,
                           pipeline="Flux2KleinPipeline"),
    "flux2-klein-9b": dict(repo="black-forest-labs/FLUX.2-klein-9B", transformer=TRANSFORMER_9B, qwen=QWEN3_8B,
                           pipeline="Flux2KleinPipeline"),
    "flux2-klein-9b-kv": dict(repo="black-forest-labs/FLUX.2-klein-9b-kv", transformer=TRANSFORMER_9B, qwen=QWEN3_8B,
                              pipeline="Flux2KleinKVPipeline"),
}

QWEN3_4B_GENERATION = dict(
    bos_token_id=151643,
    do_sample=True,
    eos_token_id=[151645, 151643],
    pad_token_id=151643,
    temperature=0.6,
    top_k=20,
    top_p=0.95,
)

# transformers <= 4.x saved with 5 GB shards; that is why the ~8 GB encoder ships as two files.
TEXT_ENCODER_SHARD_SIZE = "5GB"
# diffusers' save_pretrained default: the 9B transformer (18 GB) is two files.
TRANSFORMER_SHARD_SIZE = "10GB"

README = """\
Layout of {repo} (diffusers) for `apus synth`, written by
tools/oracle/make_klein_manifest.py from the official classes on the meta device: configs, the shard
indexes, and manifest.json (every tensor's name, dtype and shape per file, in on-disk order).{note}
The tokenizer here is NOT Qwen's published 151k-entry one: it is the small fixture tokenizer from
tests/fixtures/klein_tiny_a/tokenizer (same format and special tokens), a stand-in that synth copies as is.
"""

NOTE_9B = """
The sizes are the public record's, not read from the gated repository: 8 double and 24 single
blocks of 32 heads of 128, a 3 x 4096 text width, Qwen/Qwen3-8B's text encoder config. The shard
counts are the libraries' defaults (apus reads any sharding through the index files)."""


def meta_models(model):
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        transformer = Flux2Transformer2DModel(**MODELS[model]["transformer"]).to(torch.bfloat16)
        vae = AutoencoderKLFlux2().to(torch.bfloat16)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**MODELS[model]["qwen"])).to(torch.bfloat16)
    v = vae.config
    assert tuple(v.block_out_channels) == (128, 256, 512, 512) and v.latent_channels == 32, v
    assert v.layers_per_block == 2 and v.norm_num_groups == 32 and v.batch_norm_eps == 1e-4, v
    assert tuple(v.patch_size) == (2, 2), v
    return transformer, vae, text_encoder


def safetensors_order(tensors):
    """Names in the order safetensors lays them out on disk (it sorts by dtype, then name): serialise
    one-element stand-ins with the library itself and read its header back."""
    import torch
    from safetensors.torch import save

    blob = save({k: torch.zeros((), dtype=t.dtype) for k, t in tensors.items()})
    (n,) = struct.unpack("<Q", blob[:8])
    return [k for k in json.loads(blob[8 : 8 + n]) if k != "__metadata__"]


def dtype_name(dtype):
    from safetensors.torch import _TYPES

    return next(k for k, v in _TYPES.items() if v == dtype)


def file_entry(path, tensors):
    return {
        "path": path,
        "metadata": {"format": "pt"},  # what both diffusers and transformers pass to safetensors
        "tensors": [
            {"name": k, "dtype": dtype_name(tensors[k].dtype), "shape": list(tensors[k].shape)}
            for k in safetensors_order(tensors)
        ],
    }


def text_encoder_split(model):
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    sd = remove_tied_weights_from_state_dict(model.state_dict(), model)
    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="model{suffix}.safetensors", max_shard_size=TEXT_ENCODER_SHARD_SIZE
    )
    assert len(split.filename_to_tensors) >= 2, list(split.filename_to_tensors)
    # transformers' own index format (modeling_utils.PreTrainedModel.save_pretrained)
    index = {
        "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
        "weight_map": split.tensor_to_filename,
    }
    return sd, split, index


def transformer_split(model):
    """The transformer's files as diffusers' save_pretrained writes them: one file under its shard
    size, else shards and diffusers' index."""
    from huggingface_hub import split_torch_state_dict_into_shards

    sd = model.state_dict()
    split = split_torch_state_dict_into_shards(
        sd, filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size=TRANSFORMER_SHARD_SIZE
    )
    index = None
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    return sd, split, index


def weight_files(model):
    """{relative path: state dict} of every weight file, and the shard indexes to write."""
    transformer, vae, text_encoder = meta_models(model)
    sd, split, te_index = text_encoder_split(text_encoder)
    tsd, tsplit, t_index = transformer_split(transformer)
    files = {}
    for fname, names in tsplit.filename_to_tensors.items():
        files["transformer/" + fname] = {k: tsd[k] for k in names}
    files["vae/diffusion_pytorch_model.safetensors"] = vae.state_dict()
    for fname, names in split.filename_to_tensors.items():
        files["text_encoder/" + fname] = {k: sd[k] for k in names}
    indexes = {"text_encoder/model.safetensors.index.json": te_index}
    if t_index:
        indexes["transformer/diffusion_pytorch_model.safetensors.index.json"] = t_index
    return files, indexes, (transformer, vae, text_encoder)


def expected_files(model):
    """{relative path: {name: (dtype, shape)}} of every weight file, from the meta models."""
    files, _, _ = weight_files(model)
    return {p: {k: (dtype_name(t.dtype), list(t.shape)) for k, t in sd_.items()} for p, sd_ in files.items()}


def write_json(obj, path, indent=2, sort_keys=False):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n")


def write_manifest(files, params, path, model, generator="tools/oracle/make_klein_manifest.py"):
    # one tensor per line: the file stays reviewable in a diff
    import diffusers
    import torch
    import transformers

    lines = ["{", '  "model": %s,' % json.dumps(model), '  "generator": %s,' % json.dumps(generator),
             '  "versions": ' + json.dumps({"torch": torch.__version__, "diffusers": diffusers.__version__,
                                           "transformers": transformers.__version__}) + ",",
             '  "parameters": ' + json.dumps(params) + ",", '  "files": [']
    for i, f in enumerate(files):
        lines.append('    {"path": %s, "metadata": %s, "tensors": [' % (json.dumps(f["path"]), json.dumps(f["metadata"])))
        for j, t in enumerate(f["tensors"]):
            lines.append("      " + json.dumps(t) + ("," if j + 1 < len(f["tensors"]) else ""))
        lines.append("    ]}" + ("," if i + 1 < len(files) else ""))
    lines += ["  ]", "}"]
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("\n".join(lines) + "\n")
    json.load(open(path, encoding="utf-8"))


def build(model, out):
    import diffusers
    from transformers import GenerationConfig

    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    weights, indexes, (transformer, vae, text_encoder) = weight_files(model)

    for name, module in (("transformer", transformer), ("vae", vae)):
        module.save_config(os.path.join(out, name))
    te_dir = os.path.join(out, "text_encoder")
    text_encoder.config.architectures = [type(text_encoder).__name__]  # as PreTrainedModel.save_pretrained sets it
    text_encoder.config.save_pretrained(te_dir)
    gen = GenerationConfig(**QWEN3_4B_GENERATION)
    gen.save_pretrained(te_dir)
    for path, index in indexes.items():
        with open(os.path.join(out, path), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")

    with open(os.path.join(FIXTURE, "model_index.json"), encoding="utf-8") as f:
        model_index = json.load(f)
    model_index["_class_name"] = MODELS[model]["pipeline"]
    model_index["_diffusers_version"] = diffusers.__version__
    write_json(model_index, os.path.join(out, "model_index.json"))
    os.makedirs(os.path.join(out, "scheduler"))
    shutil.copy(os.path.join(FIXTURE, "scheduler", "scheduler_config.json"), os.path.join(out, "scheduler"))
    shutil.copytree(os.path.join(FIXTURE, "tokenizer"), os.path.join(out, "tokenizer"))
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(README.format(repo=MODELS[model]["repo"], note="" if model == "flux2-klein-4b" else NOTE_9B))

    files = [file_entry(path, sd) for path, sd in weights.items()]
    params = {
        "transformer": sum(p.numel() for p in transformer.parameters()),
        "vae": sum(p.numel() for p in vae.parameters()),
        "text_encoder": text_encoder.num_parameters(),
    }
    write_manifest(files, params, os.path.join(out, "manifest.json"), MODELS[model]["repo"])
    for f in files:
        nbytes = sum(_numel(t["shape"]) * _itemsize(t["dtype"]) for t in f["tensors"])
        print(f"{f['path']}: {len(f['tensors'])} tensors, {nbytes} bytes of data")
    print("parameters", params)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype):
    return {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}[dtype]


def verify(model, root):
    """Compares the headers (not the data) of every weight file under root with the meta models."""
    from safetensors import safe_open

    bad = 0
    expected = expected_files(model)
    for path, want in expected.items():
        full = os.path.join(root, path)
        with safe_open(full, framework="pt") as f:
            got = {}
            for k in f.keys():
                s = f.get_slice(k)
                got[k] = (s.get_dtype(), list(s.get_shape()))
        if got != want:
            bad += 1
            print(f"MISMATCH {path}: missing {sorted(set(want) - set(got))[:5]} extra {sorted(set(got) - set(want))[:5]}"
                  f" differing {[k for k in want if k in got and got[k] != want[k]][:5]}")
        else:
            print(f"ok {path}: {len(got)} tensors, {os.path.getsize(full)} bytes")
    with open(os.path.join(root, "text_encoder", "model.safetensors.index.json"), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    te = {k: p.split("/")[-1] for p, ts in expected.items() if p.startswith("text_encoder/") for k in ts}
    if weight_map != te:
        bad += 1
        print("MISMATCH text_encoder/model.safetensors.index.json weight_map")
    return bad == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux2-klein-4b", choices=sorted(MODELS))
    ap.add_argument("--out", help="default: data/<model>")
    ap.add_argument("--verify", metavar="CHECKPOINT_DIR")
    args = ap.parse_args()
    if args.verify:
        sys.exit(0 if verify(args.model, args.verify) else 1)
    build(args.model, args.out or os.path.join(REPO, "data", args.model))


if __name__ == "__main__":
    main()
