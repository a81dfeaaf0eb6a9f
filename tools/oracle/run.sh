#!/usr/bin/env bash
# Regenerate the committed oracle fixtures under tests/fixtures/ with the official
# diffusers/transformers implementation of FLUX.2 [klein].
#
#   tools/oracle/run.sh                 # venv in build/oracle-venv (created/reused)
#   APUS_ORACLE_VENV=/path tools/oracle/run.sh
#   tools/oracle/run.sh --only-tokenizer
#
# Needs python3 (3.11 was used) and PyPI access for the first install (torch pulls its
# CUDA runtime wheels from PyPI, ~3 GB; nothing runs on a GPU). CPU only, single thread,
# takes ~10 s once the venv exists. Output is byte-for-byte deterministic.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${APUS_ORACLE_VENV:-$REPO/build/oracle-venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "oracle: creating venv $VENV" >&2
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$HERE/requirements.txt"

# Each script runs under trace_draws.py, which records its torch draws for fixture_recipes.py (the
# weight files are committed as recipes of those draws; the last step below).
DRAWS="$REPO/build/oracle-draws"
mkdir -p "$DRAWS"
oracle() { local script=$1; shift; "$VENV/bin/python" "$HERE/trace_draws.py" "$DRAWS/$script.pkl" "$HERE/$script.py" "$@"; }

export PYTHONHASHSEED=0 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
oracle make_klein_fixtures --out "$REPO/tests/fixtures" "$@"
# klein_tiny_a's text encoder cut to its deepest tap (tests/fixtures/klein_last_tap_ref.*)
[ "$*" = "--only-tokenizer" ] || oracle make_klein_last_tap_fixtures --out "$REPO/tests/fixtures"
# T5Gemma's Gemma SentencePiece tokenizer (tests/fixtures/t5gemma_tok, t5gemma_tokenizer_cases.json)
oracle make_t5gemma_tokenizer --out "$REPO/tests/fixtures"
# ... and its encoder (tests/fixtures/t5gemma_tiny, t5gemma_tiny_ref.*), fed by that tokenizer
oracle make_t5gemma_fixtures --out "$REPO/tests/fixtures"
# Stable Audio 3 stages with diffusers' classes (tests/fixtures/sa3_tiny, sa3_tiny_ref.safetensors)
oracle make_sa3_fixtures --out "$REPO/tests/fixtures"
# Stable Audio 3's DiT and SAME-L decoder from the official code (tests/fixtures/sa3_tiny/{dit_*,same_l},
# sa3_dit_ref.safetensors, sa3_same_ref.safetensors):
# needs a checkout of github.com/Stability-AI/stable-audio-3 (commit 636f906 was used)
if [ -n "${APUS_SA3_OFFICIAL:-}" ]; then
    oracle make_sa3_official_fixtures --out "$REPO/tests/fixtures"
    # the official schedules for 1..200 steps (sa3_sigmas_ref.*; needs torch's AVX-512 kernels)
    oracle make_sa3_sigmas --out "$REPO/tests/fixtures"
    # LoRA and DoRA files made and loaded by the official code, one in PEFT's layout, and the
    # official clips with them (tests/fixtures/sa3_lora)
    oracle make_sa3_lora_fixtures --out "$REPO/tests/fixtures"
else
    echo "oracle: APUS_SA3_OFFICIAL unset, keeping the committed official Stable Audio 3 fixtures" >&2
fi
# sa3.cpp's GGUF files of those tiny official checkpoints (tests/fixtures/sa3_gguf)
oracle make_sa3_gguf_fixtures --out "$REPO/tests/fixtures"
# torch CPU randn fixtures (tests/fixtures/torch_randn.*), when that generator is present
if [ -f "$HERE/make_rng_fixtures.py" ] && [ "$*" != "--only-tokenizer" ]; then
    oracle make_rng_fixtures
fi
# GGUF block formats from gguf-py (tests/fixtures/gguf) and klein_tiny_a's transformer as BFL's
# single file, its VAE in BFL's names and a Q8_0 GGUF (tests/fixtures/klein_single), checked against
# diffusers' converters; LoRAs in three layouts and diffusers' images with them, LoHa and LoKr and
# PEFT's images with them (tests/fixtures/klein_lora); the DiT and text encoder in ComfyUI's
# quantised layouts by comfy-kitchen, with its dequantisation (tests/fixtures/klein_single)
if [ "$*" != "--only-tokenizer" ]; then
    oracle make_gguf_fixtures --out "$REPO/tests/fixtures"
    oracle make_klein_single_file_fixtures --out "$REPO/tests/fixtures"
    oracle make_comfy_quant_fixtures --out "$REPO/tests/fixtures"
    oracle make_klein_lora_fixtures --out "$REPO/tests/fixtures"
    oracle make_klein_lycoris_fixtures --out "$REPO/tests/fixtures"
fi
# The weight files as recipes of the recorded draws (every script's: run with APUS_SA3_OFFICIAL set)
[ "$*" = "--only-tokenizer" ] || "$VENV/bin/python" "$HERE/fixture_recipes.py" "$DRAWS"/*.pkl
# safetensors writes files 0600; make them readable like every other fixture
find "$REPO/tests/fixtures" -type f -exec chmod 644 {} +
