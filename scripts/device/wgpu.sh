#!/usr/bin/env bash
# The wgpu backend on a machine with a real GPU, in one go (budget: under 8 minutes):
#   1. finds what to run: the release executables of scripts/device/pack.sh (target/device-pack,
#      built on a machine that has Rust: the lent GPU machine has no toolchain and no network),
#      or, where cargo exists, builds them (release, for the tests and the benchmarks);
#      makes the Vulkan loader and NVIDIA's driver manifest reachable (scripts/device/lib.sh);
#   2. runs the wgpu conformance suite on the adapter wgpu picks, with ROLLOUTPIPE_REQUIRE_GPU=1
#      so that a missing adapter fails instead of skipping;
#   3. runs the tensor-core tests (backends/tests/wgpu_coop.rs), which skip where the adapter
#      has no cooperative matrices, and the look-ahead decoding tests (wgpu_lookahead.rs);
#   4. runs the criterion benchmarks of backends/benches/wgpu.rs (every kernel, plus generate
#      and train tokens/s of the default model), with ROLLOUTPIPE_BENCH_SHAPES=prod so the
#      matrix products also run at Qwen3-0.6B and 1.7B shapes, and so do end-to-end generate
#      (8 x 64-token prompts, 32 new tokens; f32, bf16, and f32 with look-ahead decoding) and a GRPO train step (4 x 128
#      tokens, f32) on random weights (the wgpu_e2e_* groups), and the tensor-core (tc)
#      variants of the products and of both workloads where the adapter has them;
#   5. times the same matrix products (scripts/device/torch_matmul.py) and the same
#      end-to-end workloads (scripts/device/torch_e2e.py: transformers' Qwen3ForCausalLM, f32
#      without TF32 and bf16) in PyTorch on CUDA, when a python with torch (and transformers,
#      for the second) and CUDA is present (TORCH_PYTHON, default python3);
#   6. prints the tables (scripts/device/table.py: every benchmark, then end-to-end tokens/s
#      against PyTorch) and writes them to $OUT/wgpu-table.md when $OUT is set (the device
#      runner's output folder), else to target/device/wgpu-table.md.
# Each step has its own timeout, so a hang cannot eat the rest of a lease.
#
# Time, estimated (not yet measured on a GPU): conformance ~1 min, kernel and small-model
# benchmarks ~1.3 min (48 x ~1.6 s), the end-to-end groups ~3 min (mostly the host building
# random 0.6B and 2B-parameter models, ~20 s and ~70 s; each timed case is 11 iterations, of
# well under a second each if our kernels reach a few TFLOP/s), PyTorch ~1.5 min: ~6-7 min
# from a pack (a cargo build adds ~2 min), so the 8-minute budget is not certain; --quick cuts
# it to ~4 min. The log gives each step's start time, so the first GPU run tells which guess
# was wrong.
#
# On a lent machine (device tool; docs/device.md): pack here first (bash scripts/device/pack.sh), then
#   run(command="bash scripts/device/wgpu.sh --quick", carry=["target/device-pack"], timeout_s=420)
# or both backends in one call: scripts/device/all.sh.
#
# Usage: scripts/device/wgpu.sh [--quick | --smoke]
#   --quick  shorter criterion measurement (0.5 s per benchmark instead of 1 s) and the
#            end-to-end cases at Qwen3-0.6B only, for a tight budget.
#   --smoke  a rehearsal of the script itself on any adapter (lavapipe included; CI runs it,
#            scripts/ci.d/device.sh): the backend-level conformance tests (wgpu_backend::),
#            then a few small-shape kernel benchmarks at 0.1 s each, no production shapes and
#            no end-to-end groups.
# Environment: WGPU_BACKEND / WGPU_ADAPTER_NAME pick the adapter (default: high performance);
# ROLLOUTPIPE_DEVICE_PACK another pack folder; CARGO_NET_OFFLINE=true where a machine with cargo
# has no network (the crates must then be in ~/.cargo already).
set -euo pipefail
cd "$(dirname "$0")/../.."

measure=1
warm=0.3
e2e_shapes=0.6b,1.7b
shapes=prod
filter=
tests=wgpu
case "${1:-}" in
  "") ;;
  --quick) measure=0.5 warm=0.2 e2e_shapes=0.6b ;;
  --smoke) measure=0.1 warm=0.05 e2e_shapes= shapes= tests=wgpu_backend:: \
    filter='^wgpu_(matmul|rmsnorm_fwd|logprob_fwd)/' ;;
  *) echo "wgpu.sh: unknown argument $1 (only --quick or --smoke)" >&2; exit 2 ;;
esac
source scripts/device/lib.sh
outdir="${OUT:-target/device}"
mkdir -p "$outdir" target/device
log="$outdir/wgpu-log.txt"
: > "$log"
start=$(date +%s)
step() { echo "== $* ($(( $(date +%s) - start )) s)" | tee -a "$log"; }

step "what runs, and the machine's Vulkan"
device_runner 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" = 0 ] || exit 2
setup_vulkan 2>&1 | tee -a "$log"
if [ "$have_pack" = 0 ]; then
  step "build"
  timeout "$(limit 300)" cargo build --release --locked -p rolloutpipe-backends --features wgpu --tests \
    --benches 2>&1 | tail -3 | tee -a "$log"
fi

