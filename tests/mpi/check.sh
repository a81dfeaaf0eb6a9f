#!/usr/bin/env bash
# A command split over MPI ranks writes what one process writes (issue 43), byte for byte: batch
# parallelism (klein's images and Stable Audio 3's clips of a batch over 2 and 3 ranks; 3 ranks for
# 2 outputs: a rank with nothing) and cfg parallelism (a guided request's branches over 2 and 3
# ranks, alone and in a batch, with a negative prompt; each rank's gathered bytes equal to what
# the count says; both text encoders' linears and klein's VAE convolutions dealt out too); Ulysses (klein's tokens over the ranks: one image, a batch, an edit, an
# inpainting; SA3's memory tokens and frames: a clip, a guided one, one with padding), SAME's
# chunks decoded over the ranks; auto weighing batch, cfg and ulysses by the roofline; --parallel none leaves the work to rank 0;
# an unnamed output is named once for all ranks. A rank that stops taking part ends the job within
# --rank-timeout, and a rank that fails ends it at once, each naming the rank. Tensor parallelism
# (klein's transformer and Stable Audio 3's DiT weights over the ranks, LoRAs cut to them; auto
# taking it when a rank's memory could not hold one process's request; LoKrs too) is one process's;
# a request cfg cannot split and a command that does not split yet
# (roofline) are refused naming themselves; calibrate measures the link between the ranks and
# keeps it. (`apus serve` over ranks: tests/mpi/serve.sh.)
# Skipped (77) without mpirun or without MPI in the build.
# Usage: tests/mpi/check.sh APUS FIXTURES
set -euo pipefail
apus="$(realpath "$1")" fixtures="$(realpath "$2")"
source "$(dirname "$(realpath "$0")")/ranks.sh"
source "$(dirname "$(realpath "$0")")/../sa3_model_dir.sh"
mpi_ready "mpi check" "$apus"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
sa3="$scratch/sa3"
sa3_model_dir "$fixtures" "$sa3"
fail() { echo "mpi check: $*" >&2; exit 1; }
ranks() { local n="$1"; shift; mpirun -np "$n" -x OMP_NUM_THREADS=1 "$apus" "$@" > "$scratch/ranks.log" 2>&1 || {
  cat "$scratch/ranks.log"; fail "mpirun -np $n apus $* failed"; }; }
same() { cmp -s "$1" "$2" || fail "$2 differs from one process's $1"; }

image=(image --model "$fixtures/klein_tiny_a" -p "a fox" -W 32 -H 32 --steps 2 -s 5)
"$apus" "${image[@]}" -n 3 -o one.png 2> /dev/null
for n in 2 3; do
  ranks "$n" "${image[@]}" -n 3 -o "ranks$n.png"
  for i in 1 2 3; do same "one-$i.png" "ranks$n-$i.png"; done
done
"$apus" "${image[@]}" -n 2 -o pair.png 2> /dev/null
ranks 3 "${image[@]}" -n 2 -o idle.png
for i in 1 2; do same "pair-$i.png" "idle-$i.png"; done
ranks 2 "${image[@]}" -n 3 --parallel none -o none.png
for i in 1 2 3; do same "one-$i.png" "none-$i.png"; done
grep -c "^wrote none-" "$scratch/ranks.log" | grep -qx 3 || fail "--parallel none: not every file written once"

audio=(audio --model "$sa3" -p "rain" --seconds 1 --steps 2 -s 3)
"$apus" "${audio[@]}" -n 2 -o one.wav 2> /dev/null
ranks 2 "${audio[@]}" -n 2 -o ranks.wav
for i in 1 2; do same "one-$i.wav" "ranks-$i.wav"; done

