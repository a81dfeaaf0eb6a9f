"""Build a tiny but real-format Qwen2/Qwen3 byte-level BPE tokenizer.

The files written mirror the layout of the published FLUX.2-klein tokenizer/ folder
(tokenizer.json + tokenizer_config.json, class Qwen2Tokenizer): same normalizer,
pre-tokenizer (Qwen2 split regex + ByteLevel without regex), decoder, post-processor,
the same 26 added tokens in the same order (ids follow the regular vocabulary), and
Qwen3's chat template.  Only the vocabulary / merges are small, trained here on a
fixed, generated corpus so the result is deterministic.

Only needs the `tokenizers` package (plus `json`), so it can run before torch is
installed.
"""

import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))

# Qwen2's pre-tokenisation regex, exactly as in Qwen2/Qwen3 tokenizer.json.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (content, special) in Qwen3's order (151643.. in the real model).
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

ADDITIONAL_SPECIAL = [t for t, s in ADDED_TOKENS if s and t != "<|endoftext|>"]

VOCAB_SIZE = 3000  # regular (BPE) vocabulary; added tokens come after

_ENGLISH = """
A photograph of a red fox sitting in tall grass at sunrise, soft golden light, shallow depth of field.
The quick brown fox jumps over the lazy dog while the cat watches from the window sill.
An astronaut riding a horse on the moon, highly detailed, cinematic lighting, 35mm film grain.
A cozy wooden cabin in a snowy forest at night, warm light glowing from the windows, stars above.
Portrait of an old fisherman with a white beard, wearing a yellow raincoat, dramatic studio lighting.
A bowl of ramen with a soft boiled egg, green onions and slices of pork, steam rising, top-down view.
Watercolor painting of a lighthouse on a rocky cliff, waves crashing, seagulls flying overhead.
A futuristic city skyline with neon signs reflecting on wet streets after the rain, cyberpunk style.
Don't forget: I'll be there at 5 o'clock, and we're going to the museum; they've said it's free!
It's a beautiful day, isn't it? She'd like to know what you're doing, and he's been waiting since noon.
The sign says "hello world" in big blue letters; below it, a smaller note reads (open 24/7).
Close-up macro shot of a dewdrop on a spider web, bokeh background, morning mist, ultra sharp.
A small robot watering plants in a greenhouse, pastel colors, isometric 3D render, octane render.
An oil painting of a sailing ship in a storm, in the style of the old masters, dark and moody.
Minimalist logo of a mountain and a river, flat vector design, two colors, white background.
A children's book illustration of a bear reading a book under a tree, whimsical and friendly.
Street food market in the evening, lanterns, crowds of people, smoke from the grills, vivid colors.
A knight in shining armor standing before a castle gate, banners waving in the wind, epic scale.
Aerial view of rice terraces in the mountains, green and gold patterns, early morning fog.
A glass of iced coffee on a marble table, condensation droplets, natural window light, product photo.
Hyperrealistic render of a chrome sphere floating above a checkerboard floor, studio reflections.
The committee will review the proposal on Monday; questions should be sent before Friday evening.
Temperature: 21.5 degrees, humidity 43%, wind 12 km/h from the north-west -- a pleasant afternoon.
Once upon a time, in a kingdom far away, there lived a princess who loved to build machines.
Engineers measured the bridge: 1,250 meters long, 35 meters high, completed in 1998 after six years.
Please write the function carefully; tests compare every tensor against the reference values.
"""

_WORDS = (
    "apple banana cherry dragon eagle falcon garden harbor island jungle kettle lantern meadow night ocean "
    "palace quartz river silver thunder umbrella valley winter xylophone yellow zebra bright dark heavy light "
    "ancient modern tiny enormous quiet loud gentle fierce golden crimson emerald azure violet amber ivory "
    "painting drawing sketch render photo image picture scene landscape portrait texture pattern shadow "
    "reflection sunlight moonlight candle flame smoke cloud storm rain snow wind leaf flower tree forest "
    "mountain desert canyon glacier volcano beach wave shore cliff bridge tower castle temple village city "
    "street road train station airport ship boat car bicycle horse dog cat bird fish butterfly dragonfly "
    "person woman man child girl boy friend family teacher doctor artist musician dancer soldier farmer "
    "walking running jumping flying swimming sitting standing reading writing singing laughing sleeping "
    "detailed realistic stylized abstract surreal cinematic dramatic soft sharp blurry vibrant muted warm cold "
    "wooden metal glass stone paper fabric leather plastic ceramic crystal marble concrete velvet silk "
    "morning evening midnight afternoon spring summer autumn season century history future science nature "
    "because although however therefore meanwhile perhaps already always never sometimes everywhere nothing "
    "the a an of in on at to for with from by about under over between through during without within "
    "is are was were be been being have has had do does did will would shall should can could may might must "
    "this that these those there here where when what which who whom whose why how all any each every some "
    "transformer encoder decoder tokenizer attention embedding latent diffusion scheduler sigma timestep "
    "velocity gradient tensor matrix vector kernel channel pixel resolution sample noise seed prompt"
)

