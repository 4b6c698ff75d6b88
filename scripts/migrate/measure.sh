#!/usr/bin/env bash
# Long-tail migration in real `train` runs: rollout-to-train-end and rollout time with and
# without `rollout.migrate`, in rolloutpipe mode (and sync, for the rollout's share of a step),
# run interleaved (sync, plain, migrate, sync, plain, migrate, ...) from one SFT start. Prints
# per-run medians over the timed steps (step 0 left out), the medians over runs, and the paired
# (migrate / plain - 1) medians with 95% percentile-bootstrap intervals.
#
#   scripts/migrate/measure.sh OUT [REPEATS] [STEPS]
#
# Needs the release binary: nice -n 10 cargo build --release -p rolloutpipe-harness --no-default-features
set -euo pipefail
out=${1:?usage: scripts/migrate/measure.sh OUT [REPEATS] [STEPS]}
reps=${2:-6}
steps=${3:-12}
bin=${BIN:-target/release/rolloutpipe}
mkdir -p "$out"
# The workload: the default 128-wide model after a short SFT, sampled at temperature 8 so that
# EOS is uncertain and responses run 1-192 tokens (a rollout tail); 2 engines (ENGINES=N to
# change) of 16 slots each, B = 8 groups of 8 = 64 requests, so both are full at the start and
# one is left with the tail. MINGEN overrides rollout.migrate_min_generated (default 8).
common=(--set run.eval_every=0 --set run.checkpoint_every=0 --set run.eval_problems=50
  --set run.test_problems=0 --set run.progress=false --set "run.steps=$steps"
  --set rl.batch_groups=8 --set rl.micro_batch=1
  --set "rollout.engines=${ENGINES:-2}"
  --set "rl.max_new_tokens=${MAXTOK:-192}" --set "rl.temperature=${TEMP:-8.0}" --set task.format_penalty=0.5)
# SUMMARY_ONLY=1: only print the summary of the runs already in OUT.
source "$(dirname "$0")/../lib/interleave.sh"
variant() {
  [ "$1" = sync ] && mode=sync
  [ "$1" = migrate ] && extra=(--set rollout.migrate=true --set "rollout.migrate_min_generated=${MINGEN:-8}")
  return 0
}
[ -n "${SUMMARY_ONLY:-}" ] || interleave sync plain migrate
python3 - "$out" "$reps" "$(dirname "$0")/../lib" <<'PY'
import statistics as st, sys
out, reps = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from runs import ci, run as run_keys
keys = ["rollout_to_train_end_s", "rollout_s", "train_busy_s", "rollout_idle_s",
        "migrations", "migrated_tokens", "reprefill_s"]
def run(v, r):
    return run_keys(out, v, r, keys)
rows = {v: [run(v, r) for r in range(1, reps + 1)] for v in ["sync", "plain", "migrate"]}
print("variant  rep  " + "  ".join(keys))
for v, rs in rows.items():
    for i, x in enumerate(rs, 1):
        print(f"{v:7} {i:4}  " + "  ".join(f"{x[k]:.3f}" for k in keys))
print("medians over runs:")
med = {v: {k: st.median(x[k] for x in rs) for k in keys} for v, rs in rows.items()}
for v, x in med.items():
    print(f"{v:7} " + ", ".join(f"{k} {x[k]:.3f}" for k in keys))
for k in ["rollout_to_train_end_s", "rollout_s"]:
    pair = [m[k] / p[k] - 1 for p, m in zip(rows["plain"], rows["migrate"])]
    lo, hi = ci(pair)
    print(f"migrate vs plain rolloutpipe, {k}, paired per repeat: "
          + ", ".join(f"{x:+.1%}" for x in pair)
          + f" (median {st.median(pair):+.1%}; 95% percentile-bootstrap interval, 10,000 resamples: "
          f"{lo:+.1%} to {hi:+.1%})")
print(f"rollout share of a sync step: {med['sync']['rollout_s'] / med['sync']['rollout_to_train_end_s']:.2f}")
PY
