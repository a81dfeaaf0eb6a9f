"""Tiny random-weight Stable Audio 3 fixtures from the official code, saved in diffusers' layout:
the DiT (below) and the SAME-L decoder (same_fixtures).

The official Stability-AI/stable-audio-3 code decides what the DiT computes (the notes list where
diffusers 0.42.1 differs: block RMSNorm eps 1e-5 against 1e-6, the local-conditioning branch the
official generate always runs). It is not on PyPI: point APUS_SA3_OFFICIAL at a checkout of the
public repository (commit 636f906 was used); nothing of it is committed, only what it computes.

Two variants with the shipped models' structure at toy width (head_dim 64 as every shipped model):
dit_diff (the medium DiT: differential attention) and dit_plain (the small DiTs). Each is built
with the official DiffusionTransformer and the constructor arguments the shipped model_config.json
files give, every parameter drawn at random (the official init zeroes several branches), converted
to diffusers' layout (fused QKV rows [q|k|v|q2|k2] -> [q|q2|k|k2|v]) and saved with
StableAudio3DiTModel.save_pretrained, so the test reads the layout users download. The same
weights run through diffusers' class too, as a check of the conversion (its output differs from
the official one only by the eps and local-conditioning points).

Inputs: a batch of two with one timestep, 12 latent frames, 9 context tokens of which the last
two text positions are padding (replaced by the learned padding embedding before the DiT, as the
official conditioner does), and the local conditioning both as the official text-to-audio call
passes it (zeros) and as inpainting does (mask + masked latents). Outputs in fp32 and from the
official model cast to bf16 (model.to(bfloat16), the CPU counterpart of its model_half). That cast
also rounds the timestep before its Fourier features (t = 0.7455 becomes 0.7461, which turns the
10 kHz feature by ~30 radians) and the RoPE inverse frequencies; apus keeps both fp32, so the bf16
reference its tests hold it to is the cast model with those two restored to fp32 (`bf16.*`); the
plain cast's output is kept for the record (`official_bf16.*`).

The fp32 output is ill-conditioned in one place: the timestep's 10 kHz Fourier feature turns by
~5e4 radians, so one ulp of torch's own exp or cos moves it visibly (torch's vectorised exp is not
correctly rounded). `fp32_exact_features.*` is the official fp32 model with those features formed
from correctly rounded exp, cos and sin (libm in double, rounded once): what apus computes, and the
measure of how much the official code disagrees with itself there. Deterministic.
"""

import copy
import json
import math
import os
import shutil

import oracle_env  # noqa: F401  (environment before torch/diffusers load)
import torch
from diffusers import StableAudio3DiTModel
from safetensors.torch import save_file

B, T, CTX, IO, COND = 2, 12, 9, 16, 128
TIMESTEP = 0.745547


def official_dit(differential):
    from stable_audio_3.models.dit import DiffusionTransformer

    return DiffusionTransformer(
        io_channels=IO, embed_dim=128, depth=2, num_heads=2, cond_token_dim=COND, global_cond_dim=COND,
        local_add_cond_dim=IO + 1, global_cond_type="adaLN", timestep_features_type="expo",
        diffusion_objective="rf_denoiser",
        attn_kwargs={"qk_norm": "rms", "differential": differential},
        norm_type="rms_norm", norm_kwargs={"force_fp32": True}, ff_kwargs={"mult": 4.0},
        num_memory_tokens=4).eval()


