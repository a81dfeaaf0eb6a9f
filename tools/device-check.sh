#!/bin/bash
# The device check for a lent GPU machine (issue 11), one command within the device budget:
#   tools/device-check.sh         # build on all cores; the CUDA op, stage and pipeline tests; the
#                                 # GPU's calibration; apus bench on the GPU for klein 1024x1024
#                                 # 4 steps and SA3 medium 120 s (synthetic full-size weights made
#                                 # straight into device memory), each stage against the GPU's floor
#   tools/device-check.sh trace   # the same build, then one traced request of each
# Reports, traces and logs go to $OUT when set (the device tool brings that folder back), else here.
# Each step has its own time limit, so a hang costs that step, not the session.
set -euo pipefail
mode=${1:-bench}
cd "$(dirname "$0")/.."
out=${OUT:-.}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
jobs=$(nproc)
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPUS_CUDA=ON > "$out/build-cuda.log" 2>&1 ||
  { tail -30 "$out/build-cuda.log"; exit 1; }
grep "apus: CUDA backend" "$out/build-cuda.log"
timeout 300 ninja -C build-cuda -j "$jobs" apus apus_tests > "$out/build-cuda-ninja.log" 2>&1 ||
  { tail -40 "$out/build-cuda-ninja.log"; exit 1; }
apus=./build-cuda/apus
if [ "$mode" = bench ]; then
  # Op tests first: a wrong kernel makes every later figure meaningless.
  timeout 180 ./build-cuda/apus_tests --gtest_filter='Cuda*:ShadowDevice*' 2>&1 | tee "$out/cuda-tests.log" |
    grep -E "measure|OK \]|FAILED|Skipped|skip" || true
  timeout 60 $apus calibrate --device cuda
  timeout 240 $apus bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 3 \
    --json "$out/klein-1024-h200.json" || echo "klein bench failed or ran out of time"
  timeout 240 $apus bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 3 \
    --json "$out/sa3-medium-120s-h200.json" || echo "sa3 bench failed or ran out of time"
elif [ "$mode" = trace ]; then
  timeout 240 $apus bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 1 \
    --trace "$out/klein-1024-h200-trace.json" || echo "klein trace failed or ran out of time"
  timeout 240 $apus bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 1 \
    --trace "$out/sa3-medium-120s-h200-trace.json" || echo "sa3 trace failed or ran out of time"
else
  echo "usage: tools/device-check.sh [bench|trace]" >&2
  exit 2
fi
