#!/usr/bin/env bash
# Writes what a refactor must leave unchanged into OUT: `apus roofline --json` of every published
# layout, fixed-seed renders of the tiny fixtures (klein: text-to-image, guidance, editing,
# inpainting; SA3: both layouts, both precisions, audio-to-audio, inpainting, guidance) and their
# sha256 sums. Run it before and after, then `diff -r BEFORE AFTER`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="$(realpath -m "${1:?usage: tools/behaviour-snapshot.sh OUT [APUS]}")"
apus="$(realpath "${2:-build/apus}")"
fx="$PWD/tests/fixtures"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

for m in flux2-klein-4b flux2-klein-9b flux2-klein-9b-kv; do
  "$apus" roofline --model "$m" -W 512 -H 512 --json > "$out/roofline-$m-512.json"
  "$apus" roofline --model "$m" -W 1024 -H 768 --steps 8 --chip h200 --json > "$out/roofline-$m-1024x768.json"
done
for m in stable-audio-3-medium stable-audio-3-small-music stable-audio-3-small-sfx; do
  "$apus" roofline --model "$m" --seconds 30 --json > "$out/roofline-$m-30.json"
  "$apus" roofline --model "$m" --seconds 95.5 --steps 12 --chip h200 --json > "$out/roofline-$m-95.json"
done

# SA3's tiny model in both layouts, as tests/sa3_fixtures.h assembles them.
official="$work/sa3_official" diffusers="$work/sa3_diffusers"
mkdir -p "$official/t5gemma-b-b-ul2" "$diffusers"
ln -s "$fx/sa3_tiny/original/model_config.json" "$fx/sa3_tiny/original/model.safetensors" "$official/"
for f in config.json model.safetensors; do ln -s "$fx/t5gemma_tiny/$f" "$official/t5gemma-b-b-ul2/$f"; done
for f in tokenizer.model tokenizer_config.json; do ln -s "$fx/t5gemma_tok/$f" "$official/t5gemma-b-b-ul2/$f"; done
ln -s "$fx/sa3_tiny/pipeline/model_index.json" "$fx/sa3_tiny/pipeline/scheduler" \
  "$fx/sa3_tiny/pipeline/duration_embedder" "$diffusers/"
ln -s "$fx/sa3_tiny/dit_diff" "$diffusers/transformer"
ln -s "$fx/sa3_tiny/same_l" "$diffusers/vae"
ln -s "$fx/t5gemma_tiny" "$diffusers/text_encoder"
ln -s "$fx/t5gemma_tok" "$diffusers/tokenizer"

img() { local name="$1"; shift; "$apus" image -p "a red fox in snow" -s 7 -o "$out/$name.png" "$@" > /dev/null; }
img klein-a --model "$fx/klein_tiny_a" -W 64 -H 48 --steps 3
img klein-a-fp32-x2 --model "$fx/klein_tiny_a" -W 32 -H 32 --steps 2 --precision fp32 -n 2
img klein-base-cfg --model "$fx/klein_tiny_base" -W 32 -H 32 --steps 3 --cfg 3.5 --negative-prompt blur
img klein-edit --model "$fx/klein_tiny_a" --steps 2 -i "$fx/klein_tiny_a_edit/ref0.png" -i "$fx/klein_tiny_a_edit/ref1.png"
img klein-inpaint --model "$fx/klein_tiny_a" --steps 4 -i "$fx/klein_tiny_a_inpaint/image.png" \
  --mask "$fx/klein_tiny_a_inpaint/mask.png" --strength 0.6 --reference "$fx/klein_tiny_a_inpaint/reference.png"
img klein-base-inpaint --model "$fx/klein_tiny_base" --steps 3 -i "$fx/klein_tiny_a_inpaint/image.png" \
  --mask "$fx/klein_tiny_a_inpaint/mask.png"
img klein-9b-kv --model "$fx/klein_tiny_9b_kv" -W 32 -H 32 --steps 2 -i "$fx/klein_tiny_9b_kv_refs/ref0.png"

aud() { local name="$1"; shift; "$apus" audio -p "rain on a tin roof" -s 11 --format wav-float -o "$out/$name.wav" "$@" > /dev/null; }
aud sa3-official-bf16 --model "$official" --seconds 1.5 --steps 3
aud sa3-official-fp32-x2 --model "$official" --seconds 1 --steps 2 --precision fp32 -n 2
aud sa3-diffusers --model "$diffusers" --seconds 1 --steps 2
aud sa3-cfg --model "$official" --seconds 1 --steps 2 --cfg 4 --apg 0.5 --negative-prompt noise
aud sa3-a2a --model "$official" --seconds 1 --steps 2 --init-audio "$fx/sa3_tiny/inputs/init.wav" --init-noise-level 0.6
aud sa3-inpaint --model "$official" --seconds 1 --steps 2 --inpaint-audio "$fx/sa3_tiny/inputs/inpaint.wav" \
  --inpaint-start 0.2 --inpaint-end 0.6 --decode whole
# A float WAV's PEAK chunk carries the time it was written: the sums are of the PNGs and of each
# clip's data chunk.
(cd "$out" && sha256sum ./*.png > renders.sha256 && for f in ./*.wav; do
  python3 -c 'import sys, hashlib; b = open(sys.argv[1], "rb").read(); print(hashlib.sha256(b[b.rindex(b"data"):]).hexdigest(), sys.argv[1], "(data)")' "$f"
done >> renders.sha256 && rm ./*.wav)
echo "wrote $(ls "$out" | wc -l) files to $out"