# Every rank's "rank R of N: K exchanges, X bytes sent (counted Y), ..." with X = Y and, when
# given, K exchanges.
counted() {
  local n="$1" exchanges="${2:-}"
  [ "$(grep -c '^rank [0-9]* of '"$n"': ' "$scratch/ranks.log")" = "$n" ] || { cat "$scratch/ranks.log"; fail "not every rank reported its exchanges"; }
  grep '^rank [0-9]* of ' "$scratch/ranks.log" | grep -vq "s in them (the counted bytes take [0-9.]* s at [0-9.]* GB/s)$" &&
    { cat "$scratch/ranks.log"; fail "a rank's exchange time without the link's prediction"; }
  grep '^rank [0-9]* of ' "$scratch/ranks.log" | while read -r _ rank _ _ calls _ sent _ _ _ counted _; do
    counted="${counted%),}"
    [ "$sent" = "$counted" ] || fail "rank $rank sent $sent bytes, the count says $counted"
    [ -z "$exchanges" ] || [ "$calls" = "$exchanges" ] || fail "rank $rank ran $calls exchanges, not $exchanges"
  done
}
# A request rendered by one process, then over 2 and 3 ranks split as STRATEGY: every file the
# same bytes, every rank's bytes sent the count's (and, when given, EXCHANGES exchanges each).
# Usage: as_one STRATEGY EXCHANGES NAME.EXT APUS-ARGUMENTS...
as_one() {
  local strategy="$1" exchanges="$2" out="$3" n f compared=0
  shift 3
  "$apus" "$@" -o "$out" > "$scratch/one.log" 2>&1 || { cat "$scratch/one.log"; fail "apus $* failed"; }
  for n in 2 3; do
    ranks "$n" "$@" --parallel "$strategy" -v -o "$n-$out"
    counted "$n" "$exchanges"
    for f in "$out" "${out%.*}"-[0-9]."${out##*.}"; do
      [ ! -e "$f" ] || { same "$f" "$n-$f"; compared=$((compared + 1)); }
    done
  done
  [ "$compared" -gt 0 ] || fail "$out: one process wrote no file to compare"
  rm -f ./*"$out" ./*"${out%.*}"-[0-9]."${out##*.}"
}
base=(image --model "$fixtures/klein_tiny_base" -p "a fox" -W 32 -H 32 --steps 2 -s 5)
guided_audio=("${audio[@]}" --cfg 4 --negative-prompt "wind")
# klein: one gather per step, one per text encoder linear (7 in each of the 27 layers up to the
# deepest tap) and one per VAE convolution (the tiny VAE's 35), those two dealt out by output
# features.
as_one cfg 226 guided.png "${base[@]}"
as_one cfg 226 guided.png "${base[@]}" -n 3
# SA3: the text encoder's 14 gathers (7 linears in each of the tiny T5Gemma's 2 layers), then one
# per step.
as_one cfg 16 guided.wav "${guided_audio[@]}"
# 20 s: SAME's 128-latent chunks over the ranks too, their audio gathered (one more exchange);
# also with the decoder's mask noise, each rank drawing past the earlier chunks' noise.
as_one cfg 17 chunks.wav audio --model "$sa3" -p "rain" --seconds 20 --steps 2 -s 3 --cfg 4 --decode chunked
noisy="$scratch/sa3_noisy"
mkdir -p "$noisy"
sed 's/"mask_noise": 0.0/"mask_noise": 0.25/' "$fixtures/sa3_tiny/original/model_config.json" > "$noisy/model_config.json"
grep -q '"mask_noise": 0.25' "$noisy/model_config.json" || fail "the noisy decoder's config"
ln -s "$fixtures/sa3_tiny/original/model.safetensors" "$sa3/t5gemma-b-b-ul2" "$noisy/"
as_one cfg 17 noisy.wav audio --model "$noisy" -p "rain" --seconds 20 --steps 2 -s 3 --cfg 4 --decode chunked
"$apus" "${base[@]}" -o guided.png 2> /dev/null
ranks 2 "${base[@]}" -v -o auto.png
grep -Eq "^--parallel auto: (cfg|ulysses) \(the floors over 2 ranks: batch .*, cfg .*, ulysses .*\)" "$scratch/ranks.log" ||
  { cat "$scratch/ranks.log"; fail "auto did not weigh the splits of one guided image"; }
same guided.png auto.png
if mpirun -np 2 "$apus" "${audio[@]}" --parallel cfg -o x.wav > refused.log 2>&1; then fail "cfg split an unguided clip"; fi
grep -q "parallel cfg splits the transformer's samples, and this request has one" refused.log ||
  { cat refused.log; fail "the refusal of cfg without guidance"; }

# Ulysses: every image's tokens over the ranks (the tiny models' 2 heads over 3 ranks: one rank
# attends for none): one image, a batch, an edit (its reference's tokens in the sequence) and an
# inpainting; auto picks it for one distilled image. SA3: its memory tokens and frames, the
# differential attention exchanged (a clip, a guided one with a negative prompt, 0.7 s leaving
# padding frames on the canvas) and the small model's plain attention.
as_one ulysses "" single.png "${image[@]}"
as_one ulysses "" pair.png "${image[@]}" -n 2
as_one ulysses "" edit.png image --model "$fixtures/klein_tiny_a" -p "a fox" -W 32 -H 48 --steps 2 -s 7 \
  --image "$fixtures/klein_tiny_a_edit/ref0.png"
as_one ulysses "" inpaint.png image --model "$fixtures/klein_tiny_a" -p "a fox" --steps 2 -s 7 \
  --image "$fixtures/images/gray.png" --mask "$fixtures/images/bilevel.png"
# The -kv model's cached reference keys (their own pass whole on every rank) in every sample's
# sequence after its text, for each rank's heads: an edit, and a batch of two.
as_one ulysses "" kv.png image --model "$fixtures/klein_tiny_9b_kv" -p "a fox" --steps 2 -s 7 \
  --image "$fixtures/klein_tiny_9b_kv_refs/ref0.png" --image "$fixtures/klein_tiny_9b_kv_refs/ref1.png"
as_one ulysses "" kv_pair.png image --model "$fixtures/klein_tiny_9b_kv" -p "a fox" --steps 2 -s 7 -n 2 \
  --image "$fixtures/klein_tiny_9b_kv_refs/ref0.png"
"$apus" "${image[@]}" -o single.png 2> /dev/null
ranks 2 "${image[@]}" -v -o auto.png
grep -q "^--parallel auto: ulysses " "$scratch/ranks.log" || { cat "$scratch/ranks.log"; fail "auto did not pick ulysses for one image"; }
same single.png auto.png
small="$scratch/sa3_small"
mkdir -p "$small"
ln -s "$fixtures/sa3_tiny/original_small/model_config.json" "$fixtures/sa3_tiny/original_small/model.safetensors" \
  "$sa3/t5gemma-b-b-ul2" "$small/"
as_one ulysses "" clip.wav "${audio[@]}"
as_one ulysses "" guided.wav "${guided_audio[@]}"
as_one ulysses "" short.wav audio --model "$sa3" -p "rain" --seconds 0.7 --steps 2 -s 3
as_one ulysses "" chunks.wav audio --model "$sa3" -p "rain" --seconds 20 --steps 2 -s 3 --decode chunked
as_one ulysses "" plain.wav audio --model "$small" -p "rain" --seconds 1 --steps 2 -s 3 --cfg 4

# Rank 1 leaves at once (told it has no part: --parallel none): rank 0 waits at the first gather,
# then ends the job.
cfg=(-p "a fox" -W 32 -H 32 -s 5 --steps 3)
start=$SECONDS
if timeout 120 mpirun -np 1 "$apus" image --model "$fixtures/klein_tiny_base" "${cfg[@]}" --parallel cfg --rank-timeout 2 \
  -o t.png : -np 1 "$apus" image --model "$fixtures/klein_tiny_base" "${cfg[@]}" --parallel none -o u.png > hung.log 2>&1; then
  fail "a rank left, and the job did not fail"
fi
grep -q "^error: rank 0 of 2: gathering the text encoder's q features: not every rank arrived within 2 s" hung.log ||
  { cat hung.log; fail "the waiting rank's message"; }
[ $((SECONDS - start)) -lt 60 ] || fail "the job took $((SECONDS - start)) s to end"
# Rank 1 fails (no such model): the job ends, naming it.
if timeout 120 mpirun -np 1 "$apus" image --model "$fixtures/klein_tiny_base" "${cfg[@]}" --parallel cfg -o t.png \
  : -np 1 "$apus" image --model "$scratch/none" "${cfg[@]}" --parallel cfg -o u.png > failed.log 2>&1; then
  fail "a rank failed, and the job did not"
fi
grep -q "^error: rank 1 of 2: .*none" failed.log || { cat failed.log; fail "the failed rank's message"; }

mkdir unnamed && cd unnamed
ranks 2 "${image[@]}" -n 3
[ "$(ls outputs)" = "$(printf '00001-1.png\n00001-2.png\n00001-3.png')" ] || { ls outputs; fail "unnamed outputs"; }
for i in 1 2 3; do same "../one-$i.png" "outputs/00001-$i.png"; done
cd ..

# Tensor: klein's transformer weights and features over the ranks, each rank loading its rows (3
# ranks: one holds none of the tiny model's 2 heads): one image, a batch, a guided -base image, an
# edit, the -kv model's cached references, a GGUF single file (Q8_0 blocks, BFL's fused layout).
# Each step gathers 4 times per double block and twice per single block (2 x 4 + 3 x 2, 2 steps);
# the text encoder's 189 linears and this VAE's 36 convolutions as under cfg.
as_one tensor 253 single.png "${image[@]}"
as_one tensor "" pair.png "${image[@]}" -n 2
as_one tensor "" guided.png "${base[@]}"
as_one tensor "" edit.png image --model "$fixtures/klein_tiny_a" -p "a fox" -W 32 -H 48 --steps 2 -s 7 \
  --image "$fixtures/klein_tiny_a_edit/ref0.png"
as_one tensor "" kv.png image --model "$fixtures/klein_tiny_9b_kv" -p "a fox" --steps 2 -s 7 \
  --image "$fixtures/klein_tiny_9b_kv_refs/ref0.png" --image "$fixtures/klein_tiny_9b_kv_refs/ref1.png"
# Adapters cut to the rows each rank holds: a LoRA and a LoHa stacked, on the blocks' linears and
# the whole ones.
as_one tensor "" lora.png "${image[@]}" --lora "$fixtures/klein_lora/bfl.safetensors:0.7" \
  --lora "$fixtures/klein_lora/loha.safetensors"
as_one tensor "" gguf.png image --model "$fixtures/klein_single/flux-2-klein-tiny-Q8_0.gguf" \
  --config "$fixtures/klein_tiny_a" -p "a fox" -W 32 -H 32 --steps 2 -s 5
# Stable Audio 3: the DiT's, T5Gemma's and SAME decoder's weights over the ranks (differential
# attention: a clip, a guided one with a negative prompt, 0.7 s leaving padding frames on the
# canvas, 20 s decoded in chunks; the small model's plain attention; a LoRA cut to the held rows;
# sa3.cpp's Q8_0 DiT GGUF). Each step gathers 6 times a block (self- and cross-attention's heads
# and projections, the feed-forward's features and projection: 2 blocks x 6, 2 steps), the
# prologue twice a block (the local conditioning's two linears), T5Gemma's 14 linears once each,
# SAME's 4 blocks 4 times each (its attention's heads and projection, its feed-forward's features
# and projection), the velocities not at all.
as_one tensor 58 clip.wav "${audio[@]}"
as_one tensor "" guided.wav "${guided_audio[@]}"
as_one tensor "" short.wav audio --model "$sa3" -p "rain" --seconds 0.7 --steps 2 -s 3
as_one tensor "" chunks.wav audio --model "$sa3" -p "rain" --seconds 20 --steps 2 -s 3 --decode chunked
as_one tensor "" plain.wav audio --model "$small" -p "rain" --seconds 1 --steps 2 -s 3 --cfg 4
as_one tensor "" lora.wav "${audio[@]}" --lora "$fixtures/sa3_lora/official.safetensors:0.8"
as_one tensor "" gguf.wav audio --model "$fixtures/sa3_gguf/medium/stable-audio-3-medium-dit-tiny-v1.0-Q8_0.gguf" \
  --config "$sa3" -p "rain" --seconds 1 --steps 2 -s 3
# auto opens the model split (tensor) when one process could not hold the request in a rank's
# memory (--rank-memory here; this machine's memory over its ranks by default): one process's bytes.
"$apus" "${image[@]}" -o alone.png 2> /dev/null
for n in 2 3; do
  ranks "$n" "${image[@]}" --rank-memory 0.001 -v -o "memory$n.png"
  grep -q "^--parallel auto: tensor (one process needs about .* in its .* stage, more than the 1.1 MB a rank has: --rank-memory)$" \
    "$scratch/ranks.log" || { cat "$scratch/ranks.log"; fail "auto did not open the model split for a rank's memory"; }
  same alone.png "memory$n.png"
done
"$apus" "${audio[@]}" -o clip.wav 2> /dev/null
ranks 2 "${audio[@]}" --rank-memory 0.001 -v -o memory.wav
grep -q "^--parallel auto: tensor (one process needs about " "$scratch/ranks.log" || { cat "$scratch/ranks.log"; fail "auto kept SA3 whole past a rank's memory"; }
same clip.wav memory.wav
# LoKrs (each rank keeps its rows of the Kronecker term): on diffusers' modules, with both factors
# factorised, and in BFL's names on the fused modules whose rows are split by heads.
as_one tensor "" lokr.png "${image[@]}" --lora "$fixtures/klein_lora/lokr.safetensors" \
  --lora "$fixtures/klein_lora/lokr_both.safetensors:0.6"
as_one tensor "" bfl_lokr.png "${image[@]}" --lora "$fixtures/klein_lora/bfl_lokr.safetensors"
if mpirun -np 2 "$apus" roofline --model "$fixtures/klein_tiny_a" > refused.log 2>&1; then fail "roofline ran over 2 ranks"; fi
grep -q "apus roofline does not split over several processes yet" refused.log || { cat refused.log; fail "roofline's refusal"; }
# calibrate over the ranks: the link between them measured, then kept under their placement.
for refresh in --refresh ""; do
  ranks 2 calibrate $refresh
  kept="$([ -n "$refresh" ] && echo "measured now" || echo cached)"
  grep -A2 "^MPI | 2 ranks on .* (2)$" "$scratch/ranks.log" | grep -q "GB/s all-gather, .* GB/s all-to-all" ||
    { cat "$scratch/ranks.log"; fail "calibrate's link rates"; }
  grep -A2 "^MPI | 2 ranks on " "$scratch/ranks.log" | grep -qx "  $kept" || { cat "$scratch/ranks.log"; fail "the link rates not $kept"; }
done
echo "mpi check: batches, guided branches, tokens and transformer weights (klein, SA3) over 2 and 3 ranks are one process's, byte for byte"
