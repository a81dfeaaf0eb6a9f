#!/usr/bin/env bash
# Configures and builds apus (Release) into build/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"tools/install-deps.sh"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j"$(nproc)"
