#!/usr/bin/env python3
"""Layouts of the published Stable Audio 3 checkpoints for `apus synth`, from the official classes.

stabilityai/stable-audio-3-medium, -small-music and -small-sfx ship model_config.json,
model.safetensors (the DiT under model.model., SAME under pretransform.model., the conditioners
under conditioner.) and the t5gemma-b-b-ul2/ folder. This builds each model_config.json with the
official factory's key set, instantiates the official DiffusionTransformer and autoencoder on the
meta device, and writes data/<name>/: model_config.json, t5gemma-b-b-ul2/config.json and the
tokenizer stand-in, and manifest.json (each weight file's tensors in on-disk order). fp32, as
published.

The published model_config.json files are gated; the values here are the ones the public record
gives (the official code's comments and defaults, diffusers' converter and tests, the official
MLX port's constants, third-party ports that read the real files). Assumed where only third-party
notes say so: the decoders' inference noise (SAME-L mask_noise 0.1, SAME-S 0.01, noise_regularize
on) and chunked decoding on (the official docs say it is on for every model). Check a download
with `apus roofline` / `apus audio` errors, which name any key that differs in kind.

The T5Gemma encoder is google/t5gemma-b-b-ul2's published size (12 layers, width 768, 12 heads of
64, GeGLU 2048, 256000 tokens, the Gemma-2 attention t5gemma uses). The tokenizer is NOT Gemma's
256k-piece one: the small fixture SentencePiece model (tests/fixtures/t5gemma_tok) stands in.

Usage: make_sa3_manifest.py [--data DIR]
"""

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_klein_manifest import file_entry, write_json, write_manifest  # noqa: E402
from oracle_env import FIXTURES, REPO  # noqa: E402

T5GEMMA_B = dict(vocab_size=256000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                 hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                 query_pre_attn_scalar=64, sliding_window=4096,
                 layer_types=["sliding_attention", "full_attention"] * 6, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 pad_token_id=0, eos_token_id=1, bos_token_id=2)

# The DiTs (diffusers' production test config for medium; 433 M parameters for the small ones).
DIT_COMMON = dict(io_channels=256, cond_token_dim=768, global_cond_dim=768, local_add_cond_dim=257,
                  global_cond_type="adaLN", timestep_features_type="expo", norm_type="rms_norm",
                  norm_kwargs={"force_fp32": True}, ff_kwargs={"mult": 4.0}, num_memory_tokens=64)
MEDIUM_DIT = dict(DIT_COMMON, embed_dim=1536, depth=24, num_heads=24, attn_kwargs={"qk_norm": "rms", "differential": True})
SMALL_DIT = dict(DIT_COMMON, embed_dim=1024, depth=20, num_heads=16, timestep_features_logsnr=False,
                 attn_kwargs={"qk_norm": "rms", "differential": False})

# SAME-L (426 M with its encoder side) and SAME-S, as the MLX port's constants and diffusers'
# documented arguments give them.
SAME_L_DECODER = dict(out_channels=512, channels=256, c_mults=[6], strides=[16], latent_dim=256,
                      transformer_depths=[12], sinusoidal_blocks=[8], sliding_window=[1, 1], dim_heads=64,
                      differential=True, dyt=True, variable_stride=True, mask_noise=0.1)
SAME_L_ENCODER = dict(in_channels=512, channels=256, c_mults=[6], strides=[16], latent_dim=256,
                      transformer_depths=[12], sliding_window=[1, 1], dim_heads=64, differential=True,
                      variable_stride=True)
SAME_S_DECODER = dict(out_channels=512, channels=128, c_mults=[6], strides=[16], latent_dim=256,
                      transformer_depths=[6], dim_heads=64, differential=True, dyt=True, variable_stride=True,
                      chunk_size=32, chunk_midpoint_shift=True, conv_mapping=True, mask_noise=0.01)
SAME_S_ENCODER = dict(in_channels=512, channels=128, c_mults=[6], strides=[16], latent_dim=256,
                      transformer_depths=[6], dim_heads=64, differential=True, variable_stride=True,
                      chunk_size=32, chunk_midpoint_shift=True)

MODELS = {
    "stable-audio-3-medium": ("stabilityai/stable-audio-3-medium", MEDIUM_DIT, SAME_L_DECODER, SAME_L_ENCODER, 16777216),
    "stable-audio-3-small-music": ("stabilityai/stable-audio-3-small-music", SMALL_DIT, SAME_S_DECODER, SAME_S_ENCODER, 5324800),
    "stable-audio-3-small-sfx": ("stabilityai/stable-audio-3-small-sfx", SMALL_DIT, SAME_S_DECODER, SAME_S_ENCODER, 5324800),
}


