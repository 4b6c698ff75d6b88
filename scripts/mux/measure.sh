#!/usr/bin/env bash
# Tail multiplexing in real `train` runs: rollout-to-train-end with and without
# `rollout.multiplex`, in rolloutpipe mode (and sync, for the rollout's share of a step), run
# interleaved (sync, plain, mux, sync, plain, mux, ...) from one SFT start. Prints per-run
# medians over the timed steps (step 0 left out) and the medians over runs.
#
#   scripts/mux/measure.sh OUT [REPEATS] [STEPS]
#
# Needs the release binary: nice -n 10 cargo build --release -p rolloutpipe-harness --no-default-features
set -euo pipefail
out=${1:?usage: scripts/mux/measure.sh OUT [REPEATS] [STEPS]}
reps=${2:-4}
steps=${3:-12}
bin=${BIN:-target/release/rolloutpipe}
mkdir -p "$out"
# The workload: the default 128-wide model after a short SFT, sampled at temperature 8 so that
# EOS is uncertain and responses run 1-192 tokens (a rollout tail: about half of a sync step);
# malformed answers score -0.5, so groups have mixed rewards; the KL reference pass
# (rl.beta > 0) is the work to move. One engine by default (ENGINES=N to change), so that the
# engine and the trainer are one thread each on a 2-core machine; MAXTOK and TEMP override
# rl.max_new_tokens and rl.temperature.
common=(--set run.eval_every=0 --set run.checkpoint_every=0 --set run.eval_problems=50
  --set run.test_problems=0 --set run.progress=false --set "run.steps=$steps"
  --set rl.beta=0.05 --set rl.batch_groups=8 --set rl.micro_batch=1
  --set "rollout.engines=${ENGINES:-1}"
  --set "rl.max_new_tokens=${MAXTOK:-192}" --set "rl.temperature=${TEMP:-8.0}" --set task.format_penalty=0.5)
# SUMMARY_ONLY=1: only print the summary of the runs already in OUT.
source "$(dirname "$0")/../lib/interleave.sh"
variant() {
  [ "$1" = sync ] && mode=sync
  [ "$1" = mux ] && extra=(--set rollout.multiplex=true)
  return 0
}
[ -n "${SUMMARY_ONLY:-}" ] || interleave sync plain mux
python3 - "$out" "$reps" "$(dirname "$0")/../lib" <<'PY'
import statistics as st, sys
out, reps = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, sys.argv[3])
from runs import ci, run as run_keys
keys = ["rollout_to_train_end_s", "train_busy_s", "rollout_s", "mux_groups", "mux_s", "trained"]
def run(v, r):
    return run_keys(out, v, r, keys)
rows = {v: [run(v, r) for r in range(1, reps + 1)] for v in ["sync", "plain", "mux"]}
print("variant  rep  r2t_s  train_busy_s  rollout_s  mux_groups  mux_s  trained")
for v, rs in rows.items():
    for i, x in enumerate(rs, 1):
        print(f"{v:7} {i:4}  {x['rollout_to_train_end_s']:.3f}  {x['train_busy_s']:.3f}  "
              f"{x['rollout_s']:.3f}  {x['mux_groups']:.1f}  {x['mux_s']:.3f}  {x['trained']:.0f}")
print("medians over runs:")
med = {v: {k: st.median(x[k] for x in rs) for k in keys} for v, rs in rows.items()}
for v, x in med.items():
    print(f"{v:7} r2t {x['rollout_to_train_end_s']:.3f} s, trainer busy {x['train_busy_s']:.3f} s, "
          f"rollout {x['rollout_s']:.3f} s, mux groups {x['mux_groups']:.1f}, mux {x['mux_s']:.3f} s")
pair = [m["rollout_to_train_end_s"] / p["rollout_to_train_end_s"] - 1 for p, m in zip(rows["plain"], rows["mux"])]
busy = [m["train_busy_s"] / p["train_busy_s"] - 1 for p, m in zip(rows["plain"], rows["mux"])]
print("mux vs plain rolloutpipe, paired per repeat: r2t " + ", ".join(f"{x:+.1%}" for x in pair)
      + f" (median {st.median(pair):+.1%}); trainer busy " + ", ".join(f"{x:+.1%}" for x in busy)
      + f" (median {st.median(busy):+.1%})")
for name, xs in [("r2t", pair), ("trainer busy", busy)]:
    lo, hi = ci(xs)
    print(f"{name}: 95% percentile-bootstrap interval of the paired median (10,000 resamples): "
          f"{lo:+.1%} to {hi:+.1%}")
print(f"rollout share of a sync step: {med['sync']['rollout_s'] / med['sync']['rollout_to_train_end_s']:.2f}")
PY
