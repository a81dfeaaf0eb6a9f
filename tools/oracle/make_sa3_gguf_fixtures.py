#!/usr/bin/env python3
"""sa3.cpp's GGUF files (thepatch/stable-audio-3-*-GGUF, t5gemma-b-b-ul2-GGUF) made from the tiny
official checkpoints, written with gguf-py in the layout sa3.cpp's converters give them
(docs/notes/sa3cpp-gguf.md has every rule and where in sa3.cpp @ 79f57b8 it was read):

  - names: model.model.* -> dit.*, pretransform.model.* -> ae.*, the conditioner's three tensors ->
    te.padding_embedding / te.secs.*, T5Gemma's model.encoder.* -> te.*; the DiT's RoPE
    inv_freq and the bottleneck's empty noise_scaling_factor dropped;
  - values: every tensor f32 (F16 files: the 2-D ones other than *tokens* as f16); the SAME
    mappings' weight norm folded in float64 (w = g v / |v|, a k=3 mapping stored as taps w0..w2);
    Gemma's RMSNorm weights stored as 1 + w; 1-D parameters squeezed ([1,16,1] -> [16]), the
    DiT's 1x1 convs as [out, in];
  - metadata: general.architecture sa3-dit / sa3-ae / sa3-conditioner / sa3-t5gemma / sa3-tokenizer,
    general.finetune the variant, and the dit.* / sa3.ae.* / t5g.* / tok.* keys from the config;
  - the vocabulary file: tok.tokens and tok.merges from transformers' conversion of Gemma's
    SentencePiece model (its tokenizer.json), no tensors;
  - Q8_0: the quantiser's rule (2-D, no "tokens" or "running_std" in the name, ne[0] a multiple of
    32) with gguf-py's quantize; the others stay as the F32 file has them.

Writes under tests/fixtures/sa3_gguf/:
  medium/   the DiT (F32 and Q8_0), SAME-L (F32), conditioner, T5Gemma encoder and vocabulary of
            sa3_tiny/original (the tiny medium: differential DiT, SAME-L) and t5gemma_tiny, and the
            tokenizer.json transformers converts t5gemma_tok's SentencePiece model to (what the
            vocabulary is made from)
  small/    SAME-S (F16) of sa3_tiny/original_small: both mappings k=3, stored as taps
Deterministic (no randomness: a re-layout of committed fixtures).
"""

import argparse
import json
import os

import numpy as np
import oracle_env  # noqa: F401
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.numpy import load_file
from transformers import AutoTokenizer

VERSION = "v1.0"


def general(w, basename, finetune=None, size_label=None, license_id="stabilityai-community"):
    w.add_name(basename)
    w.add_string("general.basename", basename)
    w.add_string("general.version", VERSION)
    w.add_string("general.license", license_id)
    if finetune:
        w.add_string("general.finetune", finetune)
    if size_label:
        w.add_string("general.size_label", size_label)


def dit_name(k):
    r = k[len("model.model."):]
    direct = {"preprocess_conv.weight": "pre_conv.weight", "postprocess_conv.weight": "post_conv.weight",
              "transformer.memory_tokens": "memory_tokens", "transformer.project_in.weight": "proj_in.weight",
              "transformer.project_out.weight": "proj_out.weight"}
    if r in direct:
        return "dit." + direct[r]
    for official, short in (("to_cond_embed.", "cond_embed."), ("to_global_embed.", "global_embed."),
                            ("to_timestep_embed.", "time_embed."), ("transformer.global_cond_embedder.", "gce.")):
        if r.startswith(official):
            return "dit." + short + r[len(official):]
    if r == "transformer.rotary_pos_emb.inv_freq":
        return None
    assert r.startswith("transformer.layers."), k
    i, rest = r[len("transformer.layers."):].split(".", 1)
    block = {"cross_attend_norm.gamma": "cross_norm.gamma", "self_attn.to_qkv.weight": "self.qkv.weight",
             "self_attn.to_out.weight": "self.out.weight", "self_attn.q_norm.gamma": "self.q_norm.gamma",
             "self_attn.k_norm.gamma": "self.k_norm.gamma", "cross_attn.to_q.weight": "cross.q.weight",
             "cross_attn.to_kv.weight": "cross.kv.weight", "cross_attn.to_out.weight": "cross.out.weight",
             "cross_attn.q_norm.gamma": "cross.q_norm.gamma", "cross_attn.k_norm.gamma": "cross.k_norm.gamma",
             "ff.ff.0.proj.weight": "ff.proj.weight", "ff.ff.0.proj.bias": "ff.proj.bias",
             "ff.ff.2.weight": "ff.out.weight", "ff.ff.2.bias": "ff.out.bias", "to_scale_shift_gate": "ssg",
             "pre_norm.gamma": "pre_norm.gamma", "ff_norm.gamma": "ff_norm.gamma"}
    if rest.startswith("to_local_embed."):
        return f"dit.{i}.local." + rest[len("to_local_embed."):]
    return f"dit.{i}.{block[rest]}"


