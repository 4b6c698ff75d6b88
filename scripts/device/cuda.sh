#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU, in one go (budget: ~8 minutes on one
# H200; each step has its own timeout so a hang cannot eat the rest):
#   1. build with --features cuda (release; the driver is loaded at run time);
#   2. the CUDA unit tests and the conformance suite against the CPU reference
#      (ROLLOUTPIPE_REQUIRE_CUDA=1: a missing device fails instead of skipping);
#   3. the benchmark table (backends/benches/cuda.rs): per-kernel TFLOP/s and GB/s against
#      the device's peak and cuBLAS, end-to-end generation and GRPO-step tokens/s at
#      Qwen3-0.6B and 1.7B shapes;
#   4. PyTorch eager on the same shapes (scripts/device/torch_eager.py) when torch and
#      transformers are installed (nothing is downloaded: the device machine is offline).
# Logs and the table go to $OUT (default target/cuda-device). Usage:
#   bash scripts/device/cuda.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/../.."
QUICK=${1:-}
OUT=${OUT:-target/cuda-device}
mkdir -p "$OUT"
export ROLLOUTPIPE_REQUIRE_CUDA=1
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-$(nproc)}
start=$(date +%s)
status=0
step() { echo; echo "== $1 ($(( $(date +%s) - start )) s)"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/device.txt"
if ! command -v cargo >/dev/null; then
  echo "cargo is not installed on this machine; install a Rust toolchain (rustup) first" >&2
  exit 2
fi

step "build (--features cuda, release)"
timeout 240 cargo build --release --locked -p rolloutpipe-backends --features cuda \
  --tests --benches 2>&1 | tail -3 || { echo "build failed"; exit 1; }

step "unit tests + conformance against the CPU reference"
timeout 150 cargo test --release --locked -p rolloutpipe-backends --features cuda \
  --lib --test conformance -- cuda 2>&1 | tee "$OUT/conformance.log" | grep -E "^test |test result|SKIP|panicked|CUDA device" 
[ "${PIPESTATUS[0]}" = 0 ] || { echo "CONFORMANCE FAILED (see $OUT/conformance.log)"; status=1; }

step "benchmarks"
timeout 200 cargo bench --locked -p rolloutpipe-backends --features cuda --bench cuda -- $QUICK \
  2>"$OUT/bench.err" | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "BENCHMARK FAILED (see $OUT/bench.err)"; tail -5 "$OUT/bench.err"; status=1; }

step "PyTorch eager on the same shapes"
timeout 120 python3 scripts/device/torch_eager.py $QUICK 2>&1 | tee "$OUT/torch.txt" || true

step "done"
echo "conformance: $(grep -h 'test result' "$OUT/conformance.log" | tr '\n' ' ')"
echo "table: $OUT/bench.txt (+ $OUT/torch.txt); total $(( $(date +%s) - start )) s"
exit $status
