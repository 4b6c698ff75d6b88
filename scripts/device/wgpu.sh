#!/usr/bin/env bash
# The wgpu backend on a machine with a real GPU, in one go (budget: under 8 minutes):
#   1. builds the backends crate with wgpu (release, for the tests and the benchmarks);
#   2. runs the conformance suite on the adapter wgpu picks, with ROLLOUTPIPE_REQUIRE_GPU=1 so
#      that a missing adapter fails instead of skipping;
#   3. runs the criterion benchmarks of backends/benches/wgpu.rs (every kernel, plus generate
#      and train tokens/s of the default model), with ROLLOUTPIPE_BENCH_SHAPES=prod so the
#      matrix products also run at Qwen3-0.6B and 1.7B shapes;
#   4. times the same matrix products in PyTorch on CUDA (f32 without TF32, and bf16), when a
#      python with torch and CUDA is present (TORCH_PYTHON, default python3);
#   5. prints one table (scripts/device/table.py) and writes it to $OUT/wgpu-table.md when
#      $OUT is set (the device runner's output folder), else to target/device/wgpu-table.md.
#
# Usage: scripts/device/wgpu.sh [--quick]
#   --quick  shorter criterion measurement (0.5 s per benchmark instead of 2 s), for a check
#            of the script itself (it also runs on lavapipe, where the numbers mean little).
# Environment: WGPU_BACKEND / WGPU_ADAPTER_NAME pick the adapter (default: high performance);
# CARGO_NET_OFFLINE=true where the machine has no network (the crates must then be vendored or
# in ~/.cargo already).
set -euo pipefail
cd "$(dirname "$0")/../.."

measure=2
warm=0.5
if [ "${1:-}" = "--quick" ]; then
  measure=0.5
  warm=0.2
elif [ -n "${1:-}" ]; then
  echo "wgpu.sh: unknown argument $1 (only --quick)" >&2
  exit 2
fi
outdir="${OUT:-target/device}"
mkdir -p "$outdir" target/device
log="$outdir/wgpu-log.txt"
: > "$log"
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start )) s)" | tee -a "$log"; }

step "build"
cargo build --release --locked -p rolloutpipe-backends --features wgpu --tests --benches 2>&1 | tail -3 | tee -a "$log"

step "conformance (ROLLOUTPIPE_REQUIRE_GPU=1)"
ROLLOUTPIPE_REQUIRE_GPU=1 cargo test --release --locked -p rolloutpipe-backends --features wgpu \
  --test conformance 2>&1 | tee -a "$log" | grep -E "adapter|test result|FAILED|panicked" || true
if ! grep -q "test result: ok" "$log"; then
  echo "wgpu.sh: the conformance suite failed; see $log" >&2
  exit 1
fi

step "criterion benchmarks"
rm -rf target/criterion/wgpu_*
ROLLOUTPIPE_BENCH_SHAPES=prod cargo bench --locked -p rolloutpipe-backends --features wgpu \
  --bench wgpu -- --warm-up-time "$warm" --measurement-time "$measure" 2>&1 \
  | tee -a "$log" | grep -E "wgpu adapter|^wgpu_|time:|thrpt:" || true

step "PyTorch on CUDA"
py="${TORCH_PYTHON:-python3}"
torch_json=target/device/torch.jsonl
if "$py" scripts/device/torch_matmul.py > "$torch_json" 2>> "$log"; then
  echo "PyTorch timings: $(wc -l < "$torch_json") shapes" | tee -a "$log"
else
  echo "PyTorch with CUDA not available here (see $log); the table has no PyTorch columns" | tee -a "$log"
  : > "$torch_json"
fi

step "table"
adapter=$(grep -m1 "wgpu adapter:" "$log" | sed 's/^wgpu adapter: //' || true)
python3 scripts/device/table.py target/criterion "$torch_json" "${adapter:-unknown adapter}" \
  | tee "$outdir/wgpu-table.md"
step "done"
