#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs every test (CI runs exactly this).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/build.sh
cd build
# Two test processes share the cores: OpenMP threads that sleep instead of spinning keep them
# from starving each other.
OMP_WAIT_POLICY=passive ctest --output-on-failure -j"$(nproc)"
