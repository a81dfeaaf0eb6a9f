#!/bin/bash
# What a device call carries, for a lent session (issue 38). The device tool sends the tracked and
# untracked-not-ignored files, at most 64 MiB a call; the tracked tree is larger (tests/fixtures,
# mostly the tiny models' random fp32 weights), so before a call the fixtures the device check
# does not read are taken out of git's index (the files stay on disk) and ignored, and after the
# session they are put back:
#   tools/device-tree.sh drop       # untrack what the CUDA tests never read, print what travels
#   tools/device-tree.sh restore    # the index as it was (run before any commit)
#   tools/device-tree.sh size       # what would travel now
#   tools/device-tree.sh check      # fails (naming the biggest files) when what a dropped tree
#                                   # carries passes 40 MiB: the bundle (~25 MiB) must fit beside it
# The fixtures the CUDA tests read (tests/test_cuda_ops.cpp) stay: keep KEEP in step with them.
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP='^tests/fixtures/(klein_tiny_(a|b|base|9b)(/|_ref\.|_edit/|_edit_ref\.)|sa3_tiny/(dit_diff|same_l|pipeline|original|original_base|inputs)/|sa3_(pipeline|inputs)_ref\.|t5gemma_(tiny|tok)/)'
marker='# apus: device-tree.sh drop'
exclude=$(git rev-parse --git-path info/exclude)
travelling() {
  (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2> /dev/null | tail -1 | cut -f1
}
case ${1:-} in
  drop)
    grep -qF "$marker" "$exclude" 2> /dev/null && { echo "device-tree: already dropped (restore first)" >&2; exit 1; }
    git diff --cached --quiet -- tests/fixtures || { echo "device-tree: staged changes under tests/fixtures: commit or unstage them first" >&2; exit 1; }
    mapfile -t away < <(git ls-files tests/fixtures | grep -Ev "$KEEP")
    { echo "$marker"; printf '/%s\n' "${away[@]}"; } >> "$exclude"
    printf '%s\0' "${away[@]}" | xargs -0 git rm -r --cached -q --
    echo "device-tree: ${#away[@]} fixture files stay home; travelling now: $(($(travelling) / 1048576)) MiB (+ carried paths)" ;;
  restore)
    if grep -qF "$marker" "$exclude" 2> /dev/null; then
      sed -i "/^$marker\$/,\$d" "$exclude"
      git reset -q -- tests/fixtures
    fi
    echo "device-tree: index restored; travelling: $(($(travelling) / 1048576)) MiB" ;;
  size) echo "device-tree: travelling now: $(($(travelling) / 1048576)) MiB (+ carried paths)" ;;
  check)
    # What `drop` would leave travelling, computed without touching the index.
    mapfile -t kept < <(git ls-files | grep -Ev '^tests/fixtures/' ; git ls-files tests/fixtures | grep -E "$KEEP";
                        git ls-files --others --exclude-standard)
    bytes=$(printf '%s\0' "${kept[@]}" | xargs -0 du -cb 2> /dev/null | tail -1 | cut -f1)
    limit=$((40 * 1048576))
    if [ "$bytes" -gt "$limit" ]; then
      echo "device-tree: a device call would carry $((bytes / 1048576)) MiB after drop, over 40 MiB; the biggest:" >&2
      printf '%s\0' "${kept[@]}" | xargs -0 du -b 2> /dev/null | sort -rn | head -10 >&2 || true
      exit 1
    fi
    echo "device-tree: a device call carries $((bytes / 1048576)) MiB after drop (limit 40)" ;;
  *) echo "usage: tools/device-tree.sh drop|restore|size|check" >&2; exit 2 ;;
esac
