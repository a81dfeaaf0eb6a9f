#!/usr/bin/env bash
# Runs tests/clients/clients_test.py with the clients from PyPI, pinned, in VENV (made the first
# time). Exits 77 (ctest's skip) naming the reason when PyPI cannot be reached.
# Usage: tests/clients/run.sh APUS FIXTURES VENV
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
apus="$1" fixtures="$2" venv="$3"
packages=(webuiapi==0.9.17 openai==3.63.0 numpy pillow websocket-client)
stamp="$venv/.packages"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${packages[*]}" ]; then
  echo "clients: installing ${packages[*]} from PyPI into $venv" >&2
  python3 -m venv "$venv"
  if ! "$venv/bin/pip" install -q "${packages[@]}"; then
    echo "clients: PyPI could not be reached: the client suite needs webuiapi and openai from it" >&2
    exit 77
  fi
  echo "${packages[*]}" > "$stamp"
fi
exec "$venv/bin/python" "$root/tests/clients/clients_test.py" "$apus" "$fixtures"
