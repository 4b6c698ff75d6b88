#!/usr/bin/env bash
# The CUDA host side without a GPU: builds the backend with --features cuda (cudarc loads the
# driver at run time, so no CUDA toolkit is needed), lints it, runs its unit tests (launch
# ABI against every PTX declaration, launch geometry, GEMM strides, scalar packing, buffer
# planning, and that opening without a driver is a one-line error), and the CUDA instances
# of the conformance suite (they print SKIP without a device). The harness's `--backend cuda`
# error is tested by `cargo test --workspace` (harness/tests/cli_model.rs); with
# `--features cuda` it is `cargo test -p rolloutpipe-harness --features cuda --test cli_model
# backend_cuda`, left out here because it rebuilds the harness's dependencies.
# On a GPU machine, scripts/device/cuda.sh runs the same suite for real.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
# Lints every target with the feature on; fails on any warning in the CUDA code (the rest of
# the crate is linted by its own owners' checks). Without the default wgpu feature: clippy
# re-checks every dependency, and wgpu's are the slowest to check and hold no CUDA code.
lint=$(cargo clippy --locked -p rolloutpipe-backends --no-default-features --features cuda --all-targets \
  --message-format short 2>&1) || { echo "$lint"; exit 1; }
if echo "$lint" | grep -E "^backends/(src/cuda/|tests/support/(ops_cuda|cuda_device).rs|benches/cuda.rs|tests/(conformance|engine).rs)"; then
  echo "clippy warnings in the CUDA code (above)"
  exit 1
fi
cargo test --locked -p rolloutpipe-backends --features cuda --lib cuda::
cargo test --locked -p rolloutpipe-backends --features cuda --test conformance --test engine cuda
echo "cuda check took $(( $(date +%s) - start )) s"
