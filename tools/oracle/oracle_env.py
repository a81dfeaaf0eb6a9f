"""What every oracle script shares: offline, quiet Hugging Face libraries and the repo's paths.

Import it before torch, diffusers or transformers so the environment is set when they load.
"""

import os

for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                   ("TOKENIZERS_PARALLELISM", "false"), ("DIFFUSERS_VERBOSITY", "error"),
                   ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(key, value)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(REPO, "tests", "fixtures")


def save_pretrained_readable(model, out_dir):
    """save_pretrained in safetensors, files made world-readable like every other fixture."""
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, f), 0o644)


def official_sa3_args(script):
    """The script's --out, with the official Stable Audio 3 code (a checkout of
    Stability-AI/stable-audio-3 named by APUS_SA3_OFFICIAL) made importable."""
    import argparse
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=FIXTURES)
    args = ap.parse_args()
    official = os.environ.get("APUS_SA3_OFFICIAL")
    if not official:
        sys.exit(f"{script}: set APUS_SA3_OFFICIAL to a checkout of Stability-AI/stable-audio-3")
    sys.path.insert(0, official)
    return args
