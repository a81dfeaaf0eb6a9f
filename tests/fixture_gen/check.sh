#!/bin/bash
# fixture_gen on a copy of one recipe (klein_tiny_a's transformer: draws and literal bytes) and one
# whose pieces are copies and Q8_0 dequantisations of another file: it writes both, rewrites a
# poisoned file, and refuses a recipe whose bytes were changed, naming the file.
#   check.sh FIXTURE_GEN FIXTURES_DIR
set -euo pipefail
gen=$1 src=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
a=klein_tiny_a/transformer/diffusion_pytorch_model.safetensors
q=klein_single/flux-2-klein-tiny-Q8_0-dequantized.safetensors
mkdir -p "$dir/$(dirname $a)" "$dir/klein_single"
cp "$src/draw_streams.json" "$dir/"
cp "$src/$a.recipe" "$dir/$a.recipe"
cp "$src/$q.recipe" "$dir/$q.recipe"
for from in $(grep -ao '"copy":"[^"]*"' "$src/$q.recipe" | cut -d'"' -f4 | sort -u); do
  mkdir -p "$dir/$(dirname "$from")"
  cp "$src/$from" "$dir/$from"
done
fail() { echo "fixture_gen check: $*" >&2; exit 1; }
"$gen" "$dir" || fail "did not write the fixtures"
cmp "$dir/$a" "$src/$a" || fail "$a differs from the build's"
cmp "$dir/$q" "$src/$q" || fail "$q differs from the build's"
seed=${RANDOM}
printf 'poison %s' "$seed" | dd of="$dir/$a" bs=1 seek=$((4096 + seed % 4096)) conv=notrunc status=none
echo "poisoned $a at $((4096 + seed % 4096)) (seed $seed)"
"$gen" "$dir" | grep -q . || true
cmp "$dir/$a" "$src/$a" || fail "a poisoned $a was not rewritten"
rm "$dir/$a"
# one literal byte of the recipe flipped: the rebuilt file's sha256 no longer matches
size=$(stat -c %s "$dir/$a.recipe")
at=$((size - 1 - seed % 64))
byte=$(od -An -tu1 -j"$at" -N1 "$dir/$a.recipe" | tr -d ' ')
printf "$(printf '\\%03o' $(((byte + 1) % 256)))" | dd of="$dir/$a.recipe" bs=1 seek="$at" conv=notrunc status=none
if "$gen" "$dir" 2> "$dir/err"; then fail "accepted a recipe whose bytes changed"; fi
grep -q "$a: rebuilt .* sha256" "$dir/err" || fail "the refusal does not name the file: $(cat "$dir/err")"
[ ! -e "$dir/$a" ] || fail "a file that failed its check was left behind"
echo "fixture_gen check: written, poisoned and rewritten, a changed recipe refused: $(cat "$dir/err")"
