#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU, in one go (budget: ~4 minutes on one
# H200 from a pack, estimated; a cargo build adds ~4; each step has its own timeout so a hang
# cannot eat the rest). docs/device.md says how to run it on a lent machine.
#   1. finds what to run: the release executables of scripts/device/pack.sh (target/device-pack,
#      built on a machine that has Rust: the lent GPU machine has no toolchain and no network),
#      or, where cargo exists, builds them with --features cuda (release; the driver is loaded
#      at run time); links cuBLAS and NVRTC where cudarc looks for them (scripts/device/lib.sh);
#   2. the CUDA unit tests and the conformance suite against the CPU reference
#      (ROLLOUTPIPE_REQUIRE_CUDA=1: a missing device fails instead of skipping);
#   3. the benchmark table (backends/benches/cuda.rs): per-kernel TFLOP/s and GB/s against
#      the device's peak and cuBLAS, end-to-end generation and GRPO-step tokens/s at
#      Qwen3-0.6B and 1.7B shapes;
#   4. PyTorch eager on the same shapes (scripts/device/torch_eager.py) when torch and
#      transformers are installed (nothing is downloaded: the device machine is offline).
# Logs and the table go to $OUT (default target/cuda-device). Usage:
#   bash scripts/device/cuda.sh [--quick | --smoke]
#   --quick  the benchmark's and PyTorch's short forms;
#   --smoke  a rehearsal of the script on a machine without a GPU: the CUDA tests and the
#            benchmark skip instead of failing (ROLLOUTPIPE_REQUIRE_CUDA unset).
# On a lent machine (device tool): pack here first (bash scripts/device/pack.sh), then
#   run(command="bash scripts/device/cuda.sh", carry=["target/device-pack"], timeout_s=480)
set -uo pipefail
cd "$(dirname "$0")/../.."
QUICK=
case "${1:-}" in
  "") export ROLLOUTPIPE_REQUIRE_CUDA=1 ;;
  --quick) QUICK=--quick; export ROLLOUTPIPE_REQUIRE_CUDA=1 ;;
  --smoke) QUICK=--quick ;;
  *) echo "cuda.sh: unknown argument $1 (only --quick or --smoke)" >&2; exit 2 ;;
esac
source scripts/device/lib.sh
OUT=${OUT:-target/cuda-device}
mkdir -p "$OUT"
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-$(nproc)}
start=$(date +%s)
status=0
step() { echo; echo "== $1 ($(( $(date +%s) - start )) s)"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/device.txt"
device_runner || exit 2
setup_cuda_libs

if [ "$have_pack" = 0 ]; then
  step "build (--features cuda, release)"
  timeout "$(limit 240)" cargo build --release --locked -p rolloutpipe-backends --features cuda \
    --tests --benches 2>&1 | tail -3 || { echo "build failed"; exit 1; }
fi

step "unit tests + conformance against the CPU reference"
if [ "$have_pack" = 1 ]; then
  # From the package's folder, as cargo runs a test; both filtered to the CUDA tests.
  (cd backends; rc=0; for t in unit conformance engine; do timeout "$(limit 150)" "$bin/$t" cuda || rc=$?; done; exit $rc) 2>&1
else
  timeout "$(limit 150)" cargo test --release --locked -p rolloutpipe-backends --features cuda \
    --lib --test conformance --test engine -- cuda 2>&1
fi | tee "$OUT/conformance.log" | grep -E "^test |test result|SKIP|panicked|CUDA device"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "CONFORMANCE FAILED (see $OUT/conformance.log)"; status=1; }

step "benchmarks"
if [ "$have_pack" = 1 ]; then
  timeout "$(limit 200)" "$bin/bench-cuda" --bench $QUICK 2>"$OUT/bench.err"
else
  timeout "$(limit 200)" cargo bench --locked -p rolloutpipe-backends --features cuda --bench cuda -- $QUICK \
    2>"$OUT/bench.err"
fi | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "BENCHMARK FAILED (see $OUT/bench.err)"; tail -5 "$OUT/bench.err"; status=1; }

step "PyTorch eager on the same shapes"
timeout "$(limit 120)" python3 scripts/device/torch_eager.py $QUICK 2>&1 | tee "$OUT/torch.txt" || true

step "done"
echo "conformance: $(grep -h 'test result' "$OUT/conformance.log" | tr '\n' ' ')"
echo "table: $OUT/bench.txt (+ $OUT/torch.txt); total $(( $(date +%s) - start )) s"
exit $status
