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
