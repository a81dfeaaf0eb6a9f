#!/usr/bin/env bash
# Installs the Debian packages apus builds against (idempotent; needs root or sudo).
set -euo pipefail
PACKAGES=(cmake ninja-build ccache g++ pkg-config libdnnl-dev nlohmann-json3-dev libcli11-dev
          libpcre2-dev libicu-dev libpng-dev libjpeg62-turbo-dev libexif-dev libwebp-dev libsentencepiece-dev libsndfile1-dev libcpp-httplib-dev libboost1.81-dev libcurl4-openssl-dev libssl-dev chromium libgtest-dev libbenchmark-dev clang-format-14 python3-venv dpkg-dev libopenmpi-dev openmpi-bin)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
# cudnn-frontend's headers (the cuda.attention=cudnn arm: cuDNN's fused SDPA), where the CUDA
# backend is built: header-only, from PyPI's wheel (its include/), into the user's cache, pinned.
CUDNN_FRONTEND=1.32.0
frontend="${XDG_CACHE_HOME:-$HOME/.cache}/apus/cudnn-frontend-$CUDNN_FRONTEND"
if { command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && [ ! -e "$frontend/include/cudnn_frontend.h" ]; then
  wheels="$(mktemp -d)"
  if python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
    -d "$wheels" "nvidia-cudnn-frontend==$CUDNN_FRONTEND"; then
    python3 - "$wheels" "$frontend" <<'PY'
import glob, os, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(os.path.join(sys.argv[1], "*.whl"))[0])
wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith("include/")])
PY
  else
    echo "install-deps: nvidia-cudnn-frontend $CUDNN_FRONTEND not reachable on PyPI: the cuda.attention=cudnn arm is left out" >&2
  fi
  rm -rf "$wheels"
fi
