#!/usr/bin/env python3
"""Oracle for apus's single-file klein transformers: klein_tiny_a's DiT in BFL's original key
names (as black-forest-labs/FLUX.2-klein-4B's flux-2-klein-4b.safetensors and the GGUF
quantisations of it carry them), checked to convert back to the diffusers folder exactly with
diffusers' own single-file converter (convert_flux2_transformer_checkpoint_to_diffusers).

Writes, under tests/fixtures/klein_single/:
  flux-2-klein-tiny.safetensors              BFL names, bf16 (the folder's values, qkv fused,
                                             final adaLN's (shift, scale) order)
  flux-2-klein-tiny-Q8_0.gguf                the same as GGUF via gguf-py: 2-D weights Q8_0 (from
                                             the bf16 values), 1-D norms F32
  flux-2-klein-tiny-Q8_0-dequantized.safetensors   gguf-py's dequantisation of that file, f32,
                                             BFL names: what the GGUF's model is
  flux-2-klein-tiny-Q4_K_M.gguf              a mixed file as the K-quant GGUFs are: the weights whose
                                             rows hold 256 values (time_in.in_layer, the single
                                             blocks' linear2) as Q4_K and Q6_K blocks, the rest
                                             Q8_0, norms F32. gguf-py has no K-quant quantiser, so
                                             the K blocks are random with small scales: their model
                                             is what gguf-py dequantises them to
  flux-2-klein-tiny-Q4_K_M-dequantized.safetensors   gguf-py's dequantisation of it, f32
  flux-2-klein-tiny-fp8.safetensors          BFL names as flux-2-klein-4b-fp8.safetensors lays them
                                             out: 2-D weights float8_e4m3fn scaled per tensor (amax /
                                             448) with .weight_scale and .input_scale (F32 scalars),
                                             norms bf16
  flux-2-klein-tiny-fp8-dequantized.safetensors   torch's weight.float() * weight_scale, f32
  qwen3-tiny-Q8_0.gguf                       klein_tiny_a's Qwen3 text encoder as llama.cpp's GGUF
                                             (arch qwen3, names from gguf-py's tensor map for
                                             MODEL_ARCH.QWEN3, as convert_hf_to_gguf writes them):
                                             2-D weights Q8_0, norms F32, and klein_tiny_a's
                                             tokenizer as tokenizer.ggml.* metadata (gpt2 model,
                                             qwen2 pre-tokenizer, as the converter writes it)
  qwen3-tiny-Q8_0-dequantized.safetensors    gguf-py's dequantisation of it, f32, transformers' names
  flux2-vae-tiny.safetensors                 klein_tiny_a's VAE in BFL's ldm names (ae.safetensors:
                                             encoder.quant_conv / decoder.post_quant_conv, attention
                                             projections as 1x1 conv weights)
  flux2-vae-tiny-sd.safetensors              the same under "vae." with the quant convs at the top
                                             (the layout diffusers' convert_ldm_vae_checkpoint reads)
Both VAE files are checked to convert back to the folder exactly with diffusers'
convert_ldm_vae_checkpoint (the BFL one after ComfyUI's rename of its two quant convs).

Usage: make_klein_single_file_fixtures.py [--out DIR]
"""

import argparse
import json
import os

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer
from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers, convert_ldm_vae_checkpoint

from klein_names import bfl_transformer_plan, vae_ldm_name

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "..", "..", "tests", "fixtures", "klein_tiny_a")
FOLDER = os.path.join(TINY, "transformer")

def bfl_tensor(get, parts):
    """One BFL tensor of a bfl_transformer_plan entry, get(name) giving diffusers' tensors."""
    return torch.cat([get(k) if half is None else get(k).chunk(2, dim=0)[half] for k, half in parts]).contiguous()


def to_bfl(sd):
    return {name: bfl_tensor(sd.__getitem__, parts) for name, parts in bfl_transformer_plan(sd)}


