"""klein's text encoder where the deepest tap is the last hidden state (tests/fixtures/klein_last_tap_ref.*).

klein_tiny_a's Qwen3 cut to 27 layers, so the pipeline's taps (9, 18, 27) end on
hidden_states[num_hidden_layers], which transformers fills with the final norm's output
(last_hidden_state) rather than the last layer's. The prompt embeddings come from diffusers'
Flux2KleinPipeline._get_qwen3_prompt_embeds itself, over 64 tokens (the encoder is the same at any
length; the fixture stays small), in fp32 and bf16. The 27-layer config.json is kept in the
reference's JSON; the test lays it over klein_tiny_a's weights (layer 27's are left unread).

    python make_klein_last_tap_fixtures.py --out tests/fixtures
"""

import argparse
import json
import os
import tempfile

import oracle_env
import torch
from diffusers import Flux2KleinPipeline
from safetensors.torch import save_file
from transformers import Qwen2TokenizerFast, Qwen3ForCausalLM

LAYERS = 27
MAX_SEQ = 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=oracle_env.FIXTURES)
    args = ap.parse_args()
    src = os.path.join(args.out, "klein_tiny_a")
    meta = json.load(open(os.path.join(args.out, "klein_tiny_a_ref.json")))
    taps = meta["text_encoder_out_layers"]
    assert max(taps) == LAYERS, taps
    config = json.load(open(os.path.join(src, "text_encoder", "config.json")))
    config["num_hidden_layers"] = LAYERS
    config["layer_types"] = config["layer_types"][:LAYERS]
    tokenizer = Qwen2TokenizerFast.from_pretrained(os.path.join(src, "tokenizer"))
    ref = {}
    with tempfile.TemporaryDirectory() as te_dir:
        for f in os.listdir(os.path.join(src, "text_encoder")):
            if f != "config.json":
                os.symlink(os.path.abspath(os.path.join(src, "text_encoder", f)), os.path.join(te_dir, f))
        with open(os.path.join(te_dir, "config.json"), "w") as f:
            json.dump(config, f)
        for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            encoder = Qwen3ForCausalLM.from_pretrained(te_dir, torch_dtype=dtype).eval()
            assert encoder.config.num_hidden_layers == LAYERS
            with torch.no_grad():
                embeds = Flux2KleinPipeline._get_qwen3_prompt_embeds(
                    encoder, tokenizer, meta["prompt"], max_sequence_length=MAX_SEQ, hidden_states_layers=taps)
            ref[f"{tag}.prompt_embeds"] = embeds.float().contiguous()
            # The tokenisation the embeddings came from; hidden_states[27] is the final norm's output.
            inputs = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": meta["prompt"]}], tokenize=False,
                                                             add_generation_prompt=True, enable_thinking=False),
                               return_tensors="pt", padding="max_length", truncation=True, max_length=MAX_SEQ)
            with torch.no_grad():
                out = encoder.model(**inputs, output_hidden_states=True, use_cache=False)
            assert torch.equal(out.hidden_states[LAYERS], out.last_hidden_state)
            ref["input_ids"] = inputs["input_ids"][0].to(torch.int64).contiguous()
            ref["attention_mask"] = inputs["attention_mask"][0].to(torch.int64).contiguous()
    save_file(ref, os.path.join(args.out, "klein_last_tap_ref.safetensors"))
    os.chmod(os.path.join(args.out, "klein_last_tap_ref.safetensors"), 0o644)
    with open(os.path.join(args.out, "klein_last_tap_ref.json"), "w") as f:
        json.dump({"variant": "klein_tiny_a", "prompt": meta["prompt"], "max_sequence_length": MAX_SEQ,
                   "text_encoder_out_layers": taps, "text_encoder_config": config}, f, indent=1)
    print(f"klein last tap: {LAYERS} layers, taps {taps}, {int(ref['attention_mask'].sum())} of {MAX_SEQ} tokens real")


if __name__ == "__main__":
    main()
