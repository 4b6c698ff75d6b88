#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: installs what the
# tests need (Vulkan on the CPU through Mesa's lavapipe, the nightly
# toolchain's rust-src and miri for the no-alloc build and Miri), then runs
# `cargo test` for the whole workspace and each extra check in scripts/ci.d/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== cargo test --workspace"
cargo test --workspace --locked
for check in scripts/ci.d/*.sh; do
  [ -e "$check" ] || continue
  echo "== $check"
  bash "$check"
done
echo "all checks passed"
