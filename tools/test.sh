#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs every test (CI runs exactly this).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/build.sh
cd build
ctest --output-on-failure -j"$(nproc)"
