#!/usr/bin/env bash
# The C ABI against the CLI (issue 44): the program tests/capi/check.c, compiled as C against
# include/apus/apus_c.h and libapus.so, writes a klein batch of 2 and a guided Stable Audio 3 clip
# byte for byte as `apus image -n 2` and `apus audio` write them, and refuses what the CLI refuses
# with the CLI's message.
# Usage: tests/capi/check.sh CAPI_CHECK APUS FIXTURES
set -euo pipefail
check="$(realpath "$1")" apus="$(realpath "$2")" fixtures="$(realpath "$3")"
source "$(dirname "$(realpath "$0")")/../sa3_model_dir.sh"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
fail() { echo "capi check: $*" >&2; exit 1; }
sa3="$scratch/sa3"
sa3_model_dir "$fixtures" "$sa3"

"$check" "$fixtures/klein_tiny_a" "$sa3" "$scratch" > c.log || { cat c.log; fail "the C program failed"; }
"$apus" image --model "$fixtures/klein_tiny_a" -p "a fox" -W 32 -H 32 --steps 2 -s 5 -n 2 -o cli.png 2> /dev/null
for i in 1 2; do cmp -s "cli-$i.png" "c-$i.png" || fail "image $i differs from the CLI's"; done
"$apus" audio --model "$sa3" -p "rain" --seconds 1 --steps 2 -s 3 --cfg 4 --negative-prompt wind -o cli.wav 2> /dev/null
cmp -s cli.wav c.wav || fail "the clip differs from the CLI's"
# Each refusal the program provoked, as the CLI words it.
same_error() {
  local label="$1"
  shift
  local cli
  cli="$("$apus" "$@" 2>&1 > /dev/null || true)"
  grep -qxF "$label: ${cli#error: }" c.log || { grep "^$label: " c.log; echo "$cli"; fail "the $label refusal differs from the CLI's"; }
}
same_error missing image --model "$scratch/no-such-model" -p "a fox" -o x.png
same_error width image --model "$fixtures/klein_tiny_a" -p "a fox" -W 17 -H 32 --steps 2 -s 5 -o x.png
same_error seconds audio --model "$sa3" -p "rain" --seconds 100000 --steps 2 -s 3 --cfg 4 --negative-prompt wind -o x.wav
tail -1 c.log