def check_round_trip(bfl, sd):
    back = convert_flux2_transformer_checkpoint_to_diffusers(dict(bfl))
    assert sorted(back) == sorted(sd), sorted(set(back) ^ set(sd))
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def random_k_blocks(rows, cols, kind, rng):
    """Random K-quant blocks whose f16 scales keep the values near the tiny model's weights."""
    block = {T.Q4_K: 144, T.Q6_K: 210}[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    if kind == T.Q4_K:  # d and dmin lead the block: v = d * sc * q - dmin * m
        raw[..., 0:2] = np.frombuffer(np.float16(5e-5).tobytes(), np.uint8)
        raw[..., 2:4] = np.frombuffer(np.float16(3e-4).tobytes(), np.uint8)
    else:  # d ends the block: v = d * sc * (q - 32), centred
        raw[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_k_quant_gguf(bfl, out):
    rng = np.random.default_rng(20)
    w = gguf.GGUFWriter(os.path.join(out, "flux-2-klein-tiny-Q4_K_M.gguf"), arch="flux")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    dequantized = {}
    for name, t in bfl.items():
        values = t.float().numpy()
        kind = None
        if values.ndim == 2 and values.shape[-1] % 256 == 0:
            kind = T.Q4_K if name.startswith("time_in") else T.Q6_K
            q = random_k_blocks(values.shape[0], values.shape[1], kind, rng)
        elif values.ndim == 2 and values.shape[-1] % 32 == 0:
            kind = T.Q8_0
            q = quants.quantize(values, T.Q8_0)
        if kind is None:
            w.add_tensor(name, values)
            dequantized[name] = torch.from_numpy(values.copy())
        else:
            w.add_tensor(name, q, raw_dtype=kind)
            dequantized[name] = torch.from_numpy(quants.dequantize(q, kind).astype(np.float32).reshape(values.shape))
    assert sum(1 for n in bfl if n.startswith("single_blocks") and n.endswith("linear2.weight")) > 0
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(dequantized, os.path.join(out, "flux-2-klein-tiny-Q4_K_M-dequantized.safetensors"))


def write_fp8(bfl, out):
    fp8, dequantized = {}, {}
    for name, t in bfl.items():
        if t.ndim == 2:
            values = t.float()
            scale = (values.abs().max() / 448.0).reshape(())
            q = (values / scale).to(torch.float8_e4m3fn)
            fp8[name] = q
            fp8[name[: -len(".weight")] + ".weight_scale"] = scale.clone()
            fp8[name[: -len(".weight")] + ".input_scale"] = torch.tensor(1.0)
            dequantized[name] = q.float() * scale
        else:
            fp8[name] = t
            dequantized[name] = t.float()
    save_file(fp8, os.path.join(out, "flux-2-klein-tiny-fp8.safetensors"))
    save_file(dequantized, os.path.join(out, "flux-2-klein-tiny-fp8-dequantized.safetensors"))


def add_q8_0_tensors(w, tensors):
    """(GGUF name, reference name, tensor): 2-D weights Q8_0 where rows allow it, the rest F32; the
    file is written and closed, and gguf-py's dequantisation returned under the reference names."""
    dequantized = {}
    for gguf_name, name, t in tensors:
        values = t.float().numpy()
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            q = quants.quantize(values, T.Q8_0)
            w.add_tensor(gguf_name, q, raw_dtype=T.Q8_0)
            dequantized[name] = torch.from_numpy(quants.dequantize(q, T.Q8_0).astype(np.float32))
        else:
            w.add_tensor(gguf_name, values)
            dequantized[name] = torch.from_numpy(values.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dequantized


def add_gpt2_vocab(w, tokenizer_dir, vocab_size):
    """The tokenizer metadata llama.cpp's convert_hf_to_gguf writes for a Qwen2/Qwen3 model
    (TextModel.get_vocab_base + _set_vocab_gpt2): one token per embedding row, [PAD{i}] (unused)
    past the tokenizer, added tokens as control tokens when special or when they look special
    (<|...|>), user-defined otherwise, merges and special ids from gguf-py's SpecialVocab."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        tokens.append(token)
        if token in added:
            special = tokenizer.added_tokens_decoder[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # what get_vocab_base_pre's hash names Qwen2's pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True).add_to_gguf(w)


def write_qwen3_gguf(out):
    """klein_tiny_a's text encoder under llama.cpp's names, Q8_0 where the rows allow it."""
    folder = os.path.join(TINY, "text_encoder")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    sd = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(folder, name)))
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, layers)
    w = gguf.GGUFWriter(os.path.join(out, "qwen3-tiny-Q8_0.gguf"), arch="qwen3")
    w.add_file_type(T.Q8_0)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    add_gpt2_vocab(w, os.path.join(TINY, "tokenizer"), cfg["vocab_size"])
    tensors = []
    for hf_name, t in sd.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name, hf_name
        tensors.append((gguf_name, hf_name, t))
    dequantized = add_q8_0_tensors(w, tensors)
    save_file(dequantized, os.path.join(out, "qwen3-tiny-Q8_0-dequantized.safetensors"))


def vae_to_ldm(sd, up_blocks):
    """diffusers' AutoencoderKLFlux2 names -> BFL's ldm names (quant convs nested, as in ae.safetensors)."""
    out = {}
    for k, v in sd.items():
        named = vae_ldm_name(k, up_blocks)
        if named:
            out[named[0]] = (v[:, :, None, None] if named[1] else v).contiguous()
    return out


def check_vae_round_trip(ldm, sd, config):
    back = convert_ldm_vae_checkpoint(dict(ldm), config)
    for k in ("bn.running_mean", "bn.running_var"):  # FLUX.2's latent norm, outside the ldm converter
        back[k] = ldm[k.replace("vae.", "")] if k in ldm else ldm["vae." + k]
    expected = {k: v for k, v in sd.items() if k != "bn.num_batches_tracked"}
    assert sorted(back) == sorted(expected), sorted(set(back) ^ set(expected))
    for k in expected:
        assert torch.equal(back[k], expected[k]), k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = os.path.join(ap.parse_args().out, "klein_single")
    os.makedirs(out, exist_ok=True)
    sd = load_file(os.path.join(FOLDER, "diffusion_pytorch_model.safetensors"))
    bfl = to_bfl(sd)
    check_round_trip(bfl, sd)
    save_file(bfl, os.path.join(out, "flux-2-klein-tiny.safetensors"))

    w = gguf.GGUFWriter(os.path.join(out, "flux-2-klein-tiny-Q8_0.gguf"), arch="flux")
    w.add_file_type(T.Q8_0)
    dequantized = add_q8_0_tensors(w, [(name, name, t) for name, t in bfl.items()])
    save_file(dequantized, os.path.join(out, "flux-2-klein-tiny-Q8_0-dequantized.safetensors"))

    write_k_quant_gguf(bfl, out)
    write_fp8(bfl, out)
    write_qwen3_gguf(out)
    vae = load_file(os.path.join(TINY, "vae", "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(TINY, "vae", "config.json")) as f:
        vae_config = json.load(f)
    ldm = vae_to_ldm(vae, len(vae_config["up_block_types"]))
    comfy = {}  # ComfyUI's rename of BFL's nested quant convs (comfy/sd.py, class VAE)
    for k, v in ldm.items():
        for nested, top in (("encoder.quant_conv.", "quant_conv."), ("decoder.post_quant_conv.", "post_quant_conv.")):
            if k.startswith(nested):
                k = top + k[len(nested):]
        comfy[k] = v
    check_vae_round_trip(comfy, vae, vae_config)
    sd_layout = {"vae." + k: v for k, v in comfy.items()}
    check_vae_round_trip(sd_layout, vae, vae_config)
    save_file(ldm, os.path.join(out, "flux2-vae-tiny.safetensors"))
    save_file(sd_layout, os.path.join(out, "flux2-vae-tiny-sd.safetensors"))


if __name__ == "__main__":
    main()