def model_config(dit, decoder, encoder, sample_size):
    return {
        "model_type": "diffusion_cond", "sample_size": sample_size, "sample_rate": 44100, "audio_channels": 2,
        "model": {
            "io_channels": 256,
            "pretransform": {"type": "autoencoder", "chunked": True, "iterate_batch": False, "config": {
                "encoder": {"type": "same", "config": encoder}, "decoder": {"type": "same", "config": decoder},
                "bottleneck": {"type": "soft_norm", "config": {"dim": 256, "noise_regularize": True,
                                                               "auto_scale": True, "freeze": True}},
                "pretransform": {"type": "patched", "config": {"channels": 2, "patch_size": 256}},
                "latent_dim": 256, "downsampling_ratio": 4096, "io_channels": 2}},
            "conditioning": {"cond_dim": 768, "configs": [
                {"id": "prompt", "type": "t5gemma", "config": {"model_name": "google/t5gemma-b-b-ul2", "max_length": 256,
                                                               "padding_mode": "learned", "subfolder": "t5gemma-b-b-ul2"}},
                {"id": "seconds_total", "type": "number", "config": {"min_val": 0, "max_val": 384,
                                                                     "fourier_features_type": "expo"}}]},
            "diffusion": {"type": "dit", "diffusion_objective": "rf_denoiser",
                          "cross_attention_cond_ids": ["prompt", "seconds_total"], "global_cond_ids": ["seconds_total"],
                          "local_add_cond_ids": ["inpaint_mask", "inpaint_masked_input"], "config": dit}}}


def checkpoint_state(config):
    """model.safetensors' tensors, from the official classes on the meta device."""
    import torch
    from stable_audio_3.factory import create_autoencoder_from_config
    from stable_audio_3.models.diffusion import DiTWrapper

    diffusion = config["model"]["diffusion"]
    with torch.device("meta"):
        dit = DiTWrapper(diffusion_objective=diffusion["diffusion_objective"], **diffusion["config"])
        autoencoder = create_autoencoder_from_config(config["model"], config["sample_rate"])
        cond_dim = config["model"]["conditioning"]["cond_dim"]
        padding = torch.empty(cond_dim)
        linear_w, linear_b = torch.empty(cond_dim, 256), torch.empty(cond_dim)
    state = {"model." + k: v for k, v in dit.state_dict().items()}
    state.update({"pretransform.model." + k: v for k, v in autoencoder.state_dict().items()})
    state["conditioner.conditioners.prompt.padding_embedding"] = padding
    state["conditioner.conditioners.seconds_total.embedder.embedding.1.weight"] = linear_w
    state["conditioner.conditioners.seconds_total.embedder.embedding.1.bias"] = linear_b
    return state


def build(name, out):
    import torch
    from transformers import T5GemmaConfig, T5GemmaEncoderModel

    repo, dit, decoder, encoder, sample_size = MODELS[name]
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "t5gemma-b-b-ul2"))
    config = model_config(dit, decoder, encoder, sample_size)
    write_json(config, os.path.join(out, "model_config.json"))
    with torch.device("meta"):
        t5 = T5GemmaEncoderModel(T5GemmaConfig(encoder=T5GEMMA_B, decoder=T5GEMMA_B, is_encoder_decoder=False,
                                               vocab_size=T5GEMMA_B["vocab_size"]))
    t5.config.architectures = [type(t5).__name__]
    t5.config.save_pretrained(os.path.join(out, "t5gemma-b-b-ul2"))
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURES, "t5gemma_tok", f), os.path.join(out, "t5gemma-b-b-ul2", f))
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(f"Layout of {repo} for `apus synth`.\n\n" + __doc__.split("Usage:")[0])
    state = checkpoint_state(config)
    files = [file_entry("model.safetensors", state), file_entry("t5gemma-b-b-ul2/model.safetensors", t5.state_dict())]
    params = {"model.safetensors": sum(v.numel() for v in state.values()),
              "t5gemma-b-b-ul2/model.safetensors": sum(p.numel() for p in t5.parameters())}
    write_manifest(files, params, os.path.join(out, "manifest.json"), repo, "tools/oracle/make_sa3_manifest.py")
    print(name, "parameters", params)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(REPO, "data"))
    args = ap.parse_args()
    official = os.environ.get("APUS_SA3_OFFICIAL")
    if not official:
        sys.exit("make_sa3_manifest: set APUS_SA3_OFFICIAL to a checkout of Stability-AI/stable-audio-3")
    sys.path.insert(0, official)
    for name in MODELS:
        build(name, os.path.join(args.data, name))


if __name__ == "__main__":
    main()