def ae_name(k):
    r = k[len("pretransform.model."):]
    direct = {"bottleneck.running_std": "running_std", "bottleneck.scaling_factor": "scaling_factor",
              "bottleneck.bias": "bias", "decoder.layers.1.weight": "in_proj.weight",
              "decoder.layers.1.bias": "in_proj.bias", "decoder.layers.3.new_tokens": "dec.new_tokens",
              "decoder.layers.3.mapping.bias": "dec.mapping.bias", "encoder.layers.0.new_tokens": "enc.new_tokens",
              "encoder.layers.0.mapping.bias": "enc.mapping.bias", "encoder.layers.2.weight": "out_proj.weight",
              "encoder.layers.2.bias": "out_proj.bias"}
    if r in direct:
        return "ae." + direct[r]
    if r == "bottleneck.noise_scaling_factor":
        return None
    for official, short in (("decoder.layers.3.transformers.", "dec."), ("encoder.layers.0.transformers.", "enc.")):
        if r.startswith(official):
            return "ae." + short + r[len(official):].replace("ff.ff.0.proj", "ff.proj").replace("ff.ff.2", "ff.out")
    raise AssertionError(k)


def t5_name(k):
    r = k[k.index("encoder.") + len("encoder."):]
    if r == "embed_tokens.weight":
        return "te.embed.weight", False
    if r == "norm.weight":
        return "te.norm.weight", True
    i, rest = r[len("layers."):].split(".", 1)
    block = {"pre_self_attn_layernorm.weight": ("attn_norm.weight", True),
             "post_self_attn_layernorm.weight": ("attn_post_norm.weight", True),
             "pre_feedforward_layernorm.weight": ("ffn_norm.weight", True),
             "post_feedforward_layernorm.weight": ("ffn_post_norm.weight", True),
             "self_attn.q_proj.weight": ("q.weight", False), "self_attn.k_proj.weight": ("k.weight", False),
             "self_attn.v_proj.weight": ("v.weight", False), "self_attn.o_proj.weight": ("o.weight", False),
             "mlp.gate_proj.weight": ("gate.weight", False), "mlp.up_proj.weight": ("up.weight", False),
             "mlp.down_proj.weight": ("down.weight", False)}
    sub, norm = block[rest]
    return f"te.{i}.{sub}", norm


def encoded(name, t, encoding):
    """The tensor as a file of `encoding` stores it: (array, raw GGML type or None)."""
    t = np.ascontiguousarray(t.astype(np.float32))
    if encoding == "F16" and t.ndim == 2 and "tokens" not in name:
        return t.astype(np.float16), None
    if (encoding == "Q8_0" and t.ndim == 2 and "tokens" not in name and "running_std" not in name
            and t.shape[-1] % 32 == 0):
        return quants.quantize(t, T.Q8_0), T.Q8_0
    return t, None


def write(path, arch, tensors, meta, encoding):
    w = gguf.GGUFWriter(path, arch=arch)
    meta(w)
    for name, t in tensors:
        data, raw = encoded(name, t, encoding)
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.chmod(path, 0o644)
    print("wrote", path)


def diffusion_config(config):
    return config["model"]["diffusion"]["config"]


