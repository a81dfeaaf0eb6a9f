#!/bin/bash
# What a device call carries (issue 38): the tracked and untracked-not-ignored files, at most 64 MiB
# a call, with the device bundle (~25 MiB, tools/device-bundle.sh) beside them. The tiny models'
# random weights travel as recipes (tests/fixtures/**/*.recipe, rebuilt by tools/fixture_gen.cpp at
# build time and on the device), which keeps the tree small; this keeps it under 40 MiB:
#   tools/device-tree.sh size       # what would travel now
#   tools/device-tree.sh check      # fails, naming the biggest files, past 40 MiB (tools/test.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
travelling_files() { git ls-files -z; git ls-files -z --others --exclude-standard; }
bytes=$(travelling_files | xargs -0 du -cb 2> /dev/null | tail -1 | cut -f1)
case ${1:-} in
  size) echo "device-tree: a device call carries $((bytes / 1048576)) MiB (+ carried paths)" ;;
  check)
    if [ "$bytes" -gt $((40 * 1048576)) ]; then
      echo "device-tree: a device call would carry $((bytes / 1048576)) MiB, over 40 MiB; the biggest:" >&2
      travelling_files | xargs -0 du -b 2> /dev/null | sort -rn | head -10 >&2 || true
      exit 1
    fi
    echo "device-tree: a device call carries $((bytes / 1048576)) MiB (limit 40)" ;;
  *) echo "usage: tools/device-tree.sh size|check" >&2; exit 2 ;;
esac
