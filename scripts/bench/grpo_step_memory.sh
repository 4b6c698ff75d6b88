#!/usr/bin/env bash
# Peak memory of the command a user runs, `rolloutpipe grpo-step`, on the Qwen3-0.6B-shaped
# random model of scripts/bench/vs_torch.sh, against PyTorch's GRPO step on the same model and
# batch (vs_torch.py grpo: 2 groups x 4 responses x 48 tokens after 16-token prompts, beta 0.04,
# eps 0.2, token-mean, clip 1.0, AdamW lr 1e-3 wd 0.01), one process at a time in this one
# script, each measured by /usr/bin/time -v. Ours runs without and with --save-grads.
#
# Usage: scripts/bench/grpo_step_memory.sh [--layers N] [--bin PATH]
#   --bin PATH  the rolloutpipe binary (default: target/release/rolloutpipe, built here)
# Needs ~17 GB of RAM (run it under `flock /work/locks/bigmem` on a shared machine), python3,
# cargo and /usr/bin/time. Writes only under target/vs_torch/.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
layers=28
bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) layers="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    *) echo "grpo_step_memory.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x /usr/bin/time ] || { echo "grpo_step_memory.sh: /usr/bin/time is missing (apt-get install time)" >&2; exit 1; }

if [ -n "${VS_TORCH_PYTHON:-}" ]; then
  PY="$VS_TORCH_PYTHON"
else
  VENV="$ROOT/.venv-bench"
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet -r scripts/bench/requirements.txt
  fi
  PY="$VENV/bin/python"
fi
if [ -z "$bin" ]; then
  cargo build --quiet --release -p rolloutpipe-harness --no-default-features --bin rolloutpipe
  bin="${CARGO_TARGET_DIR:-$ROOT/target}/release/rolloutpipe"
fi

MODEL="$ROOT/target/vs_torch/qwen3-0.6b-shape-l$layers"
if [ ! -f "$MODEL/model.safetensors" ]; then
  mkdir -p "$MODEL"
  "$PY" scripts/bench/vs_torch.py make-model "$MODEL" --layers "$layers"
fi
LOG="$ROOT/target/vs_torch/grpo-step-l$layers"
mkdir -p "$LOG"
# vs_torch.py's batch: the same LCG token ids and rewards.
"$PY" - "$LOG/batch.json" <<'EOF'
import json, sys
sys.path.insert(0, "scripts/bench")
from vs_torch import tokens
v, rewards = 151936, [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
groups = [{"prompt": tokens(100 + g, 16, v),
           "responses": [{"tokens": tokens(200 + g * 4 + i, 48, v), "reward": rewards[g * 4 + i]}
                         for i in range(4)]} for g in range(2)]
json.dump({"groups": groups}, open(sys.argv[1], "w"))
EOF

run() { # name, command...
  local name=$1; shift
  echo "== $name (free: $(free -g | awk '/Mem:/{print $7}') GiB available)" >&2
  /usr/bin/time -v -o "$LOG/$name.time" "$@" > "$LOG/$name.out"
  tail -n 1 "$LOG/$name.out" >&2
}
flags=(grpo-step --model "$MODEL" --batch "$LOG/batch.json" --beta 0.04 --wd 0.01 --force)
run torch "$PY" scripts/bench/vs_torch.py grpo "$MODEL"
run ours "$bin" "${flags[@]}" --out "$LOG/out"
run ours-save-grads "$bin" "${flags[@]}" --out "$LOG/out-grads" --save-grads

"$PY" - "$LOG" <<'EOF'
import sys
log = sys.argv[1]
def peak(name):
    for line in open(f"{log}/{name}.time"):
        if "Maximum resident set size" in line:
            return int(line.split(":")[1]) * 1024 / 1e9
def wall(name):
    for line in open(f"{log}/{name}.time"):
        if "Elapsed (wall clock)" in line:
            parts = [float(p) for p in line.rsplit(": ", 1)[1].split(":")]
            return sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
t = peak("torch")
print("| process | peak RSS GB | vs PyTorch | whole process s |")
print("|---|---:|---:|---:|")
for name in ("torch", "ours", "ours-save-grads"):
    print(f"| {name} | {peak(name):.2f} | {peak(name) / t:.2f}x | {wall(name):.1f} |")
EOF
