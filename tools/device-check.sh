#!/bin/bash
# The device check for a lent GPU machine (issue 11): builds apus with the CUDA backend on all
# cores, prints the GPU, and runs the CUDA op tests against the reference backend. One command,
# meant to finish in a few minutes of the device budget:
#   tools/device-check.sh            # build + op tests
# What it cannot do yet: the pipelines do not run on the CUDA backend (weight upload and device
# staging of their host-built inputs are still to be written), so there is no
# `apus bench --device cuda` to time; docs/ROADMAP.md has the plan.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
jobs=$(nproc)
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPUS_CUDA=ON > build-cuda.log 2>&1 || { tail -30 build-cuda.log; exit 1; }
grep "apus: CUDA backend" build-cuda.log
ninja -C build-cuda -j "$jobs" apus_tests > build-cuda-ninja.log 2>&1 || { tail -40 build-cuda-ninja.log; exit 1; }
./build-cuda/apus_tests --gtest_filter='Cuda*' 2>&1 | tee cuda-ops.log | grep -E "measure|OK|FAILED|Skipped|skip"
