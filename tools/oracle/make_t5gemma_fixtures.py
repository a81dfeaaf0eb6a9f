"""Tiny random-weight T5Gemma encoder fixtures with transformers' own classes.

Stable Audio 3 encodes its prompt with the encoder of google/t5gemma-b-b-ul2. This builds a small
T5GemmaEncoderModel with the same structure (sandwich Gemma RMSNorms, GeGLU gelu-tanh, RoPE,
logit softcap 50, sliding and full layers, grouped kv heads), saves it in the published layout
(config.json + model.safetensors, fp32), and runs two prompts of the tiny Gemma tokenizer
(tests/fixtures/t5gemma_tok, made by make_t5gemma_tokenizer.py) as one padded batch in fp32 and
in bf16, writing tests/fixtures/t5gemma_tiny/ and t5gemma_tiny_ref.safetensors. Weights are drawn
wide enough that the softcap's tanh bends. Deterministic.
"""

import argparse
import json
import os

import oracle_env  # noqa: F401  (environment before torch/transformers load)
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, T5GemmaConfig, T5GemmaEncoderModel

PROMPTS = ["warm lo-fi hip hop, vinyl crackle, 84 bpm", "a door slams shut"]
MAX_LENGTH = 16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=oracle_env.FIXTURES)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    tok = AutoTokenizer.from_pretrained(os.path.join(args.out, "t5gemma_tok"))
    module = dict(vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  hidden_activation="gelu_pytorch_tanh", max_position_embeddings=512,
                  rms_norm_eps=1e-6, query_pre_attn_scalar=64, sliding_window=4096,
                  layer_types=["sliding_attention", "full_attention"],
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config = T5GemmaConfig(encoder=module, decoder=module, is_encoder_decoder=False,
                           vocab_size=600)
    model = T5GemmaEncoderModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.35)
    out_dir = os.path.join(args.out, "t5gemma_tiny")
    oracle_env.save_pretrained_readable(model, out_dir)

    batch = tok(PROMPTS, padding="max_length", max_length=MAX_LENGTH, truncation=True,
                add_special_tokens=False, return_tensors="pt")
    ref = {"input_ids": batch["input_ids"].to(torch.int64).contiguous(),
           "attention_mask": batch["attention_mask"].to(torch.int64).contiguous()}
    with torch.no_grad():
        fp32 = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        ref["fp32.last_hidden_state"] = fp32.last_hidden_state.float().contiguous()
        bf16_model = T5GemmaEncoderModel.from_pretrained(out_dir, dtype=torch.bfloat16).eval()
        bf16 = bf16_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        ref["bf16.last_hidden_state"] = bf16.last_hidden_state.float().contiguous()
    save_file(ref, os.path.join(args.out, "t5gemma_tiny_ref.safetensors"))
    with open(os.path.join(args.out, "t5gemma_tiny_ref.json"), "w") as f:
        json.dump({"prompts": PROMPTS, "max_length": MAX_LENGTH,
                   "attn_implementation": bf16_model.config._attn_implementation}, f, indent=1)
    diff = (ref["bf16.last_hidden_state"] - ref["fp32.last_hidden_state"]).norm() / ref[
        "fp32.last_hidden_state"].norm()
    print(f"t5gemma tiny: attention {bf16_model.config._attn_implementation}, "
          f"bf16 vs fp32 rel L2 {diff:.3e}, keys {sorted(model.state_dict())[:3]}")


if __name__ == "__main__":
    main()