def randomize(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2 and "memory_tokens" not in name:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def to_diffusers(state, differential, dim):
    out = {}
    for key, value in state.items():
        k = key.replace("transformer.layers.", "transformer_blocks.")
        k = k.replace("ff.ff.0.proj.", "ff.proj_in.").replace("ff.ff.2.", "ff.proj_out.")
        for name in ("project_in", "project_out"):
            k = k.replace(f"transformer.{name}.", f"proj_{name[8:]}.")
        for name in ("memory_tokens", "rotary_pos_emb.", "global_cond_embedder."):
            if k.startswith("transformer." + name):
                k = k[len("transformer."):]
        if differential and k.endswith("self_attn.to_qkv.weight"):
            q, kk, v, q2, k2 = value.split(dim, dim=0)
            value = torch.cat([q, q2, kk, k2, v], dim=0)
        out[k] = value.contiguous()
    return out


class Fp32TimestepFeatures(torch.nn.Module):
    """The official ExpoFourierFeatures fed the fp32 timestep instead of the one cast to bf16."""

    def __init__(self, features, t):
        super().__init__()
        self.features, self.t = features, t

    def forward(self, rounded_t):
        return self.features(self.t[:, None]).to(rounded_t.dtype)


def correctly_rounded_features(self, t):
    """ExpoFourierFeatures.forward with each transcendental correctly rounded to fp32."""
    half = self.dim // 2
    ramp = torch.linspace(0, 1, half, device=t.device, dtype=torch.float32)
    arg = (ramp * (math.log(self.max_freq) - math.log(self.min_freq)) + math.log(self.min_freq))
    freqs = torch.exp(arg.double()).float()
    args = t.float().reshape(-1, 1) * freqs * 2 * math.pi
    return torch.cat([torch.cos(args.double()).float(), torch.sin(args.double()).float()], dim=-1)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


SAME_PATCH, SAME_LATENT, SAME_T = 8, 16, 40
NOISE_SEED = 5
# SAME-S at toy width: attention within 34-token chunks (chunk_size 32 latents' worth), the second
# half of blocks on chunks shifted by 17, a kernel-3 mapping, SiLU FFs.
SAME_S_DECODER = dict(out_channels=2 * 8, channels=32, c_mults=[4], strides=[16], latent_dim=16,
                      transformer_depths=[4], sinusoidal_blocks=[0], dim_heads=64, differential=True, dyt=True,
                      variable_stride=True, chunk_size=32, chunk_midpoint_shift=True, conv_mapping=True,
                      mask_noise=0.0)
# The tiny pipeline's sample rate: with 128 samples per latent, 44.1 kHz and the official 6 s of
# headroom would make a 2000-latent canvas; at 2048 Hz a 1.5 s request takes 120 latents.
SAME_S_ENCODER = dict(in_channels=2 * 8, channels=32, latent_dim=16, c_mults=[4], strides=[16], transformer_depths=[2],
                      dim_heads=64, differential=True, variable_stride=True, chunk_size=32, chunk_midpoint_shift=True,
                      conv_mapping=True)
PIPELINE_RATE = 2048
# diffusers renames inside each transformer block of the decoder (its converter's rules)
SAME_RENAMES = [("pre_norm.", "norm_attn."), ("self_attn.to_qkv.", "attn.to_qkv."),
                ("self_attn.to_out.", "attn.to_out."), ("self_attn.q_norm.", "attn.q_norm."),
                ("self_attn.k_norm.", "attn.k_norm."), ("ff_norm.", "norm_ff."),
                ("ff.ff.0.proj.", "ff.proj_in."), ("ff.ff.2.", "ff.proj_out.")]


def same_side_to_diffusers(state, side, block, proj):
    """One side of the official SAME (its resampling block at layers.`block`, its projection at
    layers.`proj`) under diffusers' AutoencoderSAME names."""
    out = {}
    for k, v in state.items():
        if k.startswith(f"layers.{proj}."):
            out[f"{side}.proj." + k.split(".")[-1]] = v
        elif k.startswith(f"layers.{block}."):
            local = k[len(f"layers.{block}."):]
            if local.startswith("transformers."):
                if local.endswith("rope.inv_freq"):
                    continue  # diffusers computes it (non-persistent)
                for a, b in SAME_RENAMES:
                    if a in local:
                        local = local.replace(a, b, 1)
                        break
                if local.endswith("attn.to_qkv.weight"):
                    q, kk, vv, q2, k2 = v.chunk(5, 0)
                    v = torch.cat([q, q2, kk, k2, vv], 0)
            out[f"{side}.blocks.0." + local] = v
    return out


def randomize_encoder(module, gen, running_std=None):
    """Every parameter of a SAME encoder drawn at random around what training leaves (DyT alphas in
    [0.5, 1.5], gains near 1, weights ~ 1/sqrt(fan-in); the official init zeroes several), its
    attention projections x3: at 1x the two softmaxes of the differential attention stay near
    uniform and cancel, and the summary tokens barely depend on the audio (5 % apart for two
    different clips; 41 % at 3x), which a test of the encoder's input path could not see."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith("running_std"):
                p.fill_(running_std)
            elif p.dim() >= 2 and not name.endswith("new_tokens"):
                gain = 3.0 if "to_qkv" in name else 1.0
                p.copy_(gain * torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            else:
                gain = name.endswith(("gamma", "scaling_factor", "weight_g"))
                p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if gain else 0.0))


def same_to_diffusers(decoder_state, bottleneck_state, encoder_state):
    out = same_side_to_diffusers(decoder_state, "decoder", 3, 1)
    out.update(same_side_to_diffusers(encoder_state, "encoder", 0, 2))
    for k, v in bottleneck_state.items():
        if k == "noise_scaling_factor":
            continue
        out["bottleneck." + {"scaling_factor": "scale"}.get(k, k)] = v
    return out


def same_fixtures(out_dir):
    """A SAME-L-shaped decoder (band attention, DyT, sin-FF in the last blocks, weight-normed
    mapping) at toy width, decoding a batch of two 40-latent sequences whole. The official decode's
    inference noise (bottleneck noise_regularize, the placeholders' mask_noise) is off: diffusers'
    class has neither and apus does not draw it yet."""
    import stable_audio_3.models.transformer as official_transformer
    from diffusers import AutoencoderSAME
    from stable_audio_3.models.autoencoders import SAMEDecoder
    from stable_audio_3.models.bottleneck import SoftNormBottleneck
    from stable_audio_3.models.pretransforms import PatchedPretransform

    # CPU: the exact chunked-halo SDPA band path instead of torch.compile'd flex attention
    official_transformer.flex_attention_available = False
    official_transformer.flex_attention_compiled = None
    cfg = dict(out_channels=2 * SAME_PATCH, channels=32, c_mults=[4], strides=[16], latent_dim=SAME_LATENT,
               transformer_depths=[4], sinusoidal_blocks=[3], sliding_window=[1, 1], dim_heads=64,
               differential=True, dyt=True, variable_stride=True, conv_mapping=False, mask_noise=0.0)
    gen = torch.Generator().manual_seed(11)
    decoder = SAMEDecoder(**cfg).eval()
    bottleneck = SoftNormBottleneck(dim=SAME_LATENT, noise_regularize=False, auto_scale=True).eval()
    patch = PatchedPretransform(channels=2, patch_size=SAME_PATCH)
    with torch.no_grad():
        for name, p in list(decoder.named_parameters()) + list(bottleneck.named_parameters()):
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith("running_std"):
                p.fill_(1.7)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if name.endswith("gamma") else 0.0))
    diffusers_cfg = dict(audio_channels=2, patch_size=SAME_PATCH, encoder_channels=32, encoder_c_mults=[4],
                         encoder_strides=[16], encoder_transformer_depths=[4], latent_dim=SAME_LATENT,
                         use_differential_attention=True, dim_heads=64, ff_mult=3, sliding_window=1,
                         encoder_sinusoidal_blocks=[0], decoder_sinusoidal_blocks=[3],
                         sampling_rate=PIPELINE_RATE)
    # The encoder as diffusers' class holds it: the decoder's depth, no sinusoidal blocks.
    from stable_audio_3.models.autoencoders import AudioAutoencoder, SAMEEncoder
    encoder = SAMEEncoder(in_channels=2 * SAME_PATCH, channels=32, latent_dim=SAME_LATENT, c_mults=[4], strides=[16],
                          transformer_depths=[4], sliding_window=[1, 1], dim_heads=64, variable_stride=True).eval()
    randomize_encoder(encoder, gen)
    with torch.no_grad():
        bottleneck.scaling_factor.copy_(1.0 + 0.2 * torch.randn(bottleneck.scaling_factor.shape, generator=gen))
        bottleneck.bias.copy_(0.2 * torch.randn(bottleneck.bias.shape, generator=gen))
    torch.manual_seed(12)
    model = AutoencoderSAME(**diffusers_cfg).eval()
    model.load_state_dict(same_to_diffusers(decoder.state_dict(), bottleneck.state_dict(), encoder.state_dict()),
                          strict=True)
    oracle_env.save_pretrained_readable(model, os.path.join(out_dir, "sa3_tiny", "same_l"))

    def official_decode(dec, bott, z):
        with torch.no_grad():
            return patch.decode(dec(bott.decode(z)))

    z = torch.randn(2, SAME_LATENT, SAME_T, generator=gen)
    ref = {"latents": z}
    f32 = official_decode(decoder, bottleneck, z)
    ref["fp32.audio"] = f32.contiguous()
    cast_dec, cast_bott = copy.deepcopy(decoder).to(torch.bfloat16), copy.deepcopy(bottleneck).to(torch.bfloat16)
    c16 = official_decode(cast_dec, cast_bott, z.to(torch.bfloat16)).float()
    ref["official_bf16.audio"] = c16.contiguous()
    # apus keeps RoPE frequencies fp32 (the cast rounds each block's inv_freq buffer)
    for block, original in zip(cast_dec.layers[3].transformers, decoder.layers[3].transformers):
        block.rope.inv_freq = original.rope.inv_freq.clone()
    b16 = official_decode(cast_dec, cast_bott, z.to(torch.bfloat16)).float()
    ref["bf16.audio"] = b16.contiguous()
    with torch.no_grad():
        dm = model.decode(z).sample
    # The encoder: two clips of SAME_T latents' length, official fp32, bf16 with fp32 RoPE
    # frequencies, and the plain cast.
    clip = 0.5 * torch.randn(2, 2, SAME_T * SAME_PATCH * 16, generator=gen)
    ref["encode.audio"] = clip

    def official_encode(enc, bott, audio):
        with torch.no_grad():
            return bott.encode(enc(patch.encode(audio)))

    ref["encode.fp32.latents"] = official_encode(encoder, bottleneck, clip).contiguous()
    cast_enc, cast_bott_enc = copy.deepcopy(encoder).to(torch.bfloat16), copy.deepcopy(bottleneck).to(torch.bfloat16)
    ref["encode.official_bf16.latents"] = official_encode(cast_enc, cast_bott_enc, clip.to(torch.bfloat16)).float().contiguous()
    for block, original in zip(cast_enc.layers[0].transformers, encoder.layers[0].transformers):
        block.rope.inv_freq = original.rope.inv_freq.clone()
    ref["encode.bf16.latents"] = official_encode(cast_enc, cast_bott_enc, clip.to(torch.bfloat16)).float().contiguous()
    with torch.no_grad():
        de = model.encode(clip).latents
    print(f"sa3 same_l encode: bf16 (fp32 RoPE frequencies) vs fp32 rel L2 "
          f"{rel(ref['encode.bf16.latents'], ref['encode.fp32.latents']):.3e}, plain cast "
          f"{rel(ref['encode.official_bf16.latents'], ref['encode.fp32.latents']):.3e}; diffusers fp32 vs official "
          f"{rel(de, ref['encode.fp32.latents']):.3e}")
    # The official decode as the published configs run it: inference noise on (the bottleneck's
    # noise_regularize, the placeholders' mask_noise 0.1) and chunked (128 latents, overlap 32) over
    # 300 latents, the noise drawn from the global generator seeded here, chunk after chunk.
    noisy_decoder = copy.deepcopy(decoder)
    for m in noisy_decoder.modules():
        if hasattr(m, "mask_noise"):
            m.mask_noise = 0.1
    noisy_bottleneck = copy.deepcopy(bottleneck)
    noisy_bottleneck.noise_regularize = True
    ae = AudioAutoencoder(encoder, noisy_decoder, latent_dim=SAME_LATENT, downsampling_ratio=SAME_PATCH * 16,
                          sample_rate=PIPELINE_RATE, io_channels=2, bottleneck=noisy_bottleneck, pretransform=patch).eval()
    long_z = torch.randn(1, SAME_LATENT, 300, generator=gen)
    ref["long.latents"] = long_z
    with torch.no_grad():
        for name, chunked in (("noise_chunked", True), ("noise_whole", False)):
            torch.manual_seed(NOISE_SEED)
            ref[f"long.{name}.audio"] = ae.decode_audio(long_z, chunked=chunked).contiguous()
        plain = AudioAutoencoder(encoder, decoder, latent_dim=SAME_LATENT, downsampling_ratio=SAME_PATCH * 16,
                                 sample_rate=PIPELINE_RATE, io_channels=2, bottleneck=bottleneck, pretransform=patch).eval()
        ref["long.chunked.audio"] = plain.decode_audio(long_z, chunked=True).contiguous()
        whole = plain.decode_audio(long_z, chunked=False)
    print(f"sa3 same_l 300 latents: chunked vs whole decode (no noise) rel L2 "
          f"{rel(ref['long.chunked.audio'], whole):.3e}; with noise, chunked vs whole "
          f"{rel(ref['long.noise_chunked.audio'], ref['long.noise_whole.audio']):.3e}")
    save_file(ref, os.path.join(out_dir, "sa3_same_ref.safetensors"))
    same = (decoder, bottleneck, patch, cast_dec, cast_bott)
    print(f"sa3 same_l: bf16 (fp32 RoPE frequencies) vs fp32 rel L2 {rel(b16, f32):.3e}, plain bf16 cast "
          f"{rel(c16, f32):.3e}; diffusers fp32 vs official fp32 {rel(dm, f32):.3e}")
    return same


PIPELINE_PADDING = []
BASE_REFS = {}  # the -base objective's guided clips, filled by original_layout_fixture  # dit_diff's learned padding embedding (the conditioner's, in diffusers' DiT)
PIPELINE = {"prompt": "warm lo-fi hip hop, vinyl crackle, 84 bpm", "seconds": 1.4, "seed": 42, "steps": 8}


class Bf16DiT(torch.nn.Module):
    """apus's bf16 run built from the official modules: the DiT cast to bf16 (its timestep
    features and RoPE frequencies fp32), fed and read back in fp32, so the sampler state and its
    noise stay the fp32 run's."""

    def __init__(self, islands):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # makes the wrapper's dtype fp32
        self.dit = islands
        self.diffusion_objective = islands.diffusion_objective
        self.postprocess_conv = islands.postprocess_conv

    def forward(self, x, t, **kwargs):
        self.dit.timestep_features.t = t.float()
        return self.dit(x, t, **kwargs).float()


def adapt_latents(seconds, rate, ratio, headroom=6.0, chunk_size=32, stride=16):
    """model.py _adapt_sample_size, in latents: (d + 6) s rounded up to whole latents, then to
    chunk_size // stride latents (the encoder's chunk alignment)."""
    n = int((seconds + headroom) * rate)
    n = -(-n // ratio) * ratio
    align = ratio * (chunk_size // stride)
    return -(-n // align) * align // ratio


def pipeline_fixtures(out_dir, dit, dit_islands, same):
    """The official text-to-audio generate() path on the tiny components, as its distilled models
    run it: tokenizer and T5Gemma (transformers), learned padding, duration embedding, the canvas
    with 6 s of headroom, the padding mask, the LogSNR schedule, ping-pong with the global
    generator's draws, the SAME decode, clamp and truncation. Writes sa3_tiny/pipeline/ (the
    components only this pipeline has; the test links in dit_diff, same_l, t5gemma_tiny and
    t5gemma_tok) and sa3_pipeline_ref.safetensors."""
    import types

    import stable_audio_3.inference.sampling as S
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder
    from stable_audio_3.models.diffusion import ConditionedDiffusionModelWrapper, DiTWrapper
    from transformers import AutoTokenizer, T5GemmaEncoderModel

    decoder, bottleneck, patch, cast_dec, cast_bott = same
    ratio = SAME_PATCH * 16
    root = os.path.join(out_dir, "sa3_tiny", "pipeline")
    os.makedirs(os.path.join(root, "scheduler"), exist_ok=True)
    index = {"_class_name": "StableAudio3Pipeline", "_diffusers_version": "0.42.1",
             "duration_embedder": ["diffusers", "StableAudio3DurationEmbedder"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "T5GemmaEncoderModel"],
             "tokenizer": ["transformers", "GemmaTokenizer"],
             "transformer": ["diffusers", "StableAudio3DiTModel"],
             "vae": ["diffusers", "AutoencoderSAME"]}
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.42.1",
                 "num_train_timesteps": 1, "shift": 1.0, "stochastic_sampling": True,
                 "use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15,
                 "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": False,
                 "shift_terminal": None, "use_karras_sigmas": False, "use_exponential_sigmas": False,
                 "use_beta_sigmas": False, "time_shift_type": "exponential"}
    with open(os.path.join(root, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump(scheduler, f, indent=2)
    gen = torch.Generator().manual_seed(21)
    duration = StableAudio3DurationEmbedder(output_dim=COND, fourier_dim=256).eval()  # the official NumberEmbedder's 256
    with torch.no_grad():
        duration.linear.weight.copy_(torch.randn(duration.linear.weight.shape, generator=gen) / 4)
        duration.linear.bias.copy_(0.5 * torch.randn(duration.linear.bias.shape, generator=gen))
    oracle_env.save_pretrained_readable(duration, os.path.join(root, "duration_embedder"))
    for name in os.listdir(root):
        path = os.path.join(root, name)
        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)

    tok = AutoTokenizer.from_pretrained(os.path.join(out_dir, "t5gemma_tok"))
    t5 = T5GemmaEncoderModel.from_pretrained(os.path.join(out_dir, "t5gemma_tiny")).eval()
    seconds, seed, steps = PIPELINE["seconds"], PIPELINE["seed"], PIPELINE["steps"]
    batch = tok([PIPELINE["prompt"]], truncation=True, max_length=256, padding="max_length",
                return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ref = {"input_ids": ids.to(torch.int64).contiguous(), "attention_mask": mask.to(torch.int64).contiguous()}
    with torch.no_grad():
        text = t5(input_ids=ids, attention_mask=mask).last_hidden_state
        s = duration(torch.tensor([seconds]))
    frames = adapt_latents(seconds, PIPELINE_RATE, ratio)
    valid = min(math.ceil(int(seconds * PIPELINE_RATE) / ratio) + int(6.0 * PIPELINE_RATE / ratio), frames)
    ref["text_embeds"] = text.contiguous()
    ref["duration_embeds"] = s.contiguous()
    for precision, model in (("fp32", dit), ("bf16", Bf16DiT(dit_islands))):
        padding = PIPELINE_PADDING[0]
        emb = torch.where(mask.bool()[..., None], text, padding)
        cond = {"prompt": [emb, mask.bool()], "seconds_total": [s[:, None, :], torch.ones(1, 1)]}
        wrapper = DiTWrapper.__new__(DiTWrapper)
        torch.nn.Module.__init__(wrapper)
        wrapper.diffusion_objective = "rf_denoiser"
        wrapper.model = model
        wrapped = ConditionedDiffusionModelWrapper(
            wrapper, None, io_channels=IO, sample_rate=PIPELINE_RATE, min_input_length=ratio,
            diffusion_objective="rf_denoiser", cross_attn_cond_ids=["prompt", "seconds_total"],
            global_cond_ids=["seconds_total"], local_add_cond_ids=["inpaint_mask", "inpaint_masked_input"],
            mask_padding_attention=True, use_effective_length_for_schedule=True, pretransform=None)
        torch.manual_seed(seed)
        noise = torch.randn([1, IO, frames])
        cond["inpaint_mask"] = [torch.zeros(1, 1, frames)]
        cond["inpaint_masked_input"] = [torch.zeros(1, IO, frames)]
        inputs = wrapped.get_conditioning_inputs(cond)
        denoised = []
        conditioning = [{"prompt": PIPELINE["prompt"], "seconds_total": seconds}]
        with torch.no_grad():
            latents = S.sample_diffusion(
                model=wrapped.model, noise=noise, cond_inputs=inputs, diffusion_objective="rf_denoiser",
                steps=steps, cfg_scale=1.0, conditioning=conditioning, sample_rate=PIPELINE_RATE,
                pretransform=types.SimpleNamespace(downsampling_ratio=ratio), mask_padding_attention=True,
                use_effective_length_for_schedule=True, headroom_seconds=6.0,
                dist_shift=wrapped.sampling_dist_shift, sampler_type=None, batch_cfg=True, rescale_cfg=True,
                apg_scale=1.0, init_data=None, init_noise_level=1.0, decode=False, disable_tqdm=True,
                callback=lambda d: denoised.append(d["denoised"].clone()))
            dec, bott = (decoder, bottleneck) if precision == "fp32" else (cast_dec, cast_bott)
            z = latents if precision == "fp32" else latents.to(torch.bfloat16)
            audio = patch.decode(dec(bott.decode(z))).float()
        keep = torch.arange(audio.shape[-1]) < valid * ratio
        audio = (audio * keep).clamp(-1, 1)[:, :, :int(seconds * PIPELINE_RATE)]
        ref[f"{precision}.latents"] = latents.float().contiguous()
        for i, d in enumerate(denoised):
            ref[f"{precision}.denoised.{i}"] = d.float().contiguous()
        ref[f"{precision}.audio"] = audio.contiguous()
    ref["fp32_decoder_noise.audio"] = original_layout_fixture(out_dir, dit, decoder, bottleneck, duration,
                                                              ref["fp32.audio"]).contiguous()
    for name, audio in BASE_REFS.items():
        ref[f"base_{name}.audio"] = audio
    eff = S.compute_effective_seq_len_from_conditioning(
        [{"prompt": "", "seconds_total": seconds}], PIPELINE_RATE, ratio, "cpu")
    ref["sigmas"] = S.build_schedule(steps, 1.0, wrapped.sampling_dist_shift, eff, frames, True, "cpu").reshape(-1)
    save_file(ref, os.path.join(out_dir, "sa3_pipeline_ref.safetensors"))
    with open(os.path.join(out_dir, "sa3_pipeline_ref.json"), "w") as f:
        json.dump({**PIPELINE, "frames": frames, "valid_frames": valid, "sample_rate": PIPELINE_RATE}, f,
                  indent=1)
    print(f"sa3 pipeline: {frames} latents ({valid} valid), audio {tuple(ref['fp32.audio'].shape)}; "
          f"bf16 vs fp32 latents rel L2 {rel(ref['bf16.latents'], ref['fp32.latents']):.3e}, "
          f"audio {rel(ref['bf16.audio'], ref['fp32.audio']):.3e}")
    return duration


def original_model_config(ratio, differential=True, same_s=False):
    """model_config.json as the official factory reads it, for the tiny components (the key set of
    the published configs: a DiT under model.diffusion, SAME under model.pretransform, T5Gemma and
    the duration under model.conditioning)."""
    dit = dict(io_channels=IO, embed_dim=128, depth=2, num_heads=2, cond_token_dim=COND, global_cond_dim=COND,
               local_add_cond_dim=IO + 1, global_cond_type="adaLN", timestep_features_type="expo",
               attn_kwargs={"qk_norm": "rms", "differential": differential}, norm_type="rms_norm",
               norm_kwargs={"force_fp32": True}, ff_kwargs={"mult": 4.0}, num_memory_tokens=4)
    decoder = SAME_S_DECODER if same_s else dict(out_channels=2 * SAME_PATCH, channels=32, c_mults=[4], strides=[16], latent_dim=SAME_LATENT,
                   transformer_depths=[4], sinusoidal_blocks=[3], sliding_window=[1, 1], dim_heads=64,
                   differential=True, dyt=True, variable_stride=True, conv_mapping=False, mask_noise=0.0)
    encoder = SAME_S_ENCODER if same_s else dict(
        in_channels=2 * SAME_PATCH, channels=32, latent_dim=SAME_LATENT, c_mults=[4], strides=[16],
        transformer_depths=[1], sliding_window=[1, 1], dim_heads=64, differential=True, variable_stride=True)
    return {
        "model_type": "diffusion_cond", "sample_size": 16777216, "sample_rate": PIPELINE_RATE, "audio_channels": 2,
        "model": {
            "io_channels": IO,
            "pretransform": {"type": "autoencoder", "chunked": same_s, "iterate_batch": False, "config": {
                "encoder": {"type": "same", "config": encoder}, "decoder": {"type": "same", "config": decoder},
                "bottleneck": {"type": "soft_norm", "config": {"dim": SAME_LATENT, "noise_regularize": False,
                                                               "auto_scale": True}},
                "pretransform": {"type": "patched", "config": {"channels": 2, "patch_size": SAME_PATCH}},
                "latent_dim": SAME_LATENT, "downsampling_ratio": ratio, "io_channels": 2}},
            "conditioning": {"cond_dim": COND, "configs": [
                {"id": "prompt", "type": "t5gemma", "config": {"model_name": "google/t5gemma-b-b-ul2",
                                                               "max_length": 256, "padding_mode": "learned",
                                                               "subfolder": "t5gemma-b-b-ul2"}},
                {"id": "seconds_total", "type": "number", "config": {"min_val": 0, "max_val": 384,
                                                                     "fourier_features_type": "expo"}}]},
            "diffusion": {"type": "dit", "diffusion_objective": "rf_denoiser",
                          "cross_attention_cond_ids": ["prompt", "seconds_total"], "global_cond_ids": ["seconds_total"],
                          "local_add_cond_ids": ["inpaint_mask", "inpaint_masked_input"], "config": dit}}}


def official_checkpoint(out_dir, config, root, torch_seed, fill):
    """Builds the official ConditionedDiffusionModelWrapper for `config` with the official factory
    (T5Gemma from a folder made of the tiny fixtures), lets `fill` set its parameters, writes
    model.safetensors and model_config.json to `root` and returns (StableAudioModel, tensor count).
    The T5 folder exists only while the model is built: call generate() inside `use`."""
    import tempfile

    from stable_audio_3.factory import create_diffusion_cond_from_config
    from stable_audio_3.model import StableAudioModel
    from stable_audio_3.models.conditioners import T5GemmaConditioner
    from transformers import AutoTokenizer

    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory() as t5_root:
        t5_dir = os.path.join(t5_root, "t5gemma-b-b-ul2")
        os.makedirs(t5_dir)
        for src in ("t5gemma_tiny/config.json", "t5gemma_tiny/model.safetensors", "t5gemma_tok/tokenizer.model"):
            shutil.copy(os.path.join(out_dir, src), t5_dir)
        # With a subfolder, transformers 5 builds GemmaTokenizer without reading tokenizer.model (every
        # prompt becomes one unknown token); the published folder has tokenizer.json, so write one.
        AutoTokenizer.from_pretrained(os.path.join(out_dir, "t5gemma_tok")).save_pretrained(t5_dir)
        T5GemmaConditioner.T5GEMMA_MODEL_DIMS["google/t5gemma-b-b-ul2"] = COND  # the tiny encoder's width
        prompt_cfg = config["model"]["conditioning"]["configs"][0]["config"]
        prompt_cfg["repo_id"] = t5_root
        torch.manual_seed(torch_seed)
        wrapper = create_diffusion_cond_from_config(config).eval()
        del prompt_cfg["repo_id"]
    with torch.no_grad():
        fill(wrapper)
    state = {k: v.contiguous() for k, v in wrapper.state_dict().items()}
    save_file(state, os.path.join(root, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(root, "model_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(root):
        os.chmod(os.path.join(root, name), 0o644)
    return StableAudioModel(wrapper, config, "cpu", False), len(state)


def official_generate(model, config):
    with torch.no_grad():
        return model.generate(prompt=PIPELINE["prompt"], duration=PIPELINE["seconds"], steps=PIPELINE["steps"],
                              seed=PIPELINE["seed"], sample_size=config["sample_size"])


def original_layout_fixture(out_dir, dit, decoder, bottleneck, duration, expected_audio):
    """The same tiny model in the official single-checkpoint layout (model_config.json,
    model.safetensors, t5gemma-b-b-ul2/), built by the official factory and run through the
    official StableAudioModel.generate(): its clip must be the pipeline fixture's. Writes
    sa3_tiny/original/ (the T5Gemma folder is linked in by the test from t5gemma_tiny and
    t5gemma_tok)."""
    config = original_model_config(SAME_PATCH * 16)

    def fill(wrapper):
        wrapper.model.model.load_state_dict(dit.state_dict())
        wrapper.pretransform.model.decoder.load_state_dict(decoder.state_dict())
        wrapper.pretransform.model.bottleneck.load_state_dict(bottleneck.state_dict())
        wrapper.conditioner.conditioners["prompt"].padding_embedding.copy_(PIPELINE_PADDING[0])
        linear = wrapper.conditioner.conditioners["seconds_total"].embedder.embedding[1]
        linear.weight.copy_(duration.linear.weight)
        linear.bias.copy_(duration.linear.bias)
        randomize_encoder(wrapper.pretransform.model.encoder, torch.Generator().manual_seed(51))

    model, tensors = official_checkpoint(out_dir, config, os.path.join(out_dir, "sa3_tiny", "original"), 31, fill)
    audio = official_generate(model, config)
    audio_inputs_fixture(out_dir, model, config)
    # As the published configs reportedly run the decode: with its inference noise, after the
    # sampler's draws from the same generator (the clip is shorter than one 128-latent chunk).
    for m in model.model.pretransform.model.decoder.modules():
        if hasattr(m, "mask_noise"):
            m.mask_noise = 0.1
    model.model.pretransform.model.bottleneck.noise_regularize = True
    noisy = official_generate(model, config)
    # The -base objective on the same weights: Euler with classifier-free guidance (APG), without
    # and with a negative prompt; the test links these weights under a rectified_flow config.
    base_config = copy.deepcopy(config)
    base_config["model"]["diffusion"]["diffusion_objective"] = "rectified_flow"
    base_root = os.path.join(out_dir, "sa3_tiny", "original_base")
    os.makedirs(base_root, exist_ok=True)
    with open(os.path.join(base_root, "model_config.json"), "w") as f:
        json.dump(base_config, f, indent=2)
    os.chmod(os.path.join(base_root, "model_config.json"), 0o644)
    for m in model.model.pretransform.model.decoder.modules():
        if hasattr(m, "mask_noise"):
            m.mask_noise = 0.0
    model.model.pretransform.model.bottleneck.noise_regularize = False
    model.model.diffusion_objective = model.model.model.diffusion_objective = "rectified_flow"
    model.model.model.model.diffusion_objective = "rectified_flow"
    guided = {}
    with torch.no_grad():
        for name, negative in (("cfg", None), ("cfg_negative", "noise, hiss")):
            guided[name] = model.generate(prompt=PIPELINE["prompt"], negative_prompt=negative,
                                          duration=PIPELINE["seconds"], steps=6, cfg_scale=7.0,
                                          seed=PIPELINE["seed"], sample_size=config["sample_size"]).contiguous()
    BASE_REFS.update(guided)
    print(f"sa3 original layout: {tensors} tensors; official generate() vs the pipeline fixture's clip "
          f"max |d| {(audio - expected_audio).abs().max().item():.3e}; with the decoder's noise rel L2 "
          f"{rel(noisy, audio):.3e} from it")
    assert torch.allclose(audio, expected_audio, rtol=0, atol=1e-6)
    return noisy


def write_wav16(path, audio, rate):
    """audio [C, N] holding multiples of 1/32768: a 16-bit PCM WAV that reads back exactly."""
    import wave
    pcm = (audio * 32768).round().clamp(-32768, 32767).to(torch.int16)
    with wave.open(path, "wb") as f:
        f.setnchannels(audio.shape[0])
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.t().contiguous().numpy().tobytes())
    os.chmod(path, 0o644)


def audio_inputs_fixture(out_dir, model, config):
    """Audio-to-audio and inpainting through the official generate() on the tiny medium-shaped
    checkpoint: its init_audio (a stereo clip shorter than the canvas, init_noise_level 0.6; also
    one at 3000 Hz, resampled by generate()) and
    inpaint_audio (a mono clip longer than the canvas, two regions). The clips are written as 16-bit
    WAVs, the form a user hands apus. Writes sa3_inputs_ref.safetensors and sa3_tiny/inputs/."""
    gen = torch.Generator().manual_seed(61)
    rate = PIPELINE_RATE
    t = torch.arange(int(1.0 * rate)) / rate
    init = torch.stack([0.4 * torch.sin(2 * math.pi * 110 * t), 0.3 * torch.sin(2 * math.pi * 165 * t + 1.0)])
    init = ((init + 0.05 * torch.randn(init.shape, generator=gen)) * 32768).round() / 32768
    long_t = torch.arange(int(9.0 * rate)) / rate
    inpaint = (0.5 * torch.sin(2 * math.pi * 220 * long_t) * torch.exp(-long_t))[None]
    inpaint = ((inpaint + 0.05 * torch.randn(inpaint.shape, generator=gen)) * 32768).round() / 32768
    root = os.path.join(out_dir, "sa3_tiny", "inputs")
    os.makedirs(root, exist_ok=True)
    write_wav16(os.path.join(root, "init.wav"), init, rate)
    write_wav16(os.path.join(root, "inpaint.wav"), inpaint, rate)
    regions = ([0.3, 1.0], [0.8, 1.2])
    common = dict(prompt=PIPELINE["prompt"], duration=PIPELINE["seconds"], steps=PIPELINE["steps"],
                  seed=PIPELINE["seed"], sample_size=config["sample_size"])
    # A clip at another rate (3000 Hz), which generate() resamples with torchaudio's Resample; and
    # that resampler alone at the rates users bring (48 kHz and 22.05 kHz to 44.1 kHz).
    from torchaudio import transforms as T
    t3 = torch.arange(int(1.2 * 3000)) / 3000
    init3k = torch.stack([0.4 * torch.sin(2 * math.pi * 90 * t3), 0.3 * torch.cos(2 * math.pi * 140 * t3)])
    init3k = ((init3k + 0.05 * torch.randn(init3k.shape, generator=gen)) * 32768).round() / 32768
    write_wav16(os.path.join(root, "init_3000.wav"), init3k, 3000)
    ref = {}
    for src in (48000, 22050):
        x = 0.5 * torch.randn(2, src // 10, generator=gen)
        ref[f"resample.{src}.in"] = x
        ref[f"resample.{src}.out"] = T.Resample(src, 44100)(x).contiguous()
    with torch.no_grad():
        # What generate() hands the sampler for a clip: prepare_audio (resample, pad or cut to the
        # canvas, channels) and the encoder, for the mono inpaint clip and the 3000 Hz one.
        size = model._adapt_sample_size([{"prompt": PIPELINE["prompt"], "seconds_total": PIPELINE["seconds"]}],
                                        config["sample_size"], 6.0)
        for name, clip in (("inpaint", (rate, inpaint)), ("init_3000", (3000, init3k))):
            ref[f"{name}.latents"] = model._encode_audio_input(clip, size)[0].contiguous()
        ref["a2a_resampled.fp32.audio"] = model.generate(init_audio=(3000, init3k), init_noise_level=0.6,
                                                         **common).contiguous()
        ref["inpaint_resampled.fp32.audio"] = model.generate(
            inpaint_audio=(3000, init3k), inpaint_mask_start_seconds=regions[0], inpaint_mask_end_seconds=regions[1],
            **common).contiguous()
        ref["a2a.fp32.audio"] = model.generate(init_audio=(rate, init), init_noise_level=0.6, **common).contiguous()
        ref["inpaint.fp32.audio"] = model.generate(inpaint_audio=(rate, inpaint), inpaint_mask_start_seconds=regions[0],
                                                   inpaint_mask_end_seconds=regions[1], **common).contiguous()
        ref["t2a.fp32.audio"] = official_generate(model, config).contiguous()
    save_file(ref, os.path.join(out_dir, "sa3_inputs_ref.safetensors"))
    with open(os.path.join(out_dir, "sa3_inputs_ref.json"), "w") as f:
        json.dump({"init_noise_level": 0.6, "inpaint_starts": regions[0], "inpaint_ends": regions[1]}, f, indent=1)
    print(f"sa3 audio inputs: audio-to-audio vs text-to-audio rel L2 {rel(ref['a2a.fp32.audio'], ref['t2a.fp32.audio']):.3e}, "
          f"vs audio-to-audio from the other clip {rel(ref['a2a.fp32.audio'], ref['a2a_resampled.fp32.audio']):.3e}, "
          f"inpainting from two clips {rel(ref['inpaint.fp32.audio'], ref['inpaint_resampled.fp32.audio']):.3e}, "
          f"inpainting vs text-to-audio {rel(ref['inpaint.fp32.audio'], ref['t2a.fp32.audio']):.3e}")


def small_layout_fixture(out_dir, dit, duration):
    """A small model (plain-attention DiT, SAME-S) in the official layout, run through the official
    generate(); plus SAME-S's decode alone in fp32 and bf16. Writes sa3_tiny/original_small/ and
    sa3_small_ref.safetensors."""
    import stable_audio_3.models.transformer as official_transformer
    from stable_audio_3.factory import create_autoencoder_from_config

    official_transformer.flex_attention_available = False
    official_transformer.flex_attention_compiled = None
    config = original_model_config(SAME_PATCH * 16, differential=False, same_s=True)
    gen = torch.Generator().manual_seed(41)

    def fill(wrapper):
        ae = wrapper.pretransform.model
        wrapper.model.model.load_state_dict(dit.state_dict())
        for name, p in list(ae.decoder.named_parameters()) + list(ae.bottleneck.named_parameters()):
            if name.endswith("alpha"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith("running_std"):
                p.fill_(1.3)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen) + (1.0 if name.endswith("gamma") else 0.0))
        randomize_encoder(ae.encoder, gen)
        with torch.no_grad():
            ae.bottleneck.scaling_factor.copy_(1.0 + 0.2 * torch.randn(ae.bottleneck.scaling_factor.shape, generator=gen))
            ae.bottleneck.bias.copy_(0.2 * torch.randn(ae.bottleneck.bias.shape, generator=gen))
        wrapper.conditioner.conditioners["prompt"].padding_embedding.copy_(0.5 * torch.randn(COND, generator=gen))
        linear = wrapper.conditioner.conditioners["seconds_total"].embedder.embedding[1]
        linear.weight.copy_(duration.linear.weight)
        linear.bias.copy_(duration.linear.bias)

    model, tensors = official_checkpoint(out_dir, config, os.path.join(out_dir, "sa3_tiny", "original_small"), 32, fill)
    ae = model.model.pretransform.model
    ref = {"fp32.audio": official_generate(model, config).contiguous()}
    with torch.no_grad():
        # SAME-S's decode alone: 40 latents whole, fp32 and cast to bf16 (RoPE frequencies fp32)
        z = torch.randn(2, SAME_LATENT, 40, generator=gen)
        ref["same.latents"] = z
        ref["same.fp32.audio"] = ae.decode(z).contiguous()
        cast = create_autoencoder_from_config(config["model"], config["sample_rate"]).eval()
        cast.load_state_dict(ae.state_dict())
        cast = cast.to(torch.bfloat16)
        for block, original in zip(cast.decoder.layers[3].transformers, ae.decoder.layers[3].transformers):
            block.rope.inv_freq = original.rope.inv_freq.clone()
        ref["same.bf16.audio"] = cast.decode(z.to(torch.bfloat16)).float().contiguous()
        # SAME-S's encoder (chunks of 34 tokens, shifted for its second half, a kernel-3 mapping):
        # 40 latents' worth whole in fp32 and bf16, and 300 chunked as the config says.
        clip = 0.5 * torch.randn(2, 2, 40 * SAME_PATCH * 16, generator=gen)
        ref["encode.audio"] = clip
        ref["encode.fp32.latents"] = ae.encode(clip).contiguous()
        for block, original in zip(cast.encoder.layers[0].transformers, ae.encoder.layers[0].transformers):
            block.rope.inv_freq = original.rope.inv_freq.clone()
        ref["encode.bf16.latents"] = cast.encode(clip.to(torch.bfloat16)).float().contiguous()
        long_clip = 0.5 * torch.randn(1, 2, 300 * SAME_PATCH * 16, generator=gen)
        ref["encode.long.audio"] = long_clip
        ref["encode.long.chunked.latents"] = model.model.pretransform.encode(long_clip).contiguous()
        whole = ae.encode_audio(long_clip, chunked=False)
    save_file(ref, os.path.join(out_dir, "sa3_small_ref.safetensors"))
    print(f"sa3 small (SAME-S) original layout: {tensors} tensors, clip {tuple(ref['fp32.audio'].shape)}; "
          f"SAME-S decode bf16 vs fp32 rel L2 {rel(ref['same.bf16.audio'], ref['same.fp32.audio']):.3e}; encode bf16 "
          f"vs fp32 {rel(ref['encode.bf16.latents'], ref['encode.fp32.latents']):.3e}, chunked vs whole over 300 "
          f"latents {rel(ref['encode.long.chunked.latents'], whole):.3e}")


def main():
    args = oracle_env.official_sa3_args("make_sa3_official_fixtures")
    same_decoder = same_fixtures(args.out)

    ref = {}
    dits = {}
    for variant, differential in (("dit_diff", True), ("dit_plain", False)):
        gen = torch.Generator().manual_seed(7 if differential else 8)
        model = official_dit(differential)
        randomize(model, gen)
        padding = 0.5 * torch.randn(COND, generator=gen)
        if differential:
            PIPELINE_PADDING[:] = [padding]

        diffusers_model = StableAudio3DiTModel(
            io_channels=IO, embed_dim=128, depth=2, num_heads=2, cond_token_dim=COND, global_cond_dim=COND,
            local_add_cond_dim=IO + 1, num_memory_tokens=4, use_differential_attention=differential).eval()
        state = to_diffusers(model.state_dict(), differential, 128)
        state["prompt_padding_embedding"] = padding
        diffusers_model.load_state_dict(state, strict=True)
        oracle_env.save_pretrained_readable(diffusers_model, os.path.join(args.out, "sa3_tiny", variant))

        x = torch.randn(B, IO, T, generator=gen)
        t = torch.full((B,), TIMESTEP)
        text = torch.randn(B, CTX, COND, generator=gen)
        text_mask = torch.ones(B, CTX, dtype=torch.bool)
        text_mask[:, CTX - 3:CTX - 1] = False  # two padded text positions before the duration token
        cross = torch.where(text_mask[..., None], text, padding)
        glob = torch.randn(B, COND, generator=gen)
        inpaint_mask = (torch.arange(T) % 5 < 2).float().expand(B, 1, T)
        local_inpaint = torch.cat([inpaint_mask, torch.randn(B, IO, T, generator=gen) * inpaint_mask], 1)
        cases = {"t2a": torch.zeros(B, IO + 1, T), "inpaint": local_inpaint}
        p = f"{variant}."
        ref.update({p + "x": x, p + "t": t, p + "text": text, p + "text_mask": text_mask.to(torch.int64),
                    p + "global": glob})
        cast = official_dit(differential)
        cast.load_state_dict(model.state_dict())
        cast = cast.to(torch.bfloat16)
        islands = official_dit(differential)
        islands.load_state_dict(model.state_dict())
        islands = islands.to(torch.bfloat16)
        islands.transformer.rotary_pos_emb.inv_freq = model.transformer.rotary_pos_emb.inv_freq.clone()
        islands.timestep_features = Fp32TimestepFeatures(islands.timestep_features, t)
        dits[variant] = (model, islands)
        with torch.no_grad():
            for case, local in cases.items():
                ref[f"{p}{case}.local"] = local
                f32 = model(x, t, cross_attn_cond=cross, global_embed=glob, local_add_cond=local)
                b16 = islands(x, t, cross_attn_cond=cross, global_embed=glob, local_add_cond=local)
                c16 = cast(x, t, cross_attn_cond=cross, global_embed=glob, local_add_cond=local)
                ref[f"{p}{case}.fp32.velocity"] = f32.contiguous()
                ref[f"{p}{case}.bf16.velocity"] = b16.float().contiguous()
                ref[f"{p}{case}.official_bf16.velocity"] = c16.float().contiguous()
                torch_forward = type(model.timestep_features).forward
                type(model.timestep_features).forward = correctly_rounded_features
                exact = model(x, t, cross_attn_cond=cross, global_embed=glob, local_add_cond=local)
                type(model.timestep_features).forward = torch_forward
                ref[f"{p}{case}.fp32_exact_features.velocity"] = exact.contiguous()
                dm = diffusers_model(x, t, text, glob, encoder_attention_mask=text_mask,
                                     local_add_cond=local).sample
                print(f"sa3 {variant} {case}: bf16 (fp32 t and RoPE) vs fp32 rel L2 {rel(b16, f32):.3e}, "
                      f"plain bf16 cast {rel(c16, f32):.3e}; fp32 with exact features {rel(exact, f32):.3e}; diffusers fp32 vs official fp32 {rel(dm, f32):.3e}")
    save_file(ref, os.path.join(args.out, "sa3_dit_ref.safetensors"))
    duration = pipeline_fixtures(args.out, *dits["dit_diff"], same_decoder)
    small_layout_fixture(args.out, dits["dit_plain"][0], duration)


if __name__ == "__main__":
    main()
