#!/usr/bin/env python3
"""diffusers' own pipelines timed on the lent GPU beside apus (issue 38): Flux2KleinPipeline at
1024x1024, 4 steps, and StableAudio3Pipeline for a 120 s clip, bf16, random weights made on the
device from the published configs under data/ (timing does not depend on the values), warm, p50 of
--reps calls. Prints one JSON line per pipeline; a pipeline that cannot be built or run is reported
and the next one still runs.

    python3 tools/diffusers_bench.py [--reps 5] [--only klein|sa3]
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
PROMPT = "a lighthouse on a cliff at dawn, waves below, photograph"


def timed(call, reps):
    call()  # warm: kernels chosen, allocator filled
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def on_device():
    torch.set_default_device("cuda")
    torch.set_default_dtype(torch.bfloat16)


def klein(reps):
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    root = os.path.join(DATA, "flux2-klein-4b")
    on_device()
    transformer = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(os.path.join(root, "transformer")))
    vae = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(os.path.join(root, "vae")))
    text_encoder = Qwen3ForCausalLM(Qwen3Config.from_pretrained(os.path.join(root, "text_encoder")))
    torch.set_default_device("cpu")
    torch.set_default_dtype(torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        FlowMatchEulerDiscreteScheduler.load_config(os.path.join(root, "scheduler")))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "tokenizer"))
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae.to("cuda", torch.bfloat16),
                              text_encoder=text_encoder.to("cuda", torch.bfloat16), tokenizer=tokenizer,
                              transformer=transformer.to("cuda", torch.bfloat16), is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cuda")

    def run():
        pipe(prompt=PROMPT, height=1024, width=1024, num_inference_steps=4, generator=gen.manual_seed(42),
             output_type="pt")

    return {"pipeline": "Flux2KleinPipeline", "what": "1024x1024, 4 steps, bf16, text encoder and VAE included",
            "params_transformer": sum(p.numel() for p in transformer.parameters()),
            "times_s": timed(run, reps)}


def sa3(reps):
    from diffusers import (AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DiTModel,
                           StableAudio3Pipeline)
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder
    from transformers import AutoTokenizer, T5GemmaConfig, T5GemmaEncoderModel

    root = os.path.join(DATA, "stable-audio-3-medium")
    on_device()
    # diffusers' defaults are its converter's medium model: printed so the note can say what ran.
    transformer = StableAudio3DiTModel()
    vae = AutoencoderSAME()
    duration = StableAudio3DurationEmbedder()
    cfg = T5GemmaConfig.from_pretrained(os.path.join(root, "t5gemma-b-b-ul2"))
    text_encoder = T5GemmaEncoderModel(cfg)
    torch.set_default_device("cpu")
    torch.set_default_dtype(torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "t5gemma-b-b-ul2"))
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FlowMatchEulerDiscreteScheduler.load_config(
        os.path.join(os.path.dirname(DATA), "tests", "fixtures", "sa3_tiny", "pipeline", "scheduler")))  # the distilled one
    pipe = StableAudio3Pipeline(transformer=transformer.to("cuda", torch.bfloat16), vae=vae.to("cuda", torch.bfloat16),
                                duration_embedder=duration.to("cuda", torch.bfloat16),
                                text_encoder=text_encoder.to("cuda", torch.bfloat16), tokenizer=tokenizer,
                                scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    gen = torch.Generator("cuda")

    def run():
        pipe(prompt="rain on a tin roof", duration=120.0, num_inference_steps=8, generator=gen.manual_seed(42), output_type="pt")

    return {"pipeline": "StableAudio3Pipeline", "what": "120 s, 8 steps (the distilled schedule), bf16, text encoder and decoder included",
            "transformer_config": dict(transformer.config), "vae_config": dict(vae.config),
            "params_transformer": sum(p.numel() for p in transformer.parameters()),
            "params_vae": sum(p.numel() for p in vae.parameters()),
            "times_s": timed(run, reps)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=["klein", "sa3"])
    a = ap.parse_args()
    print("torch", torch.__version__, torch.cuda.get_device_name(0), flush=True)
    for name, fn in (("klein", klein), ("sa3", sa3)):
        if a.only and a.only != name:
            continue
        try:
            r = fn(a.reps)
            r["p50_s"] = statistics.median(r["times_s"])
            print(json.dumps(r, default=str), flush=True)
        except Exception:
            print(json.dumps({"pipeline": name, "error": traceback.format_exc()[-2000:]}), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
