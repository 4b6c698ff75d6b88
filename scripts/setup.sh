#!/usr/bin/env bash
# Installs what the test suite needs and is safe to run again.
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if ! dpkg -s mesa-vulkan-drivers >/dev/null 2>&1 || ! dpkg -s libvulkan1 >/dev/null 2>&1; then
    echo "== installing Mesa's Vulkan drivers (lavapipe) for the wgpu tests"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  fi
fi
if command -v rustup >/dev/null; then
  rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
  rustup component add --toolchain nightly rust-src miri >/dev/null 2>&1 || rustup component add --toolchain nightly rust-src miri
fi
