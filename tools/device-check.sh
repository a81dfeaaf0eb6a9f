#!/bin/bash
# The device check for a lent GPU machine (issue 38), one command within the device budget:
#   tools/device-check.sh [STEP...]     # default: tests calibrate klein sa3 diffusers ab
# Steps, each with its own time limit so a hang costs that step, not the session, and none stopping
# the next: `tests` the CUDA op table and the CUDA stage and pipeline tests against the oracle
# fixtures (NCCL's exchanges with one rank among them); `calibrate` the GPU's ceilings; `klein` apus bench at 1024x1024, 4 steps, and `sa3` at
# 120 s of SA3 medium (synthetic full-size weights made straight into device memory), each stage
# against its floor, with a trace of one more request; `diffusers` diffusers' own pipelines on the
# same configs (tools/diffusers_bench.py; its wheels carried in .whl/, see docs/TESTING.md;
# `diffusers-klein` or `diffusers-sa3` for one); `ab` both DiTs' attention through cuDNN's fused
# SDPA against the flash kernel, and SAME's chunks decoded together against apart; `ab-products` the flash attention against the products on both DiTs;
# `ab-lean` the flash kernel's lean element code against the proven one; `ab-conv` cuDNN's conv
# against im2col on klein's VAE; `int8` the int8 tier (`--quant int8`) on both models and q8_0's
# per-linear decoding (`--quant q8_0`) on klein; `fp8` the fp8 tier (`--quant fp8`) on both models;
# `ab-steps` the sampler steps queued and recorded as CUDA graphs against checked one by one.
# The lent machine cannot build apus (none of its Debian libraries are there, nothing can be
# installed): tools/device-bundle.sh, run beforehand on a machine that builds it, leaves the
# binaries and their libraries in parts under .device/, carried with the call. With the parts
# present this script runs that bundle; without them it builds here with CMake.
# Reports, traces and logs go to $OUT when set (the device tool brings that folder back), else ./device-out.
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${*:-tests calibrate klein sa3 diffusers ab}
out=${OUT:-./device-out}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
summary=()
note() { summary+=("$1"); }
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
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
  # NCCL (the splits' exchanges between GPUs), cuDNN (cuda.conv=cudnn, cuda.attention=cudnn) and
  # the CUDA runtime (cudnn-frontend's calls; apus links its own statically) are opened at their
  # first use: the toolkit's, or the ones PyTorch's wheels bring.
  for lib in libnccl.so.2 libcudnn.so.9 libcudart.so.13; do
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib \
      $(python3 -c 'import glob, os, sys; print(*{os.path.dirname(f) for p in sys.path for f in glob.glob(os.path.join(p, "nvidia", "**", "'$lib'"), recursive=True)})' 2> /dev/null || true); do
      [ -e "$d/$lib" ] && { libs=$libs:$d; break; }
    done
  done
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # The bundle was built elsewhere: the fixtures and published layouts are this checkout's.
  export APUS_FIXTURES_DIR=$PWD/tests/fixtures APUS_DATA_DIR=$PWD/data
  echo "device-check: running the prebuilt bundle ($LD_LIBRARY_PATH)"
else
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPUS_CUDA=ON > "$out/build-cuda.log" 2>&1 ||
    { tail -30 "$out/build-cuda.log"; echo "device-check: cannot configure here; run tools/device-bundle.sh where apus builds" >&2; exit 1; }
  timeout 300 ninja -C build-cuda -j "$(nproc)" apus apus_tests fixture_gen > "$out/build-cuda-ninja.log" 2>&1 ||
    { tail -40 "$out/build-cuda-ninja.log"; exit 1; }
  bin=./build-cuda