# Runs test target $1 of the backends crate within $2 seconds, the rest of the arguments
# passed to the test harness: the pack's executable (from the package's folder, as cargo runs
# a test), or a cargo build's.
run_tests() {
  local name=$1 secs=$2
  shift 2
  if [ "$have_pack" = 1 ]; then
    (cd backends && timeout "$(limit "$secs")" "$bin/$name" "$@" 2>&1)
  else
    timeout "$(limit "$secs")" cargo test --release --locked -p rolloutpipe-backends \
      --features wgpu --test "$name" -- "$@" 2>&1
  fi
}

step "conformance (ROLLOUTPIPE_REQUIRE_GPU=1)"
export ROLLOUTPIPE_REQUIRE_GPU=1
run_tests conformance 240 "$tests" | tee -a "$log" | grep -E "adapter|test result|FAILED|panicked" || true
if ! grep -q "test result: ok" "$log"; then
  echo "wgpu.sh: the conformance suite failed; see $log" >&2
  exit 1
fi

step "tensor cores (backends/tests/wgpu_coop.rs)"
# The cooperative-matrix products (forward, and backward with its gradient scale) against
# f16-rounded operands, batch invariance, log-probs, decoding and gradients, where the adapter
# has tensor cores; where it has none the tests
# print why and skip, and the tc benchmarks below do not run. A failure here is reported in
# the table's header but does not stop the benchmarks.
coop_log="$outdir/wgpu-coop.txt"
run_tests wgpu_coop 120 > "$coop_log" || true
grep -E "tensor cores:|SKIP|worst|relative to the f32|test result|FAILED|panicked" "$coop_log" | sort -u | tee -a "$log" || true
coop_state="passed"
if ! grep -q "test result: ok" "$coop_log"; then
  coop_state="FAILED (see $coop_log)"
elif grep -q "^SKIP: .*tensor cores need" "$coop_log"; then
  coop_state="not on this adapter: $(grep -m1 "^SKIP: " "$coop_log" | sed 's/^SKIP: //')"
fi
echo "tensor-core tests: $coop_state" | tee -a "$log"

step "look-ahead decoding (backends/tests/wgpu_lookahead.rs)"
# The queued step reads its input tokens from the running step's sampler output and rewrites
# buffers that step reads: on a real GPU this is where wgpu's ordering of queue writes and
# submissions is tested for real. Reported in the table's header; the benchmarks run anyway.
ahead_log="$outdir/wgpu-lookahead.txt"
run_tests wgpu_lookahead 60 > "$ahead_log" || true
grep -E "test result|FAILED|panicked" "$ahead_log" | tee -a "$log" || true
ahead_state="passed"
grep -q "test result: ok. [1-9]" "$ahead_log" || ahead_state="FAILED (see $ahead_log)"
echo "look-ahead tests: $ahead_state" | tee -a "$log"

step "criterion benchmarks"
export CRITERION_HOME="$PWD/target/criterion"
rm -rf "$CRITERION_HOME"/wgpu_*
bench_args=(--warm-up-time "$warm" --measurement-time "$measure" ${filter:+"$filter"})
if [ "$have_pack" = 1 ]; then
  ROLLOUTPIPE_BENCH_SHAPES="$shapes" ROLLOUTPIPE_BENCH_E2E="$e2e_shapes" timeout "$(limit 360)" \
    "$bin/bench-wgpu" --bench "${bench_args[@]}" 2>&1
else
  ROLLOUTPIPE_BENCH_SHAPES="$shapes" ROLLOUTPIPE_BENCH_E2E="$e2e_shapes" timeout "$(limit 360)" cargo bench \
    --locked -p rolloutpipe-backends --features wgpu --bench wgpu -- "${bench_args[@]}" 2>&1
fi | tee -a "$log" | grep -E "wgpu adapter|^wgpu_|time:|thrpt:|^Qwen3|first iteration|SKIP" || true

step "PyTorch on CUDA"
py="${TORCH_PYTHON:-python3}"
torch_json=target/device/torch.jsonl
if timeout "$(limit 150)" "$py" scripts/device/torch_matmul.py > "$torch_json" 2>> "$log"; then
  echo "PyTorch timings: $(wc -l < "$torch_json") shapes" | tee -a "$log"
else
  echo "PyTorch with CUDA not available here (see $log); the table has no PyTorch columns" | tee -a "$log"
  : > "$torch_json"
fi
if [ -n "$e2e_shapes" ]; then
  step "PyTorch end to end ($e2e_shapes)"
  # Exits 0 without torch, transformers or CUDA, having printed nothing but its reason.
  if timeout "$(limit 240)" "$py" scripts/device/torch_e2e.py --shapes "$e2e_shapes" >> "$torch_json" 2>> "$log"; then
    echo "PyTorch end-to-end timings: $(grep -c '"e2e"' "$torch_json" || true) cases" | tee -a "$log"
  else
    echo "torch_e2e.py failed (see $log); the end-to-end table has no PyTorch columns" | tee -a "$log"
  fi
fi

step "table"
adapter=$(grep -m1 "wgpu adapter:" "$log" | sed 's/^wgpu adapter: //' || true)
python3 scripts/device/table.py "$CRITERION_HOME" "$torch_json" \
  "${adapter:-unknown adapter}; tensor-core tests: $coop_state; look-ahead tests: $ahead_state" \
  | tee "$outdir/wgpu-table.md"
step "done"
