#!/usr/bin/env python3
"""Oracle for apus: tiny random-weight FLUX.2 [klein] pipelines + reference tensors.

Everything here goes through the official classes (diffusers Flux2KleinPipeline,
Flux2Transformer2DModel, AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler;
transformers Qwen3ForCausalLM, Qwen2Tokenizer).  Writes, under tests/fixtures/:

  klein_tiny_a/, klein_tiny_b/          diffusers-layout model folders (bf16 weights)
  klein_tiny_{a,b}_ref.safetensors      reference tensors captured from the official pipeline
  klein_tiny_{a,b}_ref.json             run parameters, schedule, versions
  tokenizer_cases.json                  tokenizer reference ids

Usage: make_klein_fixtures.py [--out DIR] [--only-tokenizer]
See tools/oracle/README.md for keys and layouts.
"""

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle_env import REPO  # noqa: E402

import klein_tokenizer as kt  # noqa: E402

MAX_SEQ = 512
TEXT_LAYERS = (9, 18, 27)
STEPS = 4
GUIDANCE = 1.0

VARIANTS = {
    "klein_tiny_a": dict(
        vocab_target=3000,
        merges_as_strings=True,  # "a b" strings, as in Qwen's published tokenizer.json
        pad_vocab_to=128,  # embedding rows beyond the tokenizer, like Qwen3 (151936 > 151669)
        config_style="transformers5",  # text_encoder/config.json as transformers 5 writes it
        qwen=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=28,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # 4*16 = 64 != hidden 32 (as in Qwen3-4B: 32*128 != 2560)
        ),
        dit=dict(
            num_layers=2,
            num_single_layers=3,
            num_attention_heads=2,
            attention_head_dim=32,
            axes_dims_rope=(8, 8, 8, 8),
        ),
        vae=dict(block_out_channels=(8, 16, 32, 32), norm_num_groups=8),
        width=64,
        height=48,
        seed=42,
        init_seed=1001,
        prompt="A photograph of a red fox sitting in tall grass at sunrise, soft golden light.",
    ),
    "klein_tiny_b": dict(
        vocab_target=2000,
        merges_as_strings=False,  # [a, b] pairs, the newer tokenizers serialisation
        pad_vocab_to=1,  # vocab_size == tokenizer size
        chat_template_file=True,  # tokenizer/chat_template.jinja (newer layout) instead of tokenizer_config.json
        config_style="transformers4",  # rope_theta / torch_dtype at top level, as in Qwen3-4B's file
        qwen=dict(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=30,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,  # 6*8 = 48 != hidden 24
        ),
        dit=dict(
            num_layers=3,
            num_single_layers=2,
            num_attention_heads=3,
            attention_head_dim=16,
            axes_dims_rope=(4, 4, 4, 4),
        ),
        vae=dict(block_out_channels=(8, 16, 24, 24), norm_num_groups=4),
        width=48,
        height=80,
        seed=1234,
        init_seed=2002,
        prompt="一只可爱的小猫 sits on a café table — «bonjour» 😺 at 12:45, don't panic!",
    ),
    # A -base checkpoint: model_index.json is_distilled false, so the official pipeline runs
    # classifier-free guidance against the empty negative prompt.
    "klein_tiny_base": dict(
        vocab_target=1500,
        merges_as_strings=True,
        pad_vocab_to=64,
        config_style="transformers5",
        qwen=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=28,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        ),
        dit=dict(
            num_layers=2,
            num_single_layers=2,
            num_attention_heads=2,
            attention_head_dim=32,
            axes_dims_rope=(8, 8, 8, 8),
        ),
        vae=dict(block_out_channels=(8, 16, 16, 16), norm_num_groups=8),
        width=48,
        height=32,
        seed=77,
        init_seed=3003,
        prompt="A lighthouse on a rocky shore under a stormy sky.",
        distilled=False,
        steps=3,
        guidance=3.5,  # not a power of two: rounding the scaled difference shows
    ),
    # Shaped as FLUX.2-klein-9B is to 4B: the transformer as wide as the text encoder (4096 =
    # 32 x 128 for both), heads x head_dim equal to the text hidden size, grouped-query attention
    # 4:1 (Qwen3-8B's 32:8), three single blocks per double block (8:24). Its weights also serve
    # the -kv fixture (Flux2KleinKVPipeline, reference_kv).
    "klein_tiny_9b": dict(
        vocab_target=1800,
        merges_as_strings=True,
        pad_vocab_to=64,
        config_style="transformers5",
        qwen=dict(
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=28,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,  # 4 * 8 == hidden 32, as Qwen3-8B's 32 * 128 == 4096
        ),
        dit=dict(
            num_layers=2,
            num_single_layers=6,
            num_attention_heads=2,
            attention_head_dim=16,  # 2 * 16 == the text encoder's 32, as 9B's 32 * 128 == 4096
            axes_dims_rope=(4, 4, 4, 4),
        ),
        vae=dict(block_out_channels=(8, 16, 16, 16), norm_num_groups=8),
        width=64,
        height=32,
        seed=909,
        init_seed=4004,
        prompt="Two paper boats on a puddle, city lights reflected at night.",
        kv=True,
    ),
}

TOKENIZER_TEXTS = [
    "A cat holding a sign that says hello world",
    "The quick brown fox jumps over the lazy dog.",
    "don't",
    "I'LL be there, you're late, we've won, she'd go, it's MINE",
    "一只可爱的小猫坐在窗台上",
    "今日は天気がいいので、公園で散歩しましょう。",
    "서울의 밤거리",
    "😀🤖🦊 emoji 👨‍👩‍👧 family 🏳️‍🌈",
    "e\u0301",
    "cafe\u0301 vs café",
    # HF's NFC uses Unicode 9 tables: a mark assigned later (U+1715) must not be reordered.
    "\u0eb9\u1715",
    # \s is Unicode White_Space in HF's regex engine; U+180E is not in it.
    "x\u180e's",
    "A\u030a and \u212b (Angstrom sign) and \uff21\uff22 fullwidth",
    "a    b",
    "  leading and trailing spaces  ",
    " ",
    "   ",
    "tab\there\t\tand\tnewline\nline two\n\nline four\r\nwindows",
    "\n\n\n",
    "12345",
    "3.14159 and 1,000,000 and 2026-11-30",
    "!!! ??? ... --- ==> (a, b) [c] {d} <e>",
    "Wait... what?!?! #hashtag @user $9.99 100%",
    "<|im_end|>",
    "before<|im_start|>user\nhi<|im_end|>after",
    "<think>\n\n</think>\n\n",
    "<|endoftext|><|endoftext|>",
    "<tool_call>call</tool_call> <|fim_prefix|>x<|fim_suffix|>",
    "<|im_end",
    "",
    "Привет, мир! Ελληνικά. مرحبا. नमस्ते.",
    "MiXeD CaSe WoRdS and ALLCAPS and lowercase",
    "x" * 40,
    "https://example.com/path?query=1&x=2",
    "def f(x):\n    return x * 2\n",
]

