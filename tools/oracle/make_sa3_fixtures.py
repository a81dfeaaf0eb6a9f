"""Tiny random-weight Stable Audio 3 stage fixtures with diffusers' own classes.

So far the duration conditioner: a small StableAudio3DurationEmbedder (expo-Fourier features,
then a linear layer) saved in the diffusers layout, run on durations that cover the clamp, in fp32
and in bf16. diffusers' from_pretrained(torch_dtype=bf16) also casts the `freqs` buffer to bf16,
which moves the high-frequency angles by radians (its bf16 output is 0.8 relative L2 from fp32);
the official code keeps the Fourier features in fp32, so the bf16 reference here is the bf16
model with its fp32 freqs restored (diffusers' own bf16 output is kept for the record). Writes
tests/fixtures/sa3_tiny/ and sa3_tiny_ref.safetensors. Deterministic.
"""

import argparse
import os

import oracle_env  # noqa: F401  (environment before torch/diffusers load)
import torch
from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder
from safetensors.torch import save_file

DURATIONS = [0.0, 7.5, 30.0, 47.25, 383.9, 500.0]


def write_config_keys(out):
    """The settings each official class of StableAudio3Pipeline takes (__init__'s parameters; the
    text encoder's T5GemmaConfig and, under "encoder.", its T5GemmaModuleConfig), for the test that
    holds every one to being honoured or refused. Writes sa3_config_keys.json."""
    import inspect
    import json

    from diffusers import (AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DiTModel,
                           StableAudio3Pipeline)
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaConfig, T5GemmaModuleConfig

    def keys(cls):
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]

    listing = {"transformer": keys(StableAudio3DiTModel), "vae": keys(AutoencoderSAME),
               "duration_embedder": keys(StableAudio3DurationEmbedder),
               "scheduler": keys(FlowMatchEulerDiscreteScheduler),
               "text_encoder": keys(T5GemmaConfig) + ["encoder." + k for k in keys(T5GemmaModuleConfig)],
               "pipeline": keys(StableAudio3Pipeline)}
    with open(os.path.join(out, "sa3_config_keys.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(listing, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=oracle_env.FIXTURES)
    ap.add_argument("--only-config-keys", action="store_true", help="write sa3_config_keys.json only")
    args = ap.parse_args()
    write_config_keys(args.out)
    if args.only_config_keys:
        return
    torch.manual_seed(0)
    model = StableAudio3DurationEmbedder(output_dim=32, fourier_dim=16).eval()
    with torch.no_grad():
        model.linear.weight.normal_(0.0, 0.5)
        model.linear.bias.normal_(0.0, 0.5)
    out_dir = os.path.join(args.out, "sa3_tiny", "duration_embedder")
    oracle_env.save_pretrained_readable(model, out_dir)
    seconds = torch.tensor(DURATIONS, dtype=torch.float32)
    ref = {"seconds": seconds}
    with torch.no_grad():
        ref["fp32.duration_embeds"] = model(seconds).float().contiguous()
        bf16 = StableAudio3DurationEmbedder.from_pretrained(out_dir, torch_dtype=torch.bfloat16).eval()
        ref["diffusers_bf16.duration_embeds"] = bf16(seconds).float().contiguous()
        bf16.register_buffer("freqs", model.freqs.detach().clone().float())
        ref["bf16.duration_embeds"] = bf16(seconds).float().contiguous()
    save_file(ref, os.path.join(args.out, "sa3_tiny_ref.safetensors"))
    d = (ref["bf16.duration_embeds"] - ref["fp32.duration_embeds"]).norm() / ref["fp32.duration_embeds"].norm()
    dd = (ref["diffusers_bf16.duration_embeds"] - ref["fp32.duration_embeds"]).norm() / ref[
        "fp32.duration_embeds"].norm()
    print(f"sa3 tiny: duration embedder bf16 (fp32 freqs) vs fp32 rel L2 {d:.3e}; "
          f"diffusers' bf16 (bf16 freqs) {dd:.3e}")


if __name__ == "__main__":
    main()
