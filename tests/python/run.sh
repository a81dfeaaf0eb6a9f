#!/usr/bin/env bash
# The Python package as a user installs it (issue 44): `pip install .` of this tree into VENV
# (pytest, numpy and pillow from PyPI the first time), then tests/python/test_pipelines.py against
# the CLI built from the same tree (tqdm too: the pipelines' progress bar). Exits 77 (ctest's skip) naming the reason when PyPI cannot be
# reached (pip's build needs scikit-build-core and nanobind from it).
# Usage: tests/python/run.sh APUS FIXTURES VENV CXX
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
apus="$1" fixtures="$2" venv="$3" cxx="$4"
packages=(pytest numpy pillow tqdm)
stamp="$venv/.packages"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${packages[*]}" ]; then
  python3 -m venv "$venv"
  if ! "$venv/bin/pip" install -q "${packages[@]}"; then
    echo "python: PyPI could not be reached: the package's build and tests need it" >&2
    exit 77
  fi
  echo "${packages[*]}" > "$stamp"
fi
# The engine's objects come from ccache when the CLI's build made them: the same compiler, and
# paths hashed relative to the tree's parent (tools/build.sh; pyproject.toml's build-dir is as deep
# as build/).
settings=(-C "cmake.define.CMAKE_CXX_COMPILER=$cxx")
if command -v ccache > /dev/null; then
  export CCACHE_BASEDIR="$(cd "$root/.." && pwd)"
  settings+=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
"$venv/bin/pip" install -q "$root" "${settings[@]}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
APUS_CLI="$apus" APUS_FIXTURES="$fixtures" exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -s \
  "$root/tests/python/test_pipelines.py"