LONG_PROMPT = " ".join(
    [
        "A highly detailed panoramic landscape painting of an ancient city built on floating islands,",
        "with waterfalls pouring from the edges into a sea of clouds, golden sunlight, tiny boats,",
        "bridges of rope and wood, gardens of glowing flowers, birds and dragons flying between towers,",
        "cinematic lighting, rich colors, 35mm film grain, masterpiece.",
    ]
    * 12
)

TEMPLATED_PROMPTS = [
    "A cat holding a sign that says hello world",
    "一只可爱的小猫 sits on a café table — «bonjour» 😺",
    LONG_PROMPT,
]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def versions():
    import diffusers
    import safetensors
    import tokenizers
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


def write_tokenizer(dir_, cfg):
    old = kt.VOCAB_SIZE
    kt.VOCAB_SIZE = cfg["vocab_target"]
    try:
        tj, total = kt.write_tokenizer_dir(dir_, merges_as_strings=cfg["merges_as_strings"])
    finally:
        kt.VOCAB_SIZE = old
    if cfg.get("chat_template_file"):
        p = os.path.join(dir_, "tokenizer_config.json")
        with open(p, encoding="utf-8") as f:
            tc = json.load(f)
        with open(os.path.join(dir_, "chat_template.jinja"), "w", encoding="utf-8", newline="\n") as f:
            f.write(tc.pop("chat_template"))
        kt.dump_json(tc, p)
    # the template must render exactly what Qwen3 gives with enable_thinking=False
    tok = load_hf_tokenizer(dir_)
    text = tok.apply_chat_template([{"role": "user", "content": "P"}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text == "<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", repr(text)
    return tj, total


def load_hf_tokenizer(dir_):
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast.from_pretrained(dir_)


def pipeline_tokenize(tokenizer, prompt, max_sequence_length=MAX_SEQ):
    """Exactly the tokenisation in Flux2KleinPipeline._get_qwen3_prompt_embeds."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    inputs = tokenizer(
        text,
        return_tensors="pt",
        padding="max_length",
        truncation=True,
        max_length=max_sequence_length,
    )
    return text, inputs["input_ids"], inputs["attention_mask"]


def make_tokenizer_cases(out_dir):
    from tokenizers import Tokenizer

    tdir = os.path.join(out_dir, "klein_tiny_a", "tokenizer")
    raw = Tokenizer.from_file(os.path.join(tdir, "tokenizer.json"))
    hf = load_hf_tokenizer(tdir)
    cases = []
    for text in TOKENIZER_TEXTS:
        ids = raw.encode(text, add_special_tokens=False).ids
        ids_hf = hf.encode(text, add_special_tokens=False)
        assert ids == ids_hf, (text, ids, ids_hf)
        cases.append({"text": text, "ids": ids})
    templated = []
    for p in TEMPLATED_PROMPTS:
        text, ids, mask = pipeline_tokenize(hf, p)
        templated.append(
            {
                "prompt": p,
                "templated_text": text,
                "n_tokens_untruncated": len(hf.encode(text, add_special_tokens=False)),
                "input_ids": ids[0].tolist(),
                "attention_mask": mask[0].tolist(),
            }
        )
    assert templated[-1]["n_tokens_untruncated"] > MAX_SEQ, "long prompt must exceed max length"
    doc = {
        "tokenizer": "klein_tiny_a/tokenizer/tokenizer.json",
        "note": (
            "cases: ids = tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids (identical to "
            "transformers Qwen2Tokenizer.encode(text, add_special_tokens=False)). templated: the pipeline's own "
            "path: apply_chat_template([{role: user, content: prompt}], tokenize=False, add_generation_prompt=True, "
            "enable_thinking=False) then tokenizer(text, padding='max_length', truncation=True, max_length=512); "
            "pad id = <|endoftext|>, right padding, right truncation (the template tail is cut for long prompts)."
        ),
        "special_ids": {t: hf.convert_tokens_to_ids(t) for t, _ in kt.ADDED_TOKENS},
        "pad_token_id": hf.pad_token_id,
        "max_length": MAX_SEQ,
        "cases": cases,
        "templated": templated,
    }
    kt.dump_json(doc, os.path.join(out_dir, "tokenizer_cases.json"), indent=1)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


def randomize_(module, seed, out_scale=None):
    """Deterministically re-initialise every parameter/buffer so that no weight is trivially 0 or 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 1:
                if name.endswith("bias"):
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
                else:  # norm scales
                    p.copy_(1.0 + 0.15 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                std = 1.0 / fan_in**0.5
                if "embed_tokens" in name:
                    std = 0.5
                p.copy_(std * torch.randn(p.shape, generator=g))
                if out_scale and name in out_scale:
                    p.mul_(out_scale[name])


def build_text_encoder(cfg, vocab_total, tok):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    q = cfg["qwen"]
    config = Qwen3Config(
        vocab_size=vocab_total,
        hidden_size=q["hidden_size"],
        intermediate_size=q["intermediate_size"],
        num_hidden_layers=q["num_hidden_layers"],
        num_attention_heads=q["num_attention_heads"],
        num_key_value_heads=q["num_key_value_heads"],
        head_dim=q["head_dim"],
        hidden_act="silu",
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=q["num_hidden_layers"],
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        torch_dtype="bfloat16",
    )
    model = Qwen3ForCausalLM(config)
    randomize_(model, cfg["init_seed"] + 1)
    model.tie_weights()
    return model.to(torch.bfloat16).eval()


def rewrite_qwen3_config_v4(path):
    """Rewrite a transformers-5 Qwen3 config.json in the transformers-4 layout of the published Qwen3-4B
    config (rope_theta/rope_scaling/torch_dtype at top level, no layer_types). transformers 5 still loads it."""
    with open(path, encoding="utf-8") as f:
        c = json.load(f)
    rope = c.pop("rope_parameters")
    assert rope["rope_type"] == "default"
    c.pop("layer_types", None)
    c["rope_theta"] = rope["rope_theta"]
    c["rope_scaling"] = None
    c["torch_dtype"] = c.pop("dtype")
    c["transformers_version"] = "4.51.0"
    c = dict(sorted(c.items()))
    kt.dump_json(c, path)


def build_transformer(cfg, text_hidden):
    import torch
    from diffusers import Flux2Transformer2DModel

    d = cfg["dit"]
    assert sum(d["axes_dims_rope"]) == d["attention_head_dim"]
    model = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=128,
        out_channels=None,
        num_layers=d["num_layers"],
        num_single_layers=d["num_single_layers"],
        attention_head_dim=d["attention_head_dim"],
        num_attention_heads=d["num_attention_heads"],
        joint_attention_dim=3 * text_hidden,
        timestep_guidance_channels=256,
        mlp_ratio=3.0,
        axes_dims_rope=tuple(d["axes_dims_rope"]),
        rope_theta=2000,
        eps=1e-6,
        guidance_embeds=False,
    )
    randomize_(model, cfg["init_seed"] + 2)
    return model.to(torch.bfloat16).eval()


def build_vae(cfg):
    import torch
    from diffusers import AutoencoderKLFlux2

    v = cfg["vae"]
    model = AutoencoderKLFlux2(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=tuple(v["block_out_channels"]),
        layers_per_block=2,
        act_fn="silu",
        latent_channels=32,
        norm_num_groups=v["norm_num_groups"],
        sample_size=1024,
        use_quant_conv=True,
        use_post_quant_conv=True,
        mid_block_add_attention=True,
        batch_norm_eps=1e-4,
        batch_norm_momentum=0.1,
        patch_size=(2, 2),
    )
    randomize_(model, cfg["init_seed"] + 3, out_scale={"decoder.conv_out.weight": 0.5})
    g = torch.Generator().manual_seed(cfg["init_seed"] + 4)
    with torch.no_grad():
        model.bn.running_mean.copy_(0.5 * torch.randn(model.bn.running_mean.shape, generator=g))
        model.bn.running_var.copy_(torch.exp(0.5 * torch.randn(model.bn.running_var.shape, generator=g)))
    return model.to(torch.bfloat16).eval()


def scheduler_config():
    # FlowMatchEulerDiscreteScheduler settings of the FLUX family (dynamic exponential shifting with mu).
    return dict(
        base_image_seq_len=256,
        base_shift=0.5,
        invert_sigmas=False,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        shift=3.0,
        shift_terminal=None,
        stochastic_sampling=False,
        time_shift_type="exponential",
        use_beta_sigmas=False,
        use_dynamic_shifting=True,
        use_exponential_sigmas=False,
        use_karras_sigmas=False,
    )


def build_variant(out_dir, name, cfg):
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    root = os.path.join(out_dir, name)
    if os.path.isdir(root):
        shutil.rmtree(root)
    os.makedirs(root)
    write_tokenizer(os.path.join(root, "tokenizer"), cfg)
    tok = load_hf_tokenizer(os.path.join(root, "tokenizer"))
    m = cfg["pad_vocab_to"]
    vocab_total = (len(tok) + m - 1) // m * m

    te = build_text_encoder(cfg, vocab_total, tok)
    te.save_pretrained(os.path.join(root, "text_encoder"), max_shard_size="400KB")
    if cfg["config_style"] == "transformers4":
        rewrite_qwen3_config_v4(os.path.join(root, "text_encoder", "config.json"))
    tr = build_transformer(cfg, cfg["qwen"]["hidden_size"])
    tr.save_pretrained(os.path.join(root, "transformer"))
    vae = build_vae(cfg)
    vae.save_pretrained(os.path.join(root, "vae"))
    sch = FlowMatchEulerDiscreteScheduler(**scheduler_config())
    sch.save_pretrained(os.path.join(root, "scheduler"))

    import diffusers

    model_index = {
        "_class_name": "Flux2KleinPipeline",
        "_diffusers_version": diffusers.__version__,
        "is_distilled": cfg.get("distilled", True),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    kt.dump_json(model_index, os.path.join(root, "model_index.json"))

    shards = [f for f in os.listdir(os.path.join(root, "text_encoder")) if f.endswith(".safetensors")]
    assert len(shards) >= 2 and os.path.exists(os.path.join(root, "text_encoder", "model.safetensors.index.json")), shards
    # drop files that carry no information for the C++ side and are not in the published layout
    gen_cfg = os.path.join(root, "text_encoder", "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    del te, tr, vae
    torch.manual_seed(0)


# --------------------------------------------------------------------------------------------
# reference run
# --------------------------------------------------------------------------------------------


def check_loaded_weights(pipe, root, dtype):
    """Every tensor the pipeline holds must be exactly the bf16 tensor stored on disk (nothing re-initialised)."""
    import glob

    import torch
    from safetensors.torch import load_file

    for comp in ("text_encoder", "transformer", "vae"):
        disk = {}
        for f in sorted(glob.glob(os.path.join(root, comp, "*.safetensors"))):
            disk.update(load_file(f))
        sd = getattr(pipe, comp).state_dict()
        for k, v in disk.items():
            assert k in sd, (comp, k)
            if not v.is_floating_point():  # bn.num_batches_tracked
                assert torch.equal(sd[k], v), (comp, k)
                continue
            assert v.dtype == torch.bfloat16, (comp, k, v.dtype)
            assert sd[k].dtype == dtype, (comp, k, sd[k].dtype)
            assert torch.equal(sd[k].to(torch.float32), v.to(torch.float32)), (comp, k)
        missing = [k for k in sd if k not in disk and not (comp == "text_encoder" and k == "lm_head.weight")
                   and not k.endswith("num_batches_tracked")]
        assert not missing, (comp, missing)


def capture_run(root, cfg, dtype, tag):
    """Run the official pipeline with injected noise and capture every stage. Returns (tensors, meta)."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinPipeline
    from diffusers.utils.torch_utils import randn_tensor

    pipe = Flux2KleinPipeline.from_pretrained(root, torch_dtype=dtype)
    pipe.to("cpu")
    pipe.set_progress_bar_config(disable=True)
    distilled, steps, guidance = cfg.get("distilled", True), cfg.get("steps", STEPS), cfg.get("guidance", GUIDANCE)
    assert pipe.config.is_distilled == distilled
    guided = not distilled and guidance > 1
    calls_per_step = 2 if guided else 1
    check_loaded_weights(pipe, root, dtype)
    te_cfg = pipe.text_encoder.config
    assert te_cfg.rope_parameters["rope_theta"] == 1000000.0 and te_cfg.rope_parameters["rope_type"] == "default"
    assert te_cfg.head_dim == cfg["qwen"]["head_dim"] and te_cfg.tie_word_embeddings

    W, H, seed = cfg["width"], cfg["height"], cfg["seed"]
    out = {}
    f32 = lambda t: t.detach().to(torch.float32).contiguous().clone()  # noqa: E731

    # -- the noise exactly as prepare_latents draws it: dtype = prompt_embeds.dtype = text_encoder.dtype
    noise_dtype = pipe.text_encoder.dtype
    vsf = pipe.vae_scale_factor
    lh, lw = 2 * (H // (vsf * 2)), 2 * (W // (vsf * 2))
    in_ch = pipe.transformer.config.in_channels
    shape = (1, (in_ch // 4) * 4, lh // 2, lw // 2)
    # Both precisions start from the bf16 draw the official bf16 pipeline makes (exact in fp32), so
    # that the fp32-vs-bf16 disagreement the C++ bounds derive from measures precision alone.
    noise = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), device=torch.device("cpu"),
                         dtype=torch.bfloat16).to(noise_dtype)
    out[f"{tag}.noise"] = f32(noise)

    te_calls, dit_calls, sched_calls, vae_calls = [], [], [], []

    def te_pre(mod, args, kwargs):
        te_calls.append({k: kwargs[k].detach().clone() for k in ("input_ids", "attention_mask")})

    def te_post(mod, args, kwargs, output):
        te_calls[-1]["hidden_states"] = [h.detach().clone() for h in output.hidden_states]

    def dit_pre(mod, args, kwargs):
        dit_calls.append({k: kwargs[k].detach().clone() for k in
                          ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids")})

    def dit_post(mod, args, kwargs, output):
        dit_calls[-1]["out"] = output[0].detach().clone()

    h1 = pipe.text_encoder.register_forward_pre_hook(te_pre, with_kwargs=True)
    h2 = pipe.text_encoder.register_forward_hook(te_post, with_kwargs=True)
    h3 = pipe.transformer.register_forward_pre_hook(dit_pre, with_kwargs=True)
    h4 = pipe.transformer.register_forward_hook(dit_post, with_kwargs=True)

    orig_step = pipe.scheduler.step

    def step(model_output, timestep, sample, *a, **k):
        r = orig_step(model_output, timestep, sample, *a, **k)
        prev = r[0] if isinstance(r, tuple) else r.prev_sample
        sched_calls.append({"t": timestep.detach().clone(), "in": sample.detach().clone(),
                            "v": model_output.detach().clone(), "out": prev.detach().clone()})
        return r

    pipe.scheduler.step = step

    orig_decode = pipe.vae.decode

    def decode(z, *a, **k):
        r = orig_decode(z, *a, **k)
        img = r[0] if isinstance(r, tuple) else r.sample
        vae_calls.append({"z": z.detach().clone(), "img": img.detach().clone()})
        return r

    pipe.vae.decode = decode

    result = pipe(
        prompt=cfg["prompt"],
        height=H,
        width=W,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=noise,
        max_sequence_length=MAX_SEQ,
        text_encoder_out_layers=TEXT_LAYERS,
        output_type="pil",
    )
    for h in (h1, h2, h3, h4):
        h.remove()
    pipe.scheduler.step = orig_step
    pipe.vae.decode = orig_decode

    image_u8 = np.asarray(result.images[0].convert("RGB"), dtype=np.uint8)
    assert image_u8.shape == (H, W, 3), image_u8.shape

    assert len(te_calls) == calls_per_step and len(dit_calls) == calls_per_step * steps
    assert len(sched_calls) == steps and len(vae_calls) == 1
    # Guided: the negative prompt ("") is encoded second, and every step runs the transformer on
    # the prompt, then on the negative prompt.
    uncond_calls = dit_calls[1::2] if guided else []
    dit_calls = dit_calls[::2] if guided else dit_calls
    if guided:
        out["negative_input_ids"] = te_calls[1]["input_ids"].to(torch.int64)
        out["negative_attention_mask"] = te_calls[1]["attention_mask"].to(torch.int64)
        out[f"{tag}.negative_prompt_embeds"] = f32(uncond_calls[0]["encoder_hidden_states"])
    te = te_calls[0]
    out["input_ids"] = te["input_ids"].to(torch.int64)
    out["attention_mask"] = te["attention_mask"].to(torch.int64)

    # cross-check: hidden_states[k] are the outputs of decoder layer k-1 (index 0 = embeddings), pre final norm
    n_layers = pipe.text_encoder.config.num_hidden_layers
    assert len(te["hidden_states"]) == n_layers + 1
    stacked = torch.stack([te["hidden_states"][k] for k in TEXT_LAYERS], dim=1)
    pe_manual = stacked.permute(0, 2, 1, 3).reshape(1, MAX_SEQ, -1).to(noise_dtype)

    d0 = dit_calls[0]
    out[f"{tag}.prompt_embeds"] = f32(d0["encoder_hidden_states"])
    assert torch.equal(pe_manual, d0["encoder_hidden_states"])
    out[f"{tag}.text_ids"] = d0["txt_ids"].to(torch.int64).contiguous()
    out[f"{tag}.latent_ids"] = d0["img_ids"].to(torch.int64).contiguous()

    for i, c in enumerate(dit_calls):
        assert torch.equal(c["encoder_hidden_states"], d0["encoder_hidden_states"])
        out[f"{tag}.dit.step{i}.latents_in"] = f32(c["hidden_states"])
        out[f"{tag}.dit.step{i}.timestep"] = f32(c["timestep"])
        out[f"{tag}.dit.step{i}.velocity"] = f32(c["out"])
        s = sched_calls[i]
        if guided:
            u = uncond_calls[i]
            assert torch.equal(u["hidden_states"], c["hidden_states"])
            out[f"{tag}.dit.step{i}.velocity_uncond"] = f32(u["out"])
            out[f"{tag}.step{i}.guided_velocity"] = f32(s["v"])
        else:
            assert torch.equal(s["v"], c["out"][:, : s["in"].shape[1]])
        out[f"{tag}.scheduler.step{i}.t"] = f32(s["t"].reshape(1))
        out[f"{tag}.step{i}.latents"] = f32(s["out"])

    # the packed noise is what the first transformer call receives
    packed = noise.reshape(1, shape[1], -1).permute(0, 2, 1).to(pipe.transformer.dtype)
    assert torch.equal(packed, dit_calls[0]["hidden_states"]), "packed noise != first transformer input"

    out[f"{tag}.vae.latents_in"] = f32(vae_calls[0]["z"])
    out[f"{tag}.vae.image"] = f32(vae_calls[0]["img"])
    out[f"{tag}.image_u8"] = torch.from_numpy(image_u8.copy())

    sch = pipe.scheduler
    meta = {
        "dtype": str(dtype).replace("torch.", ""),
        "noise_dtype": str(noise_dtype).replace("torch.", ""),
        "noise_shape": list(shape),
        "timesteps": [float(x) for x in sch.timesteps.tolist()],
        "sigmas": [float(x) for x in sch.sigmas.tolist()],
        "dit_input_dtype": str(dit_calls[0]["hidden_states"].dtype).replace("torch.", ""),
        "dit_timestep_dtype": str(dit_calls[0]["timestep"].dtype).replace("torch.", ""),
        "latents_dtype": str(sched_calls[0]["out"].dtype).replace("torch.", ""),
        "vae_input_dtype": str(vae_calls[0]["z"].dtype).replace("torch.", ""),
        "vae_output_dtype": str(vae_calls[0]["img"].dtype).replace("torch.", ""),
        "prompt_embeds_dtype": str(d0["encoder_hidden_states"].dtype).replace("torch.", ""),
    }

    # sanity: drawing the noise through the pipeline's own generator path gives the same image
    # (only the bf16 pipeline draws the injected noise itself)
    r2 = None if dtype != torch.bfloat16 else pipe(
        prompt=cfg["prompt"],
        height=H,
        width=W,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(seed),
        max_sequence_length=MAX_SEQ,
        text_encoder_out_layers=TEXT_LAYERS,
        output_type="pil",
    )
    assert r2 is None or np.array_equal(np.asarray(r2.images[0].convert("RGB")), image_u8), \
        "injected noise != generator noise"

    del pipe
    return out, meta


def reference_for_variant(out_dir, name, cfg):
    import numpy as np
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    from safetensors.torch import save_file

    root = os.path.join(out_dir, name)
    tensors = {}
    metas = {}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t, m = capture_run(root, cfg, dtype, tag)
        for k in ("input_ids", "attention_mask"):
            if k in tensors:
                assert torch.equal(tensors[k], t[k])
        tensors.update(t)
        metas[tag] = m

    W, H = cfg["width"], cfg["height"]
    steps, guidance = cfg.get("steps", STEPS), cfg.get("guidance", GUIDANCE)
    seq = (H // 16) * (W // 16)
    mu = compute_empirical_mu(image_seq_len=seq, num_steps=steps)
    assert metas["fp32"]["sigmas"] == metas["bf16"]["sigmas"]
    n_real = int(tensors["attention_mask"].sum())
    # the effective tau the timestep embedder sees per step: (timestep_arg.to(dtype)) * 1000 in that dtype
    tau = {}
    for tag, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        tau[tag] = [float((tensors[f"{tag}.dit.step{i}.timestep"].to(dt) * 1000).float().item()) for i in range(steps)]

    meta = {
        "variant": name,
        "prompt": cfg["prompt"],
        "width": W,
        "height": H,
        "seed": cfg["seed"],
        "steps": steps,
        "guidance_scale": guidance,
        "is_distilled": cfg.get("distilled", True),
        "max_sequence_length": MAX_SEQ,
        "text_encoder_out_layers": list(TEXT_LAYERS),
        "n_prompt_tokens": n_real,
        "image_seq_len": seq,
        "latent_grid_hw": [H // 16, W // 16],
        "mu": mu,
        "sigmas": metas["fp32"]["sigmas"],
        "timesteps": metas["fp32"]["timesteps"],
        "transformer_timestep_arg": {
            tag: [float(tensors[f"{tag}.dit.step{i}.timestep"].item()) for i in range(steps)] for tag in ("fp32", "bf16")
        },
        "transformer_effective_tau": tau,
        "noise": {
            "generator": f"torch.Generator('cpu').manual_seed({cfg['seed']})",
            "call": "diffusers.utils.torch_utils.randn_tensor(shape, generator=g, device=cpu, dtype=noise_dtype)",
            "shape": metas["fp32"]["noise_shape"],
            "drawn_as": "bfloat16 (the official bf16 pipeline's draw), injected into both precisions",
        },
        "dtypes": metas,
        "model": cfg,
        "versions": versions(),
    }
    # tidy non-JSON bits
    meta["model"] = json.loads(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())},
              os.path.join(out_dir, f"{name}_ref.safetensors"), metadata={"generator": "tools/oracle/make_klein_fixtures.py"})
    kt.dump_json(meta, os.path.join(out_dir, f"{name}_ref.json"))
    return meta


def reference_image_latents(out_dir, name, cfg):
    """A reference image through the pipeline's own encoding: an RGB image of the output size as
    u8 (what the image processor leaves a PIL image of that size: no resampling), scaled to
    [-1, 1] as VaeImageProcessor does, vae.encode's mode, patchified, batch-norm normalised and
    packed (prepare_image_latents), in fp32 and bf16. Written to <name>_refimage_ref.safetensors."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinPipeline
    from safetensors.torch import save_file

    root = os.path.join(out_dir, name)
    W, H = cfg["width"], cfg["height"]
    rng = np.random.default_rng(cfg["init_seed"] + 7)
    # Smooth content plus noise: a gradient the encoder's convs see structure in, every value used.
    yy, xx = np.mgrid[0:H, 0:W]
    base = np.stack([xx * 255.0 / W, yy * 255.0 / H, (xx + yy) * 127.0 / (W + H)], axis=-1)
    image_u8 = np.clip(base + rng.normal(0, 40, size=(H, W, 3)), 0, 255).astype(np.uint8)
    from PIL import Image

    pil = Image.fromarray(image_u8, "RGB")
    out = {"image_u8": torch.from_numpy(image_u8.copy())}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pipe = Flux2KleinPipeline.from_pretrained(root, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        multiple_of = pipe.vae_scale_factor * 2
        assert W % multiple_of == 0 and H % multiple_of == 0
        img = pipe.image_processor.preprocess(pil, height=H, width=W, resize_mode="crop")
        out[f"{tag}.image_in"] = img.detach().to(torch.float32).contiguous()
        x = img.to(dtype=pipe.vae.dtype)
        with torch.no_grad():
            mode = pipe.vae.encode(x).latent_dist.mode()
            packed, ids = pipe.prepare_image_latents(images=[img], batch_size=1, generator=None,
                                                     device=torch.device("cpu"), dtype=pipe.vae.dtype)
        out[f"{tag}.latents_mode"] = mode.detach().to(torch.float32).contiguous()
        out[f"{tag}.image_latents"] = packed.detach().to(torch.float32).contiguous()
        out["image_latent_ids"] = ids.to(torch.int64).contiguous()
        del pipe
    # The processor's scaling is exactly u8 / 255 * 2 - 1 in float32.
    want = torch.from_numpy(image_u8.astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2.0 - 1.0
    assert torch.equal(out["fp32.image_in"], want)
    save_file({k: v.contiguous() for k, v in sorted(out.items())},
              os.path.join(out_dir, f"{name}_refimage_ref.safetensors"),
              metadata={"generator": "tools/oracle/make_klein_fixtures.py"})


def reference_edit(out_dir, name, cfg):
    """Editing with two reference images through the official pipeline (image=[...], no width or
    height: the output takes the first reference's size). The references are written as PNGs
    (<name>_edit/ref0.png, ref1.png): ref0 72x70, which the image processor floors to 64x64 by a
    centre crop, ref1 64x96 as it is. Both precisions start from the bf16 draw of the seed.
    Writes <name>_edit_ref.safetensors and .json."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinPipeline
    from diffusers.utils.torch_utils import randn_tensor
    from PIL import Image
    from safetensors.torch import save_file

    root = os.path.join(out_dir, name)
    edit_dir = os.path.join(out_dir, f"{name}_edit")
    os.makedirs(edit_dir, exist_ok=True)
    rng = np.random.default_rng(cfg["init_seed"] + 11)
    refs = []
    for i, (w, h) in enumerate(((72, 70), (64, 96))):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255.0 / w, yy * 255.0 / h, np.full((h, w), 90.0 + 60 * i)], axis=-1)
        u8 = np.clip(base + rng.normal(0, 30, size=(h, w, 3)), 0, 255).astype(np.uint8)
        path = os.path.join(edit_dir, f"ref{i}.png")
        Image.fromarray(u8, "RGB").save(path)
        refs.append(path)
    prompt, seed, steps = "Turn the scene into a watercolour painting at night.", cfg["seed"] + 5, STEPS
    out = {}
    meta = {"prompt": prompt, "seed": seed, "steps": steps, "references": [os.path.basename(r) for r in refs]}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pipe = Flux2KleinPipeline.from_pretrained(root, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        images = [Image.open(r) for r in refs]
        W, H = 64, 64  # the first reference, floored to multiples of 16
        shape = (1, pipe.transformer.config.in_channels, H // 16, W // 16)
        noise = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), device=torch.device("cpu"),
                             dtype=torch.bfloat16).to(pipe.text_encoder.dtype)
        packed_noise = noise.reshape(1, shape[1], -1).permute(0, 2, 1)
        dit_calls, steps_out = [], []

        def dit_pre(mod, args, kwargs):
            dit_calls.append({k: kwargs[k].detach().clone() for k in ("hidden_states", "img_ids")})

        hook = pipe.transformer.register_forward_pre_hook(dit_pre, with_kwargs=True)
        orig_step = pipe.scheduler.step

        def step(model_output, timestep, sample, *a, **k):
            r = orig_step(model_output, timestep, sample, *a, **k)
            steps_out.append((r[0] if isinstance(r, tuple) else r.prev_sample).detach().clone())
            return r

        pipe.scheduler.step = step
        result = pipe(prompt=prompt, image=images, num_inference_steps=steps, guidance_scale=1.0,
                      latents=noise, max_sequence_length=MAX_SEQ, text_encoder_out_layers=TEXT_LAYERS,
                      output_type="pil")
        hook.remove()
        pipe.scheduler.step = orig_step
        image_u8 = np.asarray(result.images[0].convert("RGB"), dtype=np.uint8)
        assert image_u8.shape == (H, W, 3), image_u8.shape
        L = (H // 16) * (W // 16)
        first = dit_calls[0]
        assert torch.equal(first["hidden_states"][:, :L], packed_noise.to(first["hidden_states"].dtype))
        out[f"{tag}.noise"] = noise.detach().to(torch.float32).contiguous()
        out[f"{tag}.image_latents"] = first["hidden_states"][0, L:].detach().to(torch.float32).contiguous()
        out["img_ids"] = first["img_ids"][0].to(torch.int64).contiguous()
        for i, x in enumerate(steps_out):
            out[f"{tag}.step{i}.latents"] = x.detach().to(torch.float32).contiguous()
        out[f"{tag}.image_u8"] = torch.from_numpy(image_u8.copy())
        meta["width"], meta["height"] = W, H
        del pipe
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, os.path.join(out_dir, f"{name}_edit_ref.safetensors"),
              metadata={"generator": "tools/oracle/make_klein_fixtures.py"})
    kt.dump_json(meta, os.path.join(out_dir, f"{name}_edit_ref.json"))


def reference_inpaint(out_dir, name, cfg):
    """Inpainting through Flux2KleinInpaintPipeline. The image, 100x84, is resized (Lanczos, not
    cropped) to 96x80; the mask, 75x61 RGB with colours on both sides of the luminance threshold,
    is resized to 96x80, converted to L and binarised (mask_openai.png: the same area as the
    transparent pixels of an RGBA PNG, for the server's OpenAI edits), then bilinearly interpolated to the latent
    grid (values between 0 and 1 where its edges cross). The distilled variant adds a reference
    image (70x100, cropped to 64x96) and runs strength 0.6 of 4 steps (the schedule starts at
    step 1); the -base variant runs guidance 3.5 at strength 0.8 (all 4 steps). Each precision
    draws its own noise from the seed (the pipeline's randn in the model dtype); a third run, fp32
    from the bf16 draw, gives the official code's own bf16-vs-fp32 disagreement on the image
    (fp32_bf16_noise.image_u8). The meta's first_steps are get_timesteps' starts for a table of
    steps and strengths. Writes
    <name>_inpaint/{image,mask,reference}.png and <name>_inpaint_ref.safetensors and .json."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinInpaintPipeline
    from diffusers.utils import load_image
    from PIL import Image
    from safetensors.torch import save_file

    root = os.path.join(out_dir, name)
    distilled = cfg.get("distilled", True)
    case_dir = os.path.join(out_dir, f"{name}_inpaint")
    os.makedirs(case_dir, exist_ok=True)
    rng = np.random.default_rng(cfg["init_seed"] + 13)
    w, h = 100, 84
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255.0 / w, yy * 255.0 / h, (w - xx + yy) * 127.0 / (w + h)], axis=-1)
    image = np.clip(base + rng.normal(0, 30, size=(h, w, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(image, "RGB").save(os.path.join(case_dir, "image.png"))
    # The mask: blocks of colours whose luminance lies either side of 128, so the resize, the
    # grey conversion and the threshold each decide pixels.
    mw, mh = 75, 61
    colours = np.array([[255, 255, 255], [0, 0, 0], [200, 90, 60], [40, 160, 250], [130, 126, 128], [120, 130, 125]])
    blocks = rng.integers(0, len(colours), size=(6, 8))
    by = (np.arange(mh) * 6) // mh
    bx = (np.arange(mw) * 8) // mw
    mask = colours[blocks[by][:, bx]].astype(np.uint8)
    # The lower half speckled pixel by pixel, so the latent grid's sample points see mixed
    # neighbours (quarters, where the bf16 products round).
    speckle = rng.integers(0, len(colours), size=(mh - mh // 2, mw))
    mask[mh // 2:] = colours[speckle]
    Image.fromarray(mask, "RGB").save(os.path.join(case_dir, "mask.png"))
    # The same area as OpenAI's edits mark it: transparent where to repaint, over colours that
    # must not matter.
    grey = np.asarray(Image.fromarray(mask, "RGB").convert("L"))
    openai = np.concatenate([rng.integers(0, 256, size=(mh, mw, 3)), np.where(grey >= 128, 0, 255)[..., None]], axis=-1)
    Image.fromarray(openai.astype(np.uint8), "RGBA").save(os.path.join(case_dir, "mask_openai.png"))
    paths = {"image": os.path.join(case_dir, "image.png"), "mask": os.path.join(case_dir, "mask.png")}
    if distilled:
        rw, rh = 70, 100
        ry, rx = np.mgrid[0:rh, 0:rw]
        ref = np.stack([ry * 255.0 / rh, np.full((rh, rw), 200.0), rx * 255.0 / rw], axis=-1)
        ref = np.clip(ref + rng.normal(0, 25, size=(rh, rw, 3)), 0, 255).astype(np.uint8)
        paths["reference"] = os.path.join(case_dir, "reference.png")
        Image.fromarray(ref, "RGB").save(paths["reference"])
    prompt = "A red door in a white wall."
    seed, steps = cfg["seed"] + 9, STEPS
    strength = 0.6 if distilled else 0.8
    scale = 1.0 if distilled else 3.5
    meta = {"prompt": prompt, "seed": seed, "steps": steps, "strength": strength, "guidance_scale": scale,
            "files": {k: os.path.basename(v) for k, v in paths.items()}}
    out = {}
    import diffusers.pipelines.flux2.pipeline_flux2_klein_inpaint as inpaint_module

    original_randn = inpaint_module.randn_tensor

    def bf16_draw(shape, generator=None, device=None, dtype=None, layout=None):
        return original_randn(shape, generator=generator, device=device, dtype=torch.bfloat16).to(dtype)

    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp32_bf16_noise", torch.float32)):
        inpaint_module.randn_tensor = bf16_draw if tag == "fp32_bf16_noise" else original_randn
        pipe = Flux2KleinInpaintPipeline.from_pretrained(root, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        assert pipe.config.is_distilled == distilled
        dit_calls, after_steps = [], []

        def dit_pre(mod, args, kwargs):
            dit_calls.append({k: kwargs[k].detach().clone() for k in ("hidden_states", "img_ids", "timestep")})

        def on_step(p, i, t, kw):
            after_steps.append(kw["latents"].detach().clone())
            return {}

        orig_mask = pipe.prepare_mask_latents
        masks = []

        def prepare_mask_latents(*a, **k):
            m = orig_mask(*a, **k)
            masks.append(m.detach().clone())
            return m

        pipe.prepare_mask_latents = prepare_mask_latents
        hook = pipe.transformer.register_forward_pre_hook(dit_pre, with_kwargs=True)
        result = pipe(prompt=prompt, image=load_image(paths["image"]), mask_image=load_image(paths["mask"]),
                      image_reference=load_image(paths["reference"]) if distilled else None,
                      strength=strength, num_inference_steps=steps, guidance_scale=scale,
                      generator=torch.Generator("cpu").manual_seed(seed), max_sequence_length=MAX_SEQ,
                      text_encoder_out_layers=TEXT_LAYERS, callback_on_step_end=on_step, output_type="pil")
        hook.remove()
        inpaint_module.randn_tensor = original_randn
        image_u8 = np.asarray(result.images[0].convert("RGB"), dtype=np.uint8)
        H, W = image_u8.shape[:2]
        if tag == "fp32_bf16_noise":
            out[f"{tag}.image_u8"] = torch.from_numpy(image_u8.copy())
            first_steps = []
            for n, s in ((4, 0.6), (4, 0.8), (10, 0.3), (50, 0.8), (50, 0.35), (28, 1 / 3), (3, 0.0), (7, 1.0)):
                pipe.scheduler.set_timesteps(num_inference_steps=n, mu=1.0)
                _, run = pipe.get_timesteps(n, s, torch.device("cpu"))
                first_steps.append([n, s, n - run])
            meta["first_steps"] = first_steps
            import inspect

            params = inspect.signature(Flux2KleinInpaintPipeline.__call__).parameters
            meta["defaults"] = {k: params[k].default for k in ("strength", "guidance_scale")}
            del pipe
            continue
        assert (W, H) == (96, 80), (W, H)
        L = (H // 16) * (W // 16)
        m = masks[0][0, :, 0].to(torch.float32)
        assert (m == 0).any() and (m == 1).any() and ((m == 0.25) | (m == 0.75)).any(), m
        first = dit_calls[0]
        out[f"{tag}.mask_latents"] = m.contiguous()
        out[f"{tag}.initial_latents"] = first["hidden_states"][0, :L].to(torch.float32).contiguous()
        out[f"{tag}.condition_latents"] = first["hidden_states"][0, L:].to(torch.float32).contiguous()
        out["img_ids"] = first["img_ids"][0].to(torch.int64).contiguous()
        out[f"{tag}.timesteps"] = torch.stack([c["timestep"][0].to(torch.float32) for c in dit_calls[:: 2 if scale > 1 else 1]])
        for i, x in enumerate(after_steps):
            out[f"{tag}.step{i}.latents"] = x[0].to(torch.float32).contiguous()
        out[f"{tag}.image_u8"] = torch.from_numpy(image_u8.copy())
        meta["width"], meta["height"], meta["steps_run"] = W, H, len(after_steps)
        del pipe
    save_file({k: v.contiguous() for k, v in sorted(out.items())},
              os.path.join(out_dir, f"{name}_inpaint_ref.safetensors"),
              metadata={"generator": "tools/oracle/make_klein_fixtures.py"})
    kt.dump_json(meta, os.path.join(out_dir, f"{name}_inpaint_ref.json"))


def reference_kv(out_dir, name, cfg):
    """Flux2KleinKVPipeline (the -kv checkpoints) on the variant's weights: <name>_kv/ holds its
    model_index.json (the KV pipeline's class) beside links to the variant's components. Two
    references (80x64 and 64x80 PNGs in <name>_kv_refs/), 4 steps: step 0 runs the references'
    tokens (self-attending only, modulated at timestep 0) and caches their K/V per layer, later
    steps attend to the cache. Both precisions from the bf16 draw. Writes
    <name>_kv_ref.safetensors and .json."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinKVPipeline
    from diffusers.utils.torch_utils import randn_tensor
    from PIL import Image
    from safetensors.torch import save_file

    import diffusers

    root = os.path.join(out_dir, name)
    kv_dir = os.path.join(out_dir, f"{name}_kv")
    if os.path.isdir(kv_dir):
        shutil.rmtree(kv_dir)
    os.makedirs(kv_dir)
    index = json.load(open(os.path.join(root, "model_index.json")))
    index["_class_name"] = "Flux2KleinKVPipeline"
    index["_diffusers_version"] = diffusers.__version__
    kt.dump_json(index, os.path.join(kv_dir, "model_index.json"))
    for component in ("scheduler", "text_encoder", "tokenizer", "transformer", "vae"):
        os.symlink(os.path.join("..", name, component), os.path.join(kv_dir, component))
    refs_dir = os.path.join(out_dir, f"{name}_kv_refs")
    os.makedirs(refs_dir, exist_ok=True)
    rng = np.random.default_rng(cfg["init_seed"] + 17)
    refs = []
    for i, (w, h) in enumerate(((80, 64), (64, 80))):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([np.full((h, w), 60.0 + 90 * i), yy * 255.0 / h, xx * 255.0 / w], axis=-1)
        u8 = np.clip(base + rng.normal(0, 30, size=(h, w, 3)), 0, 255).astype(np.uint8)
        path = os.path.join(refs_dir, f"ref{i}.png")
        Image.fromarray(u8, "RGB").save(path)
        refs.append(path)
    prompt, seed, steps = "Make it a snowy morning.", cfg["seed"] + 3, STEPS
    out = {}
    meta = {"prompt": prompt, "seed": seed, "steps": steps, "references": [os.path.basename(r) for r in refs]}
    for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pipe = Flux2KleinKVPipeline.from_pretrained(kv_dir, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        W, H = 80, 64  # the first reference's size (multiples of 16 already)
        shape = (1, pipe.transformer.config.in_channels, H // 16, W // 16)
        noise = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), device=torch.device("cpu"),
                             dtype=torch.bfloat16).to(pipe.text_encoder.dtype)
        dit_calls, after_steps = [], []

        def dit_pre(mod, args, kwargs):
            dit_calls.append({k: kwargs[k] for k in ("hidden_states", "img_ids", "kv_cache_mode", "timestep",
                                                      "encoder_hidden_states", "txt_ids")})

        dit_out = []

        def dit_post(mod, args, kwargs, output):
            dit_out.append(output[0].detach().clone())

        def on_step(p, i, t, kw):
            after_steps.append(kw["latents"].detach().clone())
            return {}

        hook = pipe.transformer.register_forward_pre_hook(dit_pre, with_kwargs=True)
        post = pipe.transformer.register_forward_hook(dit_post, with_kwargs=True)
        result = pipe(prompt=prompt, image=[Image.open(r) for r in refs], num_inference_steps=steps, latents=noise,
                      max_sequence_length=MAX_SEQ, text_encoder_out_layers=TEXT_LAYERS,
                      callback_on_step_end=on_step, output_type="pil")
        hook.remove()
        post.remove()
        assert [c["kv_cache_mode"] for c in dit_calls] == ["extract"] + ["cached"] * (steps - 1)
        image_u8 = np.asarray(result.images[0].convert("RGB"), dtype=np.uint8)
        assert image_u8.shape == (H, W, 3), image_u8.shape
        L = (H // 16) * (W // 16)
        out[f"{tag}.noise"] = noise.detach().to(torch.float32).contiguous()
        out[f"{tag}.reference_latents"] = dit_calls[0]["hidden_states"][0, :-L].to(torch.float32).contiguous()
        out["img_ids"] = dit_calls[0]["img_ids"][0].to(torch.int64).contiguous()
        for i, x in enumerate(after_steps):
            out[f"{tag}.step{i}.latents"] = x[0].to(torch.float32).contiguous()
        # The transformer's inputs and velocities at the first two steps: the extract pass (the
        # references' tokens ahead of the image's) and the first one from the cache.
        out[f"{tag}.prompt_embeds"] = dit_calls[0]["encoder_hidden_states"][0].to(torch.float32).contiguous()
        out["txt_ids"] = dit_calls[0]["txt_ids"][0].to(torch.int64).contiguous()
        for i in range(2):
            out[f"{tag}.dit.step{i}.latents_in"] = dit_calls[i]["hidden_states"][0, -L:].to(torch.float32).contiguous()
            out[f"{tag}.dit.step{i}.timestep"] = dit_calls[i]["timestep"][:1].to(torch.float32).contiguous()
            out[f"{tag}.dit.step{i}.velocity"] = dit_out[i][0].to(torch.float32).contiguous()
            assert dit_out[i].shape[1] == L
        out[f"{tag}.image_u8"] = torch.from_numpy(image_u8.copy())
        meta["width"], meta["height"] = W, H
        del pipe
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, os.path.join(out_dir, f"{name}_kv_ref.safetensors"),
              metadata={"generator": "tools/oracle/make_klein_fixtures.py"})
    kt.dump_json(meta, os.path.join(out_dir, f"{name}_kv_ref.json"))


def write_config_keys(out_dir):
    """The settings each official class takes (its __init__'s parameters: what diffusers writes
    to config.json and reads back, what Qwen3Config accepts), for the test that holds every one
    to being honoured or refused. Writes klein_config_keys.json."""
    import inspect

    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config

    def keys(cls):
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]

    kt.dump_json({"transformer": keys(Flux2Transformer2DModel), "vae": keys(AutoencoderKLFlux2),
                  "scheduler": keys(FlowMatchEulerDiscreteScheduler), "text_encoder": keys(Qwen3Config),
                  "pipeline": keys(Flux2KleinPipeline), "versions": versions()},
                 os.path.join(out_dir, "klein_config_keys.json"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures"))
    ap.add_argument("--only-tokenizer", action="store_true", help="write tokenizers + tokenizer_cases.json only")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--only-config-keys", action="store_true", help="write klein_config_keys.json only")
    ap.add_argument("--only-kv", action="store_true", help="write <variant>_kv* for existing kv variant folders only")
    ap.add_argument("--only-inpainting", action="store_true",
                    help="write <variant>_inpaint_ref.* for existing variant folders only")
    ap.add_argument("--only-reference-images", action="store_true",
                    help="write <variant>_refimage_ref.safetensors for existing variant folders only")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(args.out, exist_ok=True)

    if args.only_tokenizer:
        for name in VARIANTS:
            write_tokenizer(os.path.join(args.out, name, "tokenizer"), VARIANTS[name])
        make_tokenizer_cases(args.out)
        print("wrote tokenizers and tokenizer_cases.json")
        return

    if args.only_config_keys:
        write_config_keys(args.out)
        return

    if args.only_kv:
        for name in args.variants:
            reference_kv(args.out, name, VARIANTS[name])
        return

    if args.only_inpainting:
        for name in args.variants:
            reference_inpaint(args.out, name, VARIANTS[name])
        return

    if args.only_reference_images:
        for name in args.variants:
            reference_image_latents(args.out, name, VARIANTS[name])
            if VARIANTS[name].get("distilled", True):
                reference_edit(args.out, name, VARIANTS[name])
        return

    for name in args.variants:
        build_variant(args.out, name, VARIANTS[name])
    make_tokenizer_cases(args.out)
    write_config_keys(args.out)
    for name in args.variants:
        m = reference_for_variant(args.out, name, VARIANTS[name])
        reference_image_latents(args.out, name, VARIANTS[name])
        if VARIANTS[name].get("kv"):
            reference_kv(args.out, name, VARIANTS[name])
        else:
            if VARIANTS[name].get("distilled", True):
                reference_edit(args.out, name, VARIANTS[name])
            reference_inpaint(args.out, name, VARIANTS[name])
        print(name, "mu", m["mu"], "sigmas", m["sigmas"], "tokens", m["n_prompt_tokens"])


if __name__ == "__main__":
    main()
