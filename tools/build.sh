#!/usr/bin/env bash
# Configures and builds apus (Release) into build/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"tools/install-deps.sh"
# ccache (installed with the dependencies) keeps a rebuild of an unchanged file from compiling it
# again, across clones too: paths below the tree's parent are hashed relative to it.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(cd .. && pwd)}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache > /dev/null
cmake --build build -j"$(nproc)"
