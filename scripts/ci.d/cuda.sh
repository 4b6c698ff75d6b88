#!/usr/bin/env bash
# The CUDA host side without a GPU: builds the backend with --features cuda (cudarc loads the
# driver at run time, so no CUDA toolkit is needed), lints it, runs its unit tests (launch
# ABI against every PTX declaration, launch geometry, GEMM strides, scalar packing, buffer
# planning), the CUDA instances of the conformance suite (they print SKIP without a device),
# and checks that `--backend cuda` fails with one line on a machine without a driver.
# On a GPU machine, scripts/device/cuda.sh runs the same suite for real.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
cargo clippy --locked -p rolloutpipe-backends --features cuda --all-targets -- -D warnings
cargo test --locked -p rolloutpipe-backends --features cuda --lib cuda::
cargo test --locked -p rolloutpipe-backends --features cuda --test conformance cuda
cargo test --locked -p rolloutpipe-harness --features cuda --test cli_model backend_cuda
echo "cuda check took $(( $(date +%s) - start )) s"
