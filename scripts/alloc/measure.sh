#!/usr/bin/env bash
# The allocation measurement of docs/allocation.md: fixed-G GRPO, a DAPO-style filter, VIGOR and
# Pilot-Commit, SEEDS seeds each, every run starting from one shared SFT model, then
# `rolloutpipe alloc-report` for the table and the accuracy-vs-rollouts / accuracy-vs-time plots.
#
#   bash scripts/alloc/measure.sh                      # SETTING=default OUT=runs/alloc-default
#   SETTING=digits bash scripts/alloc/measure.sh       # the second setting (below)
#
# SETTING=default is today's default learning setup (docs/training.md): 2-digit addition with
# uniform operands, SFT 3,000 steps on the carry-dropping teacher (sft.carry_drop = 0.6), then
# GRPO on the true answers, which learns (+58 test points in 150 steps, most in the first 25).
# SETTING=digits changes only the task's operands (task.operands = "digits": an operand's digit
# count is drawn first, so a quarter of the problems are one-digit sums that never carry, which
# the carry-dropping teacher gets right, and the rest are two-digit sums the SFT model often gets
# wrong): prompt difficulty varies more, so more fixed-G groups are all right or all wrong,
# which is the waste VIGOR and Pilot-Commit exist to remove. It gets its own SFT model, on its own
# training distribution.
#
# Every policy has the fixed-G step's budget of rl.batch_groups x rl.group_size = 16 x 8 = 128
# samples: GRPO spends exactly that (no over-sampling: a zero-variance group just shortens the
# batch); VIGOR and Pilot-Commit are capped at it (alloc.budget = 0 means B x G); the DAPO-style
# filter over-samples replacements for zero-variance groups (up to 3B prompts, the default
# rollout.max_groups_factor), so it spends more per step, which the cumulative-rollout axis
# accounts for.
#
# The target accuracy is fixed before any RL run, from the shared SFT model alone: its held-out
# accuracy (the base run's accuracy_start) + TARGET_DELTA, written to $OUT/target.txt (TARGET=x
# overrides it). alloc-report then excludes, and lists, any run whose own start is at or above it.
set -euo pipefail
cd "$(dirname "$0")/../.."
SETTING=${SETTING:-default}
OUT=${OUT:-runs/alloc-$SETTING}
SEEDS=${SEEDS:-"1 2 3 4 5"}
if [ "$SETTING" = pool ]; then STEPS=${STEPS:-50}; else STEPS=${STEPS:-20}; fi
EVAL_EVERY=${EVAL_EVERY:-1}
EVAL_PROBLEMS=${EVAL_PROBLEMS:-1000}
TARGET_DELTA=${TARGET_DELTA:-0.25}
POLICIES=${POLICIES:-"grpo dapo vigor pilot_commit"}
NICE=${NICE:-19}
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}
# The CPU backend is all the runs use; leaving out the default wgpu feature saves most of a cold
# build on a small machine.
[ -n "${SKIP_BUILD:-}" ] || nice -n "$NICE" cargo build --release --locked -p rolloutpipe-harness \
  --bin rolloutpipe --no-default-features
BIN=${BIN:-target/release/rolloutpipe}
mkdir -p "$OUT"

common=(--set run.progress=false --set run.test_problems=0
        --set run.eval_problems="$EVAL_PROBLEMS" --set run.checkpoint_every=0)
case "$SETTING" in
  default) ;;
  digits) common+=(--set task.operands=digits) ;;
  pool) common+=(--set task.operands=digits --set task.train_pool=256) ;;
  *) echo "SETTING must be default, digits or pool, got $SETTING" >&2; exit 2 ;;
esac

timed() { # label, command...: appends "label: wall s, user s, sys s" to $OUT/times.txt
  local label=$1; shift
  nice -n "$NICE" /usr/bin/time -a -o "$OUT/times.txt" -f "$label: %e s wall, %U s user, %S s sys" "$@"
}

# The shared warm start: a train run of the default SFT (its sft/ model) and one RL step.
if [ ! -f "$OUT/base/sft/config.json" ]; then
  timed "base (SFT)" "$BIN" train "${common[@]}" --set run.seed=0 --set run.steps=1 \
    --set run.eval_every=0 --out "$OUT/base" --force
fi
if [ -z "${TARGET:-}" ]; then
  if [ ! -f "$OUT/target.txt" ]; then
    start=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["accuracy_start"])' "$OUT/base/summary.json")
    python3 -c 'import sys; print(f"{float(sys.argv[1]) + float(sys.argv[2]):.3f}")' "$start" "$TARGET_DELTA" > "$OUT/target.txt"
    echo "target fixed before any RL run: $(cat "$OUT/target.txt") (SFT held-out $start + $TARGET_DELTA)"
  fi
  TARGET=$(cat "$OUT/target.txt")
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

# Seed-major, so an interrupted measurement still has whole seeds of every policy.
for seed in $SEEDS; do
  for p in $POLICIES; do
    dir="$OUT/$p-s$seed"
    if [ -f "$dir/summary.json" ] && grep -q '"complete": true' "$dir/summary.json"; then
      continue
    fi
    # shellcheck disable=SC2046
    timed "$p seed $seed" "$BIN" train "${common[@]}" $(policy_sets "$p") --set run.seed="$seed" \
      --set run.steps="$STEPS" --set run.eval_every="$EVAL_EVERY" \
      --set sft.steps=0 --set model.dir="\"$OUT/base/sft\"" --out "$dir" --force
    tail -n 1 "$OUT/times.txt"
  done
done
"$BIN" alloc-report --runs "$OUT" --target "$TARGET"
