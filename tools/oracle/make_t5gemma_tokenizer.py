"""A tiny Gemma-format SentencePiece tokenizer and what HF's GemmaTokenizer makes of it.

Stable Audio 3 encodes prompts with T5Gemma's tokenizer (Gemma's SentencePiece BPE: byte
fallback, digits split, no dummy prefix, whitespace kept, pad 0 / eos 1 / bos 2 / unk 3). The real
file cannot be fetched here, so this trains a small model with the same settings, loads it through
transformers' GemmaTokenizer the way the pipeline does (a folder holding tokenizer.model), and
records the ids HF gives for a set of prompts, unpadded and padded to a short max_length, next to
what SentencePiece itself gives. Writes tests/fixtures/t5gemma_tok/ and
tests/fixtures/t5gemma_tokenizer_cases.json; deterministic.
"""

import argparse
import json
import os
import random
import shutil
import tempfile

import oracle_env  # noqa: F401  (environment before transformers loads)
import sentencepiece as spm
from transformers import AutoTokenizer

MAX_LENGTH = 16

CORPUS_WORDS = (
    "warm lo-fi hip hop vinyl crackle bpm slow ambient pad drone synth bass drum kick snare "
    "hi-hat guitar piano strings orchestra choir rain thunder footsteps door wind birds city "
    "traffic engine explosion laser glitch techno house trance dubstep jazz swing funk soul "
    "the a of and with in on at for from to by reverb delay distortion tape saturation"
).split()

CASES = [
    "warm lo-fi hip hop, vinyl crackle, 84 bpm",
    "Ambient drone with slow evolving pads",
    "a door slams shut, then footsteps on gravel",
    "120 bpm techno kick   and  hats",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\nhere",
    "digits 0123456789 and 3.14159",
    "unicode: café naïve — “quotes” and ümlauts",
    "emoji 🎹🥁 and CJK 音楽 ピアノ",
    "<start_of_turn>user a beat<end_of_turn>",
    "x",
    "",
    "a very long prompt that will certainly need truncation because it keeps going with many "
    "words about drums bass synths pads strings choirs rain wind and more",
]


def random_cases(n):
    """Strings mixing what prompts hold: words, digits, punctuation, whitespace runs, accents,
    symbols outside the tiny vocabulary (byte fallback), CJK and emoji."""
    rng = random.Random(1)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789.,;:!?-'\"()[]/&%") + [
        "  ", "   ", "\t", "\n", "é", "ü", "ß", "ñ", "—", "…", "€", "音", "楽", "ピ", "🎹", "🥁",
        "\u00a0", "\u200b", "<", ">", "_", "▁"] + CORPUS_WORDS
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def train(model_dir):
    rng = random.Random(0)
    lines = []
    for _ in range(3000):
        n = rng.randint(3, 14)
        words = [rng.choice(CORPUS_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(40, 180)))
        if rng.random() < 0.2:
            words.insert(0, " ")
        lines.append(" ".join(words).capitalize())
    corpus = os.path.join(model_dir, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    # Gemma's trainer settings, at a toy vocabulary size.
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=os.path.join(model_dir, "tokenizer"),
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        split_by_whitespace=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return os.path.join(model_dir, "tokenizer.model")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=oracle_env.FIXTURES)
    args = ap.parse_args()
    out_dir = os.path.join(args.out, "t5gemma_tok")
    # A fixed scratch path: the model records its training paths in its trainer spec.
    tmp = os.path.join(tempfile.gettempdir(), "apus_t5gemma_tokenizer")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model_path = train(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    shutil.copy(model_path, os.path.join(out_dir, "tokenizer.model"))
    shutil.rmtree(tmp)
    # As T5Gemma ships it: GemmaTokenizer, no BOS/EOS added; padding side stated explicitly.
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GemmaTokenizer", "add_bos_token": False,
                   "add_eos_token": False, "padding_side": "right",
                   "model_max_length": 256, "pad_token": "<pad>", "eos_token": "<eos>",
                   "bos_token": "<bos>", "unk_token": "<unk>"}, f, indent=2)
    tok = AutoTokenizer.from_pretrained(out_dir)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out_dir, "tokenizer.model"))
    cases = []
    for text in CASES + random_cases(300):
        hf_ids = tok(text, add_special_tokens=False)["input_ids"]
        padded = tok(text, padding="max_length", max_length=MAX_LENGTH, truncation=True,
                     add_special_tokens=False)
        cases.append({"text": text, "ids": hf_ids, "spm_ids": sp.encode(text),
                      "padded_ids": padded["input_ids"], "mask": padded["attention_mask"]})
    # Without padding_side in tokenizer_config.json transformers 5's GemmaTokenizer pads on the
    # left: record that default on a copy whose config leaves it out.
    with tempfile.TemporaryDirectory() as bare:
        shutil.copy(os.path.join(out_dir, "tokenizer.model"), bare)
        with open(os.path.join(bare, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GemmaTokenizer", "add_bos_token": False,
                       "add_eos_token": False}, f)
        default_tok = AutoTokenizer.from_pretrained(bare)
        default_side = default_tok.padding_side
        for c in cases[:4]:
            c["default_side_padded_ids"] = default_tok(
                c["text"], padding="max_length", max_length=MAX_LENGTH, truncation=True,
                add_special_tokens=False)["input_ids"]
    head = {"max_length": MAX_LENGTH, "tokenizer_class": type(tok).__name__,
            "padding_side": tok.padding_side, "default_padding_side": default_side,
            "vocab_size": sp.get_piece_size()}
    with open(os.path.join(args.out, "t5gemma_tokenizer_cases.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    disagree = [c["text"] for c in cases if c["ids"] != c["spm_ids"]]
    print(f"t5gemma tokenizer: {len(cases)} cases, HF vs SentencePiece disagree on {len(disagree)}:",
          disagree)


if __name__ == "__main__":
    main()
