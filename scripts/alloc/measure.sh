#!/usr/bin/env bash
# The allocation measurement of docs/allocation.md: fixed-G GRPO, a DAPO-style filter, VIGOR and
# Pilot-Commit on mixed-digit addition (task.operands = "digits": one- and two-digit operands,
# so pass rates, hence reward variance, differ across prompts), SEEDS seeds each, every run
# starting from one shared partial SFT model, then `rolloutpipe alloc-report` for the table and
# the accuracy-vs-rollouts / accuracy-vs-time plots.
#
#   bash scripts/alloc/measure.sh            # OUT=runs/alloc SEEDS="1 2 3" STEPS=60
#
# Every policy has the fixed-G step's budget of rl.batch_groups x rl.group_size = 16 x 8 = 128
# samples: GRPO spends exactly that (no over-sampling: a zero-variance group just shortens the
# batch); VIGOR and Pilot-Commit are capped at it (alloc.budget = 0 means B x G); the DAPO-style
# filter over-samples replacements for zero-variance groups (up to 3B prompts), so it spends
# more per step, which the cumulative-rollout axis accounts for.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/alloc}
SEEDS=${SEEDS:-"1 2 3"}
STEPS=${STEPS:-60}
SFT_STEPS=${SFT_STEPS:-300}
EVAL_EVERY=${EVAL_EVERY:-10}
POLICIES=${POLICIES:-"grpo dapo vigor pilot_commit"}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
[ -n "${SKIP_BUILD:-}" ] || cargo build --release --locked -p rolloutpipe-harness --bin rolloutpipe
BIN=target/release/rolloutpipe
mkdir -p "$OUT"

common=(--set task.operands=digits --set run.progress=false --set run.test_problems=0
        --set run.eval_problems=300 --set run.checkpoint_every=0)

# The shared warm start: a train run of SFT_STEPS SFT steps (its sft/ model) and one RL step.
if [ ! -f "$OUT/base/sft/config.json" ]; then
  "$BIN" train "${common[@]}" --set run.seed=0 --set run.steps=1 --set run.eval_every=0 \
    --set sft.steps="$SFT_STEPS" --out "$OUT/base" --force
fi

policy_sets() {
  case "$1" in
    grpo) echo "--set alloc.policy=fixed --set rollout.max_groups_factor=1.0" ;;
    dapo) echo "--set alloc.policy=fixed --set rollout.max_groups_factor=3.0" ;;
    vigor) echo "--set alloc.policy=vigor --set alloc.n0=4 --set alloc.rounds=2 --set alloc.increment=4" ;;
    pilot_commit) echo "--set alloc.policy=pilot_commit --set alloc.n_pilot=4 --set alloc.n_commit=4" ;;
    *) echo "unknown policy $1" >&2; exit 2 ;;
  esac
}

for seed in $SEEDS; do
  for p in $POLICIES; do
    dir="$OUT/$p-s$seed"
    if [ -f "$dir/summary.json" ] && grep -q '"complete": true' "$dir/summary.json"; then
      continue
    fi
    # shellcheck disable=SC2046
    /usr/bin/time -f "$p seed $seed: %e s wall, %U s user" \
      "$BIN" train "${common[@]}" $(policy_sets "$p") --set run.seed="$seed" \
      --set run.steps="$STEPS" --set run.eval_every="$EVAL_EVERY" \
      --set sft.steps=0 --set model.dir="\"$OUT/base/sft\"" --out "$dir" --force
  done
done
"$BIN" alloc-report --runs "$OUT"
