#!/usr/bin/env bash
# Peer reference for our GRPO's learning (issue 17): the same SFT'd model, task, reward and RL
# settings under TRL's GRPOTrainer on the CPU, both scored on the same independent test set, the
# two test-accuracy curves plotted side by side (against steps and against rollouts).
#
#   bash scripts/rl/trl_compare.sh [OUT] [--set section.key=value ...]
#
# OUT (default /tmp/rl/trl-compare) must not exist. Extra `--set`s go to our run and, through its
# config.toml, to TRL's. Run by hand, not in CI: about 10-20 minutes on 2 cores (our run on the
# embedded defaults, then TRL for the same number of steps). VENV=DIR reuses a Python
# environment that already has the pinned packages instead of creating .venv-trl.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=${1:-/tmp/rl/trl-compare}
[ $# -gt 0 ] && shift
EVAL_EVERY=${EVAL_EVERY:-25}
if [ -e "$OUT" ]; then
    echo "error: $OUT exists; pass another directory (nothing is overwritten)" >&2
    exit 1
fi

VENV=${VENV:-.venv-trl}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet torch==2.15.0 transformers==5.24.0 trl==1.16.0 \
        tokenizers==0.23.3 datasets==5.2.0 accelerate==1.15.0 safetensors==0.8.0
fi
PY="$VENV/bin/python"

cargo build --release --locked -p rolloutpipe-harness
BIN=target/release/rolloutpipe
mkdir -p "$OUT"

echo "== ours: rolloutpipe train (embedded defaults${*:+, $*})"
"$BIN" train --out "$OUT/ours" --set run.eval_every="$EVAL_EVERY" --set run.progress=false \
    "$@" | tee "$OUT/ours.log"

echo "== the independent test set (the one our run scored itself on)"
seed=$(sed -n 's/^test_seed = //p' "$OUT/ours/config.toml")
n=$(sed -n 's/^test_problems = //p' "$OUT/ours/config.toml")
digits=$(awk '/^\[task\]/{t=1} t&&/^digits = /{print $3; exit}' "$OUT/ours/config.toml")
reverse=()
grep -q '^reverse = true' "$OUT/ours/config.toml" && reverse=(--reverse)
"$BIN" eval --model "$OUT/ours/sft" --task add --digits "$digits" --uniform --seed "$seed" \
    --n "$n" --max-tokens 6 "${reverse[@]}" --write-problems "$OUT/test.jsonl" --out "$OUT/sft_eval.json" \
    | grep -E '"(accuracy|distribution)"'

echo "== TRL GRPOTrainer from the same SFT model"
"$PY" scripts/rl/trl_compare.py export-tokenizer --model "$OUT/ours/sft" --dst "$OUT/model-hf"
"$PY" scripts/rl/trl_compare.py trl --model "$OUT/model-hf" --test "$OUT/test.jsonl" \
    --config "$OUT/ours/config.toml" --eval-every "$EVAL_EVERY" --out "$OUT" 2>&1 \
    | grep -v -E 'it/s\]|s/it\]' | tee "$OUT/trl.log"

"$PY" scripts/rl/trl_compare.py plot --ours "$OUT/ours" --trl "$OUT/trl_curve.json" \
    --svg "$OUT/trl_vs_ours.svg"
