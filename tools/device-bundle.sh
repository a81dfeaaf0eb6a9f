#!/bin/bash
# Prepares the device check's binaries here, for a lent GPU machine that can build nothing: it has
# CUDA, CMake and ninja but none of apus's Debian libraries (oneDNN, ICU, PCRE2, sentencepiece,
# libsndfile, ...), and nothing can be installed there. This builds apus and apus_tests with the
# CUDA backend (sm_90a), packs them with every shared library they load except the C runtime
# (glibc, libstdc++, libgcc: the machine's own serve where they are at least this build's, glibc
# 2.34 and GCC 12's libstdc++ from Debian 12: Ubuntu 22.04 and later) and splits the archive into
# parts under .device/ (ignored by git) small enough to travel beside the working tree (under 40
# of the 64 MiB a device call may carry: tools/device-tree.sh check). fixture_gen travels too: the
# weight fixtures are ignored files there, rebuilt from their recipes before the tests.
#
#   tools/device-bundle.sh          # -> .device/bundle.part.00, .01, ... and the call to make
#
# Then one device call carrying the whole folder beside the tree (~25 + ~25 MiB of the 64):
#   run(command="tools/device-check.sh tests sa3 klein ab ab-lean ab-conv int8", carry=[".device"], timeout_s=540)
# device-check.sh joins the parts, writes the weight fixtures with the bundle's fixture_gen and runs
# the bundle instead of building (docs/TESTING.md, "A lent session").
set -euo pipefail
cd "$(dirname "$0")/.."
part_mb=${APUS_DEVICE_PART_MB:-7}
export PATH=/usr/local/cuda/bin:$PATH
command -v nvcc > /dev/null || { echo "device-bundle: nvcc not found (the bundle needs the CUDA backend)" >&2; exit 1; }
build=${APUS_DEVICE_BUILD_DIR:-build-device}
# Through ccache where it is installed (tools/build.sh's flags, so a built tree's objects serve).
launcher=()
command -v ccache > /dev/null &&
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache) &&
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(cd .. && pwd)}"
# Hopper's code alone: the lent machines are H100s and H200s, and each architecture more is MiBs
# the call carries.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAPUS_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a-real \
  "${launcher[@]}" > /dev/null
ninja -C "$build" apus apus_tests fixture_gen
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/apus-bundle/lib"
cp "$build/apus" "$build/apus_tests" "$build/fixture_gen" "$stage/apus-bundle/"
for lib in $(ldd "$build/apus_tests" "$build/apus" "$build/fixture_gen" | awk '/=> \//{print $3}' | sort -u); do
  case $(basename "$lib") in
    libc.so* | libm.so* | libstdc++.so* | libgcc_s.so* | ld-linux* | libpthread.so* | libdl.so* | librt.so*) ;;
    *) cp -L "$lib" "$stage/apus-bundle/lib/" ;;
  esac
done
strip --strip-unneeded "$stage/apus-bundle/apus" "$stage/apus-bundle/apus_tests" "$stage/apus-bundle/fixture_gen" "$stage/apus-bundle/lib/"* 2> /dev/null || true
rm -rf .device
mkdir -p .device
tar -C "$stage" -cf - apus-bundle | xz -9 -T0 | split -d -b "${part_mb}M" - .device/bundle.part.
ls -l .device
n=$(ls .device/bundle.part.* | wc -l)
echo "device-bundle: $n part(s), $(du -sm .device | cut -f1) MiB; the call (the tree: $(tools/device-tree.sh size | grep -o '[0-9]* MiB')):"
echo "  run(command=\"tools/device-check.sh tests sa3 klein ab ab-lean ab-conv int8\", carry=[\".device\"], timeout_s=540)"
