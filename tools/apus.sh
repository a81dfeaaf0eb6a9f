#!/usr/bin/env bash
# The main job in one command: installs dependencies and builds the first time, rebuilds what
# changed since (ninja: a no-op when nothing did), runs apus with the given arguments, e.g.
#   tools/apus.sh image --model ~/FLUX.2-klein-4B --prompt "a lighthouse at dawn" -o out.png
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -f "$root/build/build.ninja" ]; then
  ninja -C "$root/build" --quiet apus | { grep -v "^ninja: no work to do" || true; } >&2
else
  "$root/tools/build.sh"
fi
exec "$root/build/apus" "$@"
