#!/usr/bin/env bash
# The wgpu backend on a machine with a real GPU, in one go (budget: under 8 minutes):
#   1. builds the backends crate with wgpu (release, for the tests and the benchmarks);
#   2. runs the conformance suite on the adapter wgpu picks, with ROLLOUTPIPE_REQUIRE_GPU=1 so
#      that a missing adapter fails instead of skipping;
#   3. runs the criterion benchmarks of backends/benches/wgpu.rs (every kernel, plus generate
#      and train tokens/s of the default model), with ROLLOUTPIPE_BENCH_SHAPES=prod so the
#      matrix products also run at Qwen3-0.6B and 1.7B shapes, and so do end-to-end generate
#      (8 x 64-token prompts, 32 new tokens; f32 and bf16) and a GRPO train step (4 x 128
#      tokens, f32) on random weights (the wgpu_e2e_* groups);
#   4. times the same matrix products (scripts/device/torch_matmul.py) and the same
#      end-to-end workloads (scripts/device/torch_e2e.py: transformers' Qwen3ForCausalLM, f32
#      without TF32 and bf16) in PyTorch on CUDA, when a python with torch (and transformers,
#      for the second) and CUDA is present (TORCH_PYTHON, default python3);
#   5. prints the tables (scripts/device/table.py: every benchmark, then end-to-end tokens/s
#      against PyTorch) and writes them to $OUT/wgpu-table.md when $OUT is set (the device
#      runner's output folder), else to target/device/wgpu-table.md.
#
# Time, estimated (not yet measured on a GPU): build ~2 min, conformance ~1 min, kernel and
# small-model benchmarks ~1.3 min (48 x ~1.6 s), the end-to-end groups ~3 min (mostly the
# host building random 0.6B and 2B-parameter models, ~20 s and ~70 s; each timed case is 11
# iterations, of well under a second each if our kernels reach a few TFLOP/s), PyTorch
# ~1.5 min: ~7-9 min, so the 8-minute budget is not certain; --quick cuts it to ~5 min. The
# log gives each step's start time, so the first GPU run tells which guess was wrong.
#
# Usage: scripts/device/wgpu.sh [--quick]
#   --quick  shorter criterion measurement (0.5 s per benchmark instead of 1 s) and the
#            end-to-end cases at Qwen3-0.6B only, for a check of the script itself or a
#            tight budget (it also runs on lavapipe, where the numbers mean little and a 0.6B
#            generate iteration takes minutes).
# Environment: WGPU_BACKEND / WGPU_ADAPTER_NAME pick the adapter (default: high performance);
# CARGO_NET_OFFLINE=true where the machine has no network (the crates must then be vendored or
# in ~/.cargo already).
set -euo pipefail
cd "$(dirname "$0")/../.."

measure=1
warm=0.3
e2e_shapes=0.6b,1.7b
if [ "${1:-}" = "--quick" ]; then
  measure=0.5
  warm=0.2
  e2e_shapes=0.6b
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
ROLLOUTPIPE_BENCH_SHAPES=prod ROLLOUTPIPE_BENCH_E2E="$e2e_shapes" cargo bench --locked \
  -p rolloutpipe-backends --features wgpu --bench wgpu -- --warm-up-time "$warm" \
  --measurement-time "$measure" 2>&1 \
  | tee -a "$log" | grep -E "wgpu adapter|^wgpu_|time:|thrpt:|^Qwen3|first iteration|SKIP" || true

step "PyTorch on CUDA"
py="${TORCH_PYTHON:-python3}"
torch_json=target/device/torch.jsonl
if "$py" scripts/device/torch_matmul.py > "$torch_json" 2>> "$log"; then
  echo "PyTorch timings: $(wc -l < "$torch_json") shapes" | tee -a "$log"
else
  echo "PyTorch with CUDA not available here (see $log); the table has no PyTorch columns" | tee -a "$log"
  : > "$torch_json"
fi
step "PyTorch end to end ($e2e_shapes)"
# Exits 0 without torch, transformers or CUDA, having printed nothing but its reason.
if "$py" scripts/device/torch_e2e.py --shapes "$e2e_shapes" >> "$torch_json" 2>> "$log"; then
  echo "PyTorch end-to-end timings: $(grep -c '"e2e"' "$torch_json" || true) cases" | tee -a "$log"
else
  echo "torch_e2e.py failed (see $log); the end-to-end table has no PyTorch columns" | tee -a "$log"
fi

step "table"
adapter=$(grep -m1 "wgpu adapter:" "$log" | sed 's/^wgpu adapter: //' || true)
python3 scripts/device/table.py target/criterion "$torch_json" "${adapter:-unknown adapter}" \
  | tee "$outdir/wgpu-table.md"
step "done"