_CJK = [
    "一只可爱的小猫坐在窗台上，看着外面的雨。",
    "春天的樱花在公园里盛开，人们在树下野餐。",
    "山上的古老寺庙被云雾环绕，显得非常神秘。",
    "夜晚的城市灯火通明，街道上车水马龙。",
    "这是一幅美丽的风景画，画中有河流、森林和远山。",
    "今日は天気がいいので、公園で散歩しましょう。",
    "東京の夜景はとても綺麗です。カメラで写真を撮りました。",
    "ラーメンと寿司が大好きです。",
    "오늘은 날씨가 정말 좋네요. 산책하러 갈까요?",
    "서울의 밤거리는 아름답습니다.",
    "Приветствую! Это тестовая строка на русском языке.",
    "Ελληνικά γράμματα: αλφα βήτα γάμμα δέλτα.",
    "Café crème brûlée, naïve façade, jalapeño, Zürich, São Paulo, Ångström, coöperate.",
    "مرحبا بالعالم، هذه جملة عربية قصيرة.",
    "नमस्ते दुनिया, यह एक छोटा वाक्य है।",
]

_EMOJI = "😀 😃 😄 😁 😆 😅 🤣 😂 🙂 😉 😊 😍 🥰 😘 🤔 🤖 👍 👋 🙏 💡 🔥 ✨ 🌟 ⭐ 🌈 ☀️ 🌙 ❤️ 💙 💚 🎨 🎉 🐱 🐶 🦊 🐼 🍕 🍜 🍣 ☕ 🚀 🛸 🏔️ 🌊 👨‍👩‍👧 🏳️‍🌈"

_PUNCT = [
    "!!!", "???", "...", "…", "--", "---", "==>", "<=>", "->", "=>", "::", ";;", "()", "[]", "{}", "<>",
    "/* comment */", "// note", "#include <stdio.h>", "x += 1;", "a == b && c != d || e <= f",
    "100%", "$9.99", "€12,50", "¥1000", "#hashtag", "@user", "e-mail: test@example.com",
    "https://example.com/path?query=1&x=2", "(a, b, c)", "\"quoted\"", "'single'", "«guillemets»",
    "~!@#$%^&*()_+", "¡Hola! ¿Qué tal?", "—em dash—", "• bullet", "→ arrow ←", "™ © ®",
]


def _corpus():
    rng = random.Random(1234)
    lines = [l for l in _ENGLISH.strip().split("\n")]
    words = _WORDS.split()
    for _ in range(1500):
        n = rng.randint(4, 14)
        ws = [rng.choice(words) for _ in range(n)]
        if rng.random() < 0.3:
            ws[0] = ws[0].capitalize()
        if rng.random() < 0.1:
            ws[rng.randrange(n)] = ws[rng.randrange(n)].upper()
        sep = rng.choice([" ", " ", " ", ", ", " - ", "  "])
        s = sep.join(ws) + rng.choice([".", ",", "!", "?", ";", ":", "", "..."])
        if rng.random() < 0.2:
            s += " " + str(rng.randint(0, 99999))
        if rng.random() < 0.1:
            s += " " + rng.choice(_EMOJI.split())
        lines.append(s)
    lines.extend(_CJK)
    for sent in _CJK:
        chars = [c for c in sent if not c.isspace()]
        for _ in range(40):
            lines.append("".join(rng.choice(chars) for _ in range(rng.randint(2, 10))))
    emo = _EMOJI.split()
    for _ in range(200):
        lines.append(" ".join(rng.choice(emo) for _ in range(rng.randint(1, 6))))
    for _ in range(100):
        lines.append(" ".join(rng.choice(_PUNCT) for _ in range(rng.randint(1, 5))))
    for _ in range(100):
        ind = rng.choice(["", "    ", "\t", "        ", "\t\t"])
        lines.append(ind + rng.choice(["if (x) {", "return y;", "}", "for i in range(10):", "pass"]) + "\n")
        lines.append("\n" * rng.randint(1, 3))
    for _ in range(200):
        lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 8))) for _ in range(rng.randint(1, 5))))
    return lines


def train_bpe():
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tokenizer_json(merges_as_strings=True):
    """Return the tokenizer.json dict in the exact structure of Qwen2/Qwen3's file."""
    tok = train_bpe()
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    merges = raw["model"]["merges"]
    n = len(vocab)
    assert sorted(vocab.values()) == list(range(n))
    # Re-emit the vocabulary ordered by id (tokenizers already does, but make it explicit).
    vocab = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    merges = [m if isinstance(m, list) else m.split(" ") for m in merges]
    if merges_as_strings:
        merges = [" ".join(m) for m in merges]
    added = []
    for i, (content, special) in enumerate(ADDED_TOKENS):
        added.append(
            {
                "id": n + i,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
        )
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
                dict(bl),
            ],
        },
        "post_processor": dict(bl),
        "decoder": dict(bl),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def chat_template():
    with open(os.path.join(HERE, "qwen3_chat_template.jinja"), encoding="utf-8") as f:
        return f.read()


def build_tokenizer_config(tj):
    decoder = {}
    for t in tj["added_tokens"]:
        decoder[str(t["id"])] = {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t["special"],
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(ADDITIONAL_SPECIAL),
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 40960,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def dump_json(obj, path, indent=2):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def write_tokenizer_dir(out_dir, merges_as_strings=True):
    """Write tokenizer.json and tokenizer_config.json; return (tokenizer.json dict, total vocab size)."""
    os.makedirs(out_dir, exist_ok=True)
    tj = build_tokenizer_json(merges_as_strings=merges_as_strings)
    dump_json(tj, os.path.join(out_dir, "tokenizer.json"))
    dump_json(build_tokenizer_config(tj), os.path.join(out_dir, "tokenizer_config.json"))
    total = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    return tj, total


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tok_test"
    tj, total = write_tokenizer_dir(out)
    print("vocab", len(tj["model"]["vocab"]), "merges", len(tj["model"]["merges"]), "total", total)
