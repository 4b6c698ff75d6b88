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
# change) of 16 slots, B = 8 groups of 8, so each engine holds 32 requests at the start and one
# is left with the tail. MINGEN overrides rollout.migrate_min_generated (default 8).
common=(--set run.eval_every=0 --set run.checkpoint_every=0 --set run.eval_problems=50
  --set run.test_problems=0 --set run.progress=false --set "run.steps=$steps"
  --set rl.batch_groups=8 --set rl.micro_batch=1
  --set "rollout.engines=${ENGINES:-2}"
  --set "rl.max_new_tokens=${MAXTOK:-192}" --set "rl.temperature=${TEMP:-8.0}" --set task.format_penalty=0.5)
if [ -z "${SUMMARY_ONLY:-}" ]; then
if [ ! -f "$out/sft/sft/model.safetensors" ]; then
  nice -n 10 "$bin" train --out "$out/sft" --force --mode sync "${common[@]}" \
    --set sft.steps=300 --set run.steps=1 >/dev/null 2>&1
fi
start=(--set sft.steps=0 --set "model.dir=$out/sft/sft")
for r in $(seq 1 "$reps"); do
  for v in sync plain migrate; do
    mode=rolloutpipe; extra=()
    [ "$v" = sync ] && mode=sync
    [ "$v" = migrate ] && extra=(--set rollout.migrate=true --set "rollout.migrate_min_generated=${MINGEN:-8}")
    nice -n 10 "$bin" train --out "$out/$v/rep$r" --force --mode "$mode" "${common[@]}" \
      "${start[@]}" "${extra[@]}" >/dev/null 2>&1
    echo "done $v rep$r" >&2
  done
done
fi
python3 - "$out" "$reps" <<'PY'
import json, random, statistics as st, sys
out, reps = sys.argv[1], int(sys.argv[2])
keys = ["rollout_to_train_end_s", "rollout_s", "train_busy_s", "rollout_idle_s",
        "migrations", "migrated_tokens", "reprefill_s"]
def run(v, r):
    ms = [json.loads(l) for l in open(f"{out}/{v}/rep{r}/metrics.jsonl")][1:]
    return {k: st.median(m.get(k, 0) for m in ms) for k in keys}
rows = {v: [run(v, r) for r in range(1, reps + 1)] for v in ["sync", "plain", "migrate"]}
print("variant  rep  " + "  ".join(keys))
for v, rs in rows.items():
    for i, x in enumerate(rs, 1):
        print(f"{v:7} {i:4}  " + "  ".join(f"{x[k]:.3f}" for k in keys))
print("medians over runs:")
med = {v: {k: st.median(x[k] for x in rs) for k in keys} for v, rs in rows.items()}
for v, x in med.items():
    print(f"{v:7} " + ", ".join(f"{k} {x[k]:.3f}" for k in keys))
rng = random.Random(1)
def ci(xs):
    b = sorted(st.median(rng.choices(xs, k=len(xs))) for _ in range(10000))
    return b[250], b[9749]
for k in ["rollout_to_train_end_s", "rollout_s"]:
    pair = [m[k] / p[k] - 1 for p, m in zip(rows["plain"], rows["migrate"])]
    lo, hi = ci(pair)
    print(f"migrate vs plain rolloutpipe, {k}, paired per repeat: "
          + ", ".join(f"{x:+.1%}" for x in pair)
          + f" (median {st.median(pair):+.1%}; 95% percentile-bootstrap interval, 10,000 resamples: "
          f"{lo:+.1%} to {hi:+.1%})")
print(f"rollout share of a sync step: {med['sync']['rollout_s'] / med['sync']['rollout_to_train_end_s']:.2f}")
PY
