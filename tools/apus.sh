#!/usr/bin/env bash
# The main job in one command: installs dependencies, builds when needed, runs apus with
# the given arguments, e.g.
#   tools/apus.sh image --model ~/FLUX.2-klein-4B --prompt "a lighthouse at dawn" -o out.png
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -x "$root/build/apus" ] || "$root/tools/build.sh"
exec "$root/build/apus" "$@"
