#!/bin/bash
# The device check for a lent GPU machine (issue 11), one command within the device budget:
#   tools/device-check.sh         # the CUDA op, stage and pipeline tests; the GPU's calibration;
#                                 # apus bench on the GPU for klein 1024x1024 4 steps and SA3
#                                 # medium 120 s (synthetic full-size weights made straight into
#                                 # device memory), each stage against the GPU's floor
#   tools/device-check.sh trace   # one traced request of each instead of the benches
# The lent machine cannot build apus (none of its Debian libraries are there, nothing can be
# installed): tools/device-bundle.sh, run beforehand on a machine that builds it, leaves the
# binaries and their libraries in parts under .device/, carried there one call at a time (its
# header says how). With the parts present this script runs that bundle; without them it builds
# here with CMake (a machine that has the libraries).
# Reports, traces and logs go to $OUT when set (the device tool brings that folder back), else here.
# Each step has its own time limit, so a hang costs that step, not the session.
set -euo pipefail
mode=${1:-bench}
[ "$mode" = bench ] || [ "$mode" = trace ] || { echo "usage: tools/device-check.sh [bench|trace]" >&2; exit 2; }
cd "$(dirname "$0")/.."
out=${OUT:-.}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
if ls .device/bundle.part.* > /dev/null 2>&1; then
  rm -rf /tmp/apus-bundle
  unxz() { if command -v xz > /dev/null; then xz -dc; else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)'; fi; }
  cat .device/bundle.part.* | unxz | tar -C /tmp -xf - ||
    { echo "device-check: the bundle is incomplete ($(ls .device/bundle.part.* | wc -l) part(s) here): carry every part" >&2; exit 1; }
  bin=/tmp/apus-bundle
  libs=$bin/lib
  # cuBLASLt is opened at the first GEMM: the toolkit's, or the one PyTorch's wheels bring.
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia.cublas, os; print(os.path.join(os.path.dirname(nvidia.cublas.__file__), "lib"))' 2> /dev/null || true); do
    [ -e "$d/libcublasLt.so.13" ] && { libs=$libs:$d; break; }
  done
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # The bundle was built elsewhere: the fixtures and published layouts are this checkout's.
  export APUS_FIXTURES_DIR=$PWD/tests/fixtures APUS_DATA_DIR=$PWD/data
  echo "device-check: running the prebuilt bundle ($LD_LIBRARY_PATH)"
else
  jobs=$(nproc)
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPUS_CUDA=ON > "$out/build-cuda.log" 2>&1 ||
    { tail -30 "$out/build-cuda.log"; echo "device-check: cannot configure here; run tools/device-bundle.sh where apus builds" >&2; exit 1; }
  grep "apus: CUDA backend" "$out/build-cuda.log"
  timeout 300 ninja -C build-cuda -j "$jobs" apus apus_tests > "$out/build-cuda-ninja.log" 2>&1 ||
    { tail -40 "$out/build-cuda-ninja.log"; exit 1; }
  bin=./build-cuda
fi
apus=$bin/apus
if [ "$mode" = bench ]; then
  # The op tests first: a wrong kernel makes every later figure meaningless. (The CLI tests stay
  # home: they run the binary at the path it was built at.)
  timeout 180 "$bin/apus_tests" --gtest_filter='Backends/OpTable.*/cuda_*:Cuda*:ShadowDevice*' 2>&1 | tee "$out/cuda-tests.log" |
    grep -E "measure|OK \]|FAILED|Skipped|skip" || true
  timeout 60 "$apus" calibrate --device cuda || echo "calibration failed or ran out of time"
  timeout 240 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 3 \
    --json "$out/klein-1024-h200.json" || echo "klein bench failed or ran out of time"
  timeout 240 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 3 \
    --json "$out/sa3-medium-120s-h200.json" || echo "sa3 bench failed or ran out of time"
else
  timeout 240 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 1 \
    --trace "$out/klein-1024-h200-trace.json" || echo "klein trace failed or ran out of time"
  timeout 240 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 1 \
    --trace "$out/sa3-medium-120s-h200-trace.json" || echo "sa3 trace failed or ran out of time"
fi
