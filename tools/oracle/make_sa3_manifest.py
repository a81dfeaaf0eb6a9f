#!/usr/bin/env python3
"""Layout of Stable Audio 3 medium in diffusers' StableAudio3Pipeline folders, for `apus synth`.

Instantiates StableAudio3DiTModel, AutoencoderSAME (SAME-L), StableAudio3DurationEmbedder and
transformers' T5GemmaEncoderModel at full size on the meta device and writes
data/stable-audio-3-medium/: model_index.json, every component's config, the scheduler config
diffusers' converter writes for the distilled models, and manifest.json (each weight file's tensors
in on-disk order). Weights stay fp32, as published.

Sizes: the DiT from the production config in diffusers' own tests (997 tensors in the published
checkpoint); SAME-L from AutoencoderSAME's documented SAME-L arguments (426 M parameters with the
encoder); the T5Gemma encoder from google/t5gemma-b-b-ul2's published sizes (12 layers, width 768,
12 heads of 64, GeGLU 2048, 256000 tokens) with the Gemma-2 attention settings t5gemma uses
(query_pre_attn_scalar 64, softcap 50, sliding window 4096 on alternate layers): check them against
a download with --verify. The tokenizer is NOT Gemma's 256k-piece one: the small fixture
SentencePiece model (tests/fixtures/t5gemma_tok) stands in, copied as is.

The small models cannot be written in this layout: diffusers 0.42.1's AutoencoderSAME has no
SAME-S (chunked attention, a kernel-3 mapping).

Usage: make_sa3_manifest.py [--out DIR]
"""

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_klein_manifest import file_entry, write_json, write_manifest  # noqa: E402
from oracle_env import FIXTURES, REPO  # noqa: E402

MODEL = "stabilityai/stable-audio-3-medium"

DIT = dict(io_channels=256, patch_size=1, embed_dim=1536, depth=24, num_heads=24, cond_token_dim=768,
           global_cond_dim=768, local_add_cond_dim=257, timestep_features_dim=256, ff_mult=4.0,
           num_memory_tokens=64, use_differential_attention=True)
SAME_L = dict(audio_channels=2, patch_size=256, encoder_channels=256, encoder_c_mults=[6], encoder_strides=[16],
              encoder_transformer_depths=[12], latent_dim=256, use_differential_attention=True, dim_heads=64,
              ff_mult=3, sliding_window=1, encoder_sinusoidal_blocks=[0], decoder_sinusoidal_blocks=[8],
              sampling_rate=44100)
DURATION = dict(output_dim=768, fourier_dim=256)
T5GEMMA_B = dict(vocab_size=256000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                 hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, rms_norm_eps=1e-6,
                 query_pre_attn_scalar=64, sliding_window=4096,
                 layer_types=["sliding_attention", "full_attention"] * 6, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 pad_token_id=0, eos_token_id=1, bos_token_id=2)
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1, "shift": 1.0,
             "stochastic_sampling": True, "use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15,
             "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": False,
             "shift_terminal": None, "use_karras_sigmas": False, "use_exponential_sigmas": False,
             "use_beta_sigmas": False, "time_shift_type": "exponential"}


def meta_models():
    import torch
    from diffusers import AutoencoderSAME, StableAudio3DiTModel
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder
    from transformers import T5GemmaConfig, T5GemmaEncoderModel

    with torch.device("meta"):
        dit = StableAudio3DiTModel(**DIT)
        vae = AutoencoderSAME(**SAME_L)
        duration = StableAudio3DurationEmbedder(**DURATION)
        t5 = T5GemmaEncoderModel(T5GemmaConfig(encoder=T5GEMMA_B, decoder=T5GEMMA_B, is_encoder_decoder=False,
                                               vocab_size=T5GEMMA_B["vocab_size"]))
    return {"transformer": dit, "vae": vae, "duration_embedder": duration, "text_encoder": t5}


def build(out):
    import diffusers

    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    models = meta_models()
    for name in ("transformer", "vae", "duration_embedder"):
        models[name].save_config(os.path.join(out, name))
    t5 = models["text_encoder"]
    t5.config.architectures = [type(t5).__name__]
    t5.config.save_pretrained(os.path.join(out, "text_encoder"))
    index = {"_class_name": "StableAudio3Pipeline", "_diffusers_version": diffusers.__version__,
             "duration_embedder": ["diffusers", "StableAudio3DurationEmbedder"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "T5GemmaEncoderModel"], "tokenizer": ["transformers", "GemmaTokenizer"],
             "transformer": ["diffusers", "StableAudio3DiTModel"], "vae": ["diffusers", "AutoencoderSAME"]}
    write_json(index, os.path.join(out, "model_index.json"))
    os.makedirs(os.path.join(out, "scheduler"))
    write_json({**SCHEDULER, "_diffusers_version": diffusers.__version__},
               os.path.join(out, "scheduler", "scheduler_config.json"))
    shutil.copytree(os.path.join(FIXTURES, "t5gemma_tok"), os.path.join(out, "tokenizer"))
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8", newline="\n") as f:
        f.write(__doc__.split("Usage:")[0])
    files = [file_entry(f"{name}/diffusion_pytorch_model.safetensors", models[name].state_dict())
             for name in ("transformer", "vae", "duration_embedder")]
    files.append(file_entry("text_encoder/model.safetensors", t5.state_dict()))
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    write_manifest(files, params, os.path.join(out, "manifest.json"), MODEL, "tools/oracle/make_sa3_manifest.py")
    print("parameters", params)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "data", "stable-audio-3-medium"))
    build(ap.parse_args().out)


if __name__ == "__main__":
    main()
