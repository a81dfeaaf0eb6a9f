#!/usr/bin/env bash
# The Debian package `cpack -G DEB` builds from BUILD: its control fields and dependencies (each a
# package apt can resolve here), its files unpacked into a scratch root (dpkg -x) running there:
# --version, --help, a roofline from the published layouts it carries (shown to read them from
# the package: a spoiled packaged config is refused by its packaged path), and a C++ program built against
# the packaged header and library through the packaged pkg-config file, rendering a fixture model;
# the C ABI's test program built as C against the packaged apus_c.h.
# Usage: tests/install/check.sh BUILD FIXTURES SOURCES
set -euo pipefail
build="$1" fixtures="$2" sources="$3"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
fail() { echo "install check: $*" >&2; exit 1; }

(cd "$build" && cpack -G DEB -B "$scratch/pkg" > "$scratch/cpack.log" 2>&1) || { cat "$scratch/cpack.log"; fail "cpack failed"; }
deb="$(ls "$scratch"/pkg/apus_*.deb)"
[ "$(dpkg-deb -f "$deb" Package)" = apus ] || fail "package name"
depends="$(dpkg-deb -f "$deb" Depends)"
for lib in libdnnl libsndfile1 libpng16-16 libsentencepiece0; do
  [[ "$depends" == *"$lib"* ]] || fail "Depends lacks $lib: $depends"
done
apt-get install --simulate "$deb" > "$scratch/apt.log" 2>&1 || { cat "$scratch/apt.log"; fail "apt cannot install it"; }
grep -q "^Inst apus\|apus is already the newest" "$scratch/apt.log" || { cat "$scratch/apt.log"; fail "apt would not install apus"; }

root="$scratch/root"
dpkg -x "$deb" "$root"
for f in usr/bin/apus usr/include/apus/apus.h usr/share/apus/flux2-klein-4b/manifest.json; do
  [ -e "$root/$f" ] || fail "the package lacks /$f"
done
apus="$root/usr/bin/apus"
unset APUS_DATA_DIR
"$apus" --version | grep -q "^apus [0-9]" || fail "--version"
"$apus" --help | grep -q "serve" || fail "--help"
"$apus" roofline --model flux2-klein-4b -W 512 -H 512 | grep -q "flux2-klein-4b 512x512" || fail "roofline"
config="$root/usr/share/apus/flux2-klein-4b/transformer/config.json"
cp "$config" "$scratch/config.json"
echo "{" > "$config"
if "$apus" roofline --model flux2-klein-4b > /dev/null 2> "$scratch/spoiled.log" || ! grep -qF "$config" "$scratch/spoiled.log"; then
  cat "$scratch/spoiled.log"
  fail "the roofline did not read the package's layouts"
fi
cp "$scratch/config.json" "$config"

pc="$(find "$root" -name apus.pc)"
[ -n "$pc" ] || fail "no apus.pc"
flags="$(PKG_CONFIG_PATH="$(dirname "$pc")" pkg-config --cflags --libs apus)"
# shellcheck disable=SC2086
g++ -O1 -o "$scratch/embed" "$sources/tests/install/embed.cpp" $flags || fail "the embedding program did not build: $flags"
LD_LIBRARY_PATH="$(dirname "$(find "$root" -name 'libapus.so' | head -1)")" "$scratch/embed" "$fixtures/klein_tiny_a"
# The C ABI from the package: tests/capi/check.c (run by tests/capi/check.sh against the build)
# compiled as C through the packaged apus-c.pc and linked against the packaged libapus.so.
c_flags="$(PKG_CONFIG_PATH="$(dirname "$pc")" pkg-config --cflags --libs apus-c)"
# shellcheck disable=SC2086
gcc -std=c11 -pedantic -Wall -Werror -o "$scratch/embed_c" "$sources/tests/capi/check.c" $c_flags ||
  fail "the C program did not build: $c_flags"
[ -e "$root/usr/include/apus/apus_c.h" ] || fail "the package lacks /usr/include/apus/apus_c.h"
echo "install check: $(basename "$deb") installs and runs ($(du -h "$deb" | cut -f1))"