def write_dit(out, variant, weights, config, encoding):
    c = diffusion_config(config)
    tensors = []
    for k in sorted(weights):
        if not k.startswith("model.model."):
            continue
        name = dit_name(k)
        if name is None:
            continue
        t = weights[k]
        if name in ("dit.pre_conv.weight", "dit.post_conv.weight"):
            t = t[:, :, 0]
        tensors.append((name, t))
    dim, heads = c["embed_dim"], c["num_heads"]

    def meta(w):
        general(w, f"stable-audio-3-{variant}-dit", variant, "tiny")
        w.add_uint32("dit.io", c["io_channels"])
        w.add_uint32("dit.dim", dim)
        w.add_uint32("dit.depth", c["depth"])
        w.add_uint32("dit.heads", heads)
        w.add_uint32("dit.head_dim", dim // heads)
        w.add_uint32("dit.cond_dim", c["cond_token_dim"])
        w.add_uint32("dit.mem_tokens", c["num_memory_tokens"])
        w.add_uint32("dit.rot", dim // heads // 2)
        w.add_uint32("dit.time_dim", c.get("timestep_features_dim", 256))
        w.add_uint32("dit.differential", 1 if c.get("attn_kwargs", {}).get("differential", False) else 0)
        w.add_uint32("dit.local_dim", c.get("local_add_cond_dim", 0) or 0)
        w.add_float32("dit.rope_base", 10000.0)
        w.add_float32("dit.norm_eps", 1e-5)
        w.add_float32("dit.qk_eps", 1e-6)
        w.add_float32("dit.time_min_freq", 0.5)
        w.add_float32("dit.time_max_freq", 10000.0)
        w.add_bool("dit.training_base", False)

    write(os.path.join(out, f"stable-audio-3-{variant}-dit-tiny-{VERSION}-{encoding}.gguf"), "sa3-dit", tensors,
          meta, encoding)


def fold_weight_norm(g, v):
    norm = np.sqrt((v.astype(np.float64) ** 2).sum(axis=tuple(range(1, v.ndim)), keepdims=True))
    return (g.astype(np.float64) * v.astype(np.float64) / norm).astype(np.float32)


def write_same(out, variant, weights, config, encoding):
    ae = config["model"]["pretransform"]["config"]
    dec, patch = ae["decoder"]["config"], ae["pretransform"]["config"]
    keys = [k for k in weights if k.startswith("pretransform.model.")]
    tensors = []
    for stem, name in (("decoder.layers.3.mapping", "ae.dec.mapping"), ("encoder.layers.0.mapping", "ae.enc.mapping")):
        p = "pretransform.model." + stem
        w = fold_weight_norm(weights[p + ".weight_g"], weights[p + ".weight_v"])
        if w.shape[-1] == 1:
            tensors.append((name + ".weight", w[:, :, 0]))
        else:
            tensors += [(f"{name}.w{tap}", w[:, :, tap]) for tap in range(w.shape[-1])]
    for k in keys:
        if k.endswith(".weight_g") or k.endswith(".weight_v"):
            continue
        name = ae_name(k)
        if name is None:
            continue
        t = weights[k]
        if name in ("ae.dec.new_tokens", "ae.enc.new_tokens", "ae.running_std", "ae.scaling_factor", "ae.bias"):
            t = t.reshape(-1)
        tensors.append((name, t))
    dim = dec["channels"] * dec["c_mults"][0]
    kind = "same-s" if dec.get("chunk_midpoint_shift", False) else "same-l"

    def meta(w):
        general(w, f"stable-audio-3-{variant}-{kind}", variant)
        w.add_uint32("sa3.ae.dim", dim)
        w.add_uint32("sa3.ae.latent_dim", ae["latent_dim"])
        w.add_uint32("sa3.ae.dim_heads", dec["dim_heads"])
        w.add_uint32("sa3.ae.n_heads", dim // dec["dim_heads"])
        w.add_uint32("sa3.ae.depth", dec["transformer_depths"][0])
        w.add_uint32("sa3.ae.stride", dec["strides"][0])
        w.add_uint32("sa3.ae.sub_chunk", dec["strides"][0] + 1)
        w.add_uint32("sa3.ae.output_seg", dec["strides"][0])
        w.add_uint32("sa3.ae.sliding_window", dec["strides"][0] + 1)
        w.add_uint32("sa3.ae.ff_mult", 3)
        w.add_uint32("sa3.ae.sinusoidal_blocks", dec.get("sinusoidal_blocks", [0])[0])
        w.add_uint32("sa3.ae.out_channels", dec["out_channels"])
        w.add_uint32("sa3.ae.patch_size", patch["patch_size"])
        w.add_uint32("sa3.ae.audio_channels", patch["channels"])
        w.add_uint32("sa3.ae.downsampling_ratio", ae["downsampling_ratio"])
        w.add_uint32("sa3.ae.sample_rate", config["sample_rate"])
        w.add_float32("sa3.ae.rope_base", 10000.0)
        w.add_float32("sa3.ae.qk_norm_eps", 1e-3)
        w.add_uint32("sa3.ae.chunk", 1 if dec.get("chunk_midpoint_shift", False) else 0)
        w.add_uint32("sa3.ae.chunk_size", dec.get("chunk_size", 0))
        w.add_uint32("sa3.ae.dec_conv_mapping", 1 if dec.get("conv_mapping", False) else 0)

    write(os.path.join(out, f"stable-audio-3-{variant}-{kind}-{VERSION}-{encoding}.gguf"), "sa3-ae", tensors, meta,
          encoding)


def write_conditioner(out, variant, weights, config):
    secs = next(c["config"] for c in config["model"]["conditioning"]["configs"] if c["id"] == "seconds_total")
    p = "conditioner.conditioners."
    tensors = [("te.padding_embedding", weights[p + "prompt.padding_embedding"]),
               ("te.secs.weight", weights[p + "seconds_total.embedder.embedding.1.weight"]),
               ("te.secs.bias", weights[p + "seconds_total.embedder.embedding.1.bias"])]

    def meta(w):
        general(w, f"stable-audio-3-{variant}-conditioner", variant)
        w.add_float32("t5g.secs_min", float(secs.get("min_val", 0)))
        w.add_float32("t5g.secs_max", float(secs.get("max_val", 384)))
        w.add_uint32("t5g.secs_dim", 256)

    write(os.path.join(out, f"stable-audio-3-{variant}-conditioner-{VERSION}-F32.gguf"), "sa3-conditioner", tensors,
          meta, "F32")


def write_t5gemma(out, weights, config):
    c = config["encoder"]
    tensors = []
    for k in sorted(weights):
        if "encoder." not in k:
            continue
        name, norm = t5_name(k)
        t = weights[k].astype(np.float32)
        tensors.append((name, t + np.float32(1.0) if norm else t))

    def meta(w):
        general(w, "t5gemma-b-b-ul2-encoder", size_label="tiny", license_id="gemma")
        w.add_uint32("t5g.dim", c["hidden_size"])
        w.add_uint32("t5g.layers", c["num_hidden_layers"])
        w.add_uint32("t5g.heads", c["num_attention_heads"])
        w.add_uint32("t5g.head_dim", c["head_dim"])
        w.add_uint32("t5g.intermediate", c["intermediate_size"])
        w.add_uint32("t5g.vocab", c["vocab_size"])
        w.add_float32("t5g.eps", c["rms_norm_eps"])
        w.add_float32("t5g.rope_theta", c.get("rope_theta", c.get("rope_parameters", {}).get("rope_theta")))
        w.add_float32("t5g.attn_softcap", c["attn_logit_softcapping"])
        w.add_float32("t5g.query_scalar", c["query_pre_attn_scalar"])
        w.add_float32("t5g.normalizer", float(c["hidden_size"]) ** 0.5)
        w.add_uint32("t5g.max_length", 256)

    write(os.path.join(out, f"t5gemma-b-b-ul2-encoder-tiny-{VERSION}-F32.gguf"), "sa3-t5gemma", tensors, meta, "F32")


def write_vocabulary(out, tokenizer_dir):
    text = AutoTokenizer.from_pretrained(tokenizer_dir).backend_tokenizer.to_str()
    with open(os.path.join(out, "gemma-tokenizer.json"), "w") as f:
        f.write(text)
    tj = json.loads(text)
    model = tj["model"]
    assert model["type"] == "BPE", model["type"]
    vocab = model["vocab"]
    tokens = [""] * (max(vocab.values()) + 1)
    for piece, i in vocab.items():
        tokens[i] = piece
    for added in tj.get("added_tokens", []):
        if added["id"] < len(tokens):
            tokens[added["id"]] = added["content"]
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m for m in model["merges"]]
    path = os.path.join(out, f"t5gemma-b-b-ul2-{VERSION}-vocab.gguf")
    w = gguf.GGUFWriter(path, arch="sa3-tokenizer")
    general(w, "t5gemma-b-b-ul2", license_id="gemma")
    w.add_array("tok.tokens", tokens)
    w.add_array("tok.merges", merges)
    w.add_uint32("tok.bos_id", vocab.get("<bos>", 2))
    w.add_uint32("tok.eos_id", vocab.get("<eos>", 1))
    w.add_uint32("tok.pad_id", vocab.get("<pad>", 0))
    w.add_uint32("tok.unk_id", vocab.get("<unk>", 3))
    w.add_bool("tok.byte_fallback", bool(model.get("byte_fallback", True)))
    w.add_bool("tok.add_bos", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.chmod(path, 0o644)
    print("wrote", path, len(tokens), "tokens,", len(merges), "merges")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    fixtures = ap.parse_args().out
    root = os.path.join(fixtures, "sa3_gguf")
    medium, small = os.path.join(root, "medium"), os.path.join(root, "small")
    os.makedirs(medium, exist_ok=True)
    os.makedirs(small, exist_ok=True)

    def official(name):
        d = os.path.join(fixtures, "sa3_tiny", name)
        with open(os.path.join(d, "model_config.json")) as f:
            return load_file(os.path.join(d, "model.safetensors")), json.load(f)

    weights, config = official("original")
    for encoding in ("F32", "Q8_0"):
        write_dit(medium, "medium", weights, config, encoding)
    write_same(medium, "medium", weights, config, "F32")
    write_conditioner(medium, "medium", weights, config)
    with open(os.path.join(fixtures, "t5gemma_tiny", "config.json")) as f:
        t5_config = json.load(f)
    write_t5gemma(medium, load_file(os.path.join(fixtures, "t5gemma_tiny", "model.safetensors")), t5_config)
    write_vocabulary(medium, os.path.join(fixtures, "t5gemma_tok"))

    weights, config = official("original_small")
    write_same(small, "small-music", weights, config, "F16")


if __name__ == "__main__":
    main()