fi
apus=$bin/apus
# The weight fixtures travel as recipes (ignored files are not carried): written here, ~1 s.
"$bin/fixture_gen" tests/fixtures || exit 1
step() {  # step NAME SECONDS COMMAND...: runs it, logs to $out/NAME.log, notes how it ended
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -25 "$out/$name.log"
  note "$name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (timed out)')"
}
for s in $steps; do
  case $s in
    tests)
      # The op table and the stage tests in two processes: a kernel that faults ends only its own.
      step tests-ops 120 "$bin/apus_tests" --gtest_filter='Backends/OpTable.*/cuda_*' --gtest_brief=1
      step tests-stages 120 "$bin/apus_tests" --gtest_filter='Cuda*:Cudnn*' --gtest_brief=1
      grep -hE "^\[  FAILED|measure" "$out/tests-ops.log" "$out/tests-stages.log" | head -40 ;;
    calibrate) step calibrate 45 "$apus" calibrate --device cuda ;;
    klein)
      step klein 150 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 3 \
        --json "$out/klein-1024-h200.json" --trace "$out/klein-1024-h200-trace.json" ;;
    sa3)
      step sa3 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 3 \
        --json "$out/sa3-medium-120s-h200.json" --trace "$out/sa3-medium-120s-h200-trace.json" ;;
    diffusers | diffusers-klein | diffusers-sa3)
      if [ -d .whl ]; then
        only=${s#diffusers}
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
          step "$s" 150 env PYTHONPATH=/tmp/site python3 tools/diffusers_bench.py --reps 5 ${only:+--only ${only#-}}
      else note "$s: skipped (no .whl/ carried)"; fi ;;
    ab)  # the DiTs' attention through cuDNN's fused SDPA against the flash kernel: SA3's differential
      # form, klein's joint one (the flash kernel against the products: `ab-products`, session 22);
      # SAME's chunks decoded together against one a pass
      step ab-sa3-cudnn 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --ab cuda.attention=cudnn,flash --json "$out/sa3-ab-cudnn.json"
      step ab-sa3-chunks 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --ab sa3.decode_chunks=together,apart --json "$out/sa3-ab-chunks.json"
      step ab-klein-cudnn 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 \
        --reps 2 --ab cuda.attention=cudnn,flash --json "$out/klein-ab-cudnn.json" ;;
    ab-products)  # the flash attention against the products on both models' DiTs
      step ab-sa3-flash 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --ab cuda.attention=flash,gemm --json "$out/sa3-ab-flash.json"
      step ab-klein-flash 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 \
        --reps 2 --ab cuda.attention=flash,gemm --json "$out/klein-ab-flash.json" ;;
    ab-lean)  # the flash kernel's lean element code against the proven one (bit-identical outputs expected)
      step ab-sa3-lean 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --ab cuda.flash_code=lean,branches --json "$out/sa3-ab-lean.json"
      step ab-klein-lean 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 \
        --reps 2 --ab cuda.flash_code=lean,branches --json "$out/klein-ab-lean.json" ;;
    ab-conv)  # the conv on klein's VAE: cuDNN's implicit GEMM against im2col and a product
      step ab-klein-conv 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 \
        --reps 2 --ab cuda.conv=cudnn,gemm --json "$out/klein-ab-conv.json" ;;
    int8)  # the int8 tier on the integer tensor cores, beside the bf16 runs of `klein` and `sa3`; and
      # q8_0's blocks decoded per linear (what every GGUF costs on the GPU) on klein
      step int8-klein 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 2 \
        --quant int8 --json "$out/klein-1024-int8.json"
      step int8-sa3 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --quant int8 --json "$out/sa3-medium-120s-int8.json"
      step q8_0-klein 150 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 2 \
        --quant q8_0 --ab cuda.stored_decode=staged,direct --json "$out/klein-1024-q8_0.json" ;;
    fp8)  # the fp8 tier on the fp8 tensor cores (cuBLASLt's e4m3 GEMM), beside `int8`'s runs; on klein
      # its row scales in cuBLASLt's epilogue against the kernel over fp32 sums
      step fp8-klein 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 --reps 2 \
        --quant fp8 --ab cuda.fp8_scales=epilogue,kernel --json "$out/klein-1024-fp8.json"
      step fp8-sa3 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --quant fp8 --json "$out/sa3-medium-120s-fp8.json" ;;
    ab-steps)  # the steps recorded as CUDA graphs, and queued without a wait, against checked one by one
      step ab-sa3-graphs 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --ab device.steps=graphs,checked --json "$out/sa3-ab-graphs.json"
      step ab-sa3-deferred 90 "$apus" bench --synthetic stable-audio-3-medium --device cuda --seconds 120 --reps 2 \
        --ab device.steps=deferred,checked --json "$out/sa3-ab-deferred.json"
      step ab-klein-graphs 120 "$apus" bench --synthetic flux2-klein-4b --device cuda -W 1024 -H 1024 --steps 4 \
        --reps 2 --ab device.steps=graphs,checked --json "$out/klein-ab-graphs.json" ;;
    *) echo "device-check: unknown step $s (tests calibrate klein sa3 diffusers ab ab-products ab-lean ab-conv int8 fp8 ab-steps)" >&2; exit 2 ;;
  esac
done
echo "== summary"
printf '%s\n' "${summary[@]}"
