#!/usr/bin/env bash
# The N longest functions of the engine's sources (lines, from lizard), for issue notes and reviews.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v lizard > /dev/null || pip install -q lizard
lizard src apps -l cpp --csv 2>/dev/null | awk -F, '{print $5, $6}' | tr -d '"' | sort -rn | head -"${1:-10}"
