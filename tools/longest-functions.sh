#!/usr/bin/env bash
# The N longest functions of the engine's sources (lines, from lizard), for issue notes and reviews.
# lizard comes from PyPI into build/lizard-venv the first time (said on stderr), never into the
# system's Python.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=build/lizard-venv
if [ ! -x "$venv/bin/lizard" ]; then
  echo "longest-functions: installing lizard from PyPI into $venv" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q lizard
fi
"$venv/bin/lizard" src apps -l cpp --csv 2>/dev/null | awk -F, '{print $5, $6}' | tr -d '"' | sort -rn | head -"${1:-10}"
