#!/usr/bin/env bash
# The test command: installs dependencies, builds, runs every test (CI runs exactly this).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tools/build.sh
# The sources follow .clang-format (Debian's clang-format 14, installed by tools/install-deps.sh).
tools/format.sh check
# What a lent GPU session's device call carries stays small enough for the bundle beside it.
tools/device-tree.sh check
# The build uses Ninja; a plain `cmake -S . -B build` picks Unix Makefiles, whose CUDA handling
# differs: configure with it too (configure only, into a scratch folder).
makefiles="$(mktemp -d)"
trap 'rm -rf "$makefiles"' EXIT
cmake -S . -B "$makefiles" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release > /dev/null
cd build
# Two test processes share the cores: OpenMP threads that sleep instead of spinning keep them
# from starving each other.
OMP_WAIT_POLICY=passive ctest --output-on-failure -j"$(nproc)"
