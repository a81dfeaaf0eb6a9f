#!/usr/bin/env bash
# The C++ and CUDA sources laid out as .clang-format says, by Debian's clang-format 14 (the version
# decides the layout: another one rewrites lines this one accepts).
#   tools/format.sh         rewrite the files that drift (tracked, and new ones git does not ignore)
#   tools/format.sh check   list them and fail (tools/test.sh runs this)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v clang-format-14 > /dev/null || { echo "format: clang-format-14 is missing (tools/install-deps.sh)" >&2; exit 2; }
mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.cpp' '*.h' '*.cu' '*.cuh')
drifted=()
for f in "${files[@]}"; do
  clang-format-14 --dry-run -Werror "$f" > /dev/null 2>&1 || drifted+=("$f")
done
[ ${#drifted[@]} -eq 0 ] && exit 0
if [ "${1:-}" = check ]; then
  printf 'format: %s does not follow .clang-format (tools/format.sh rewrites it)\n' "${drifted[@]}" >&2
  exit 1
fi
clang-format-14 -i "${drifted[@]}"
printf 'format: rewrote %s\n' "${drifted[@]}"
