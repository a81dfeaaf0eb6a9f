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
