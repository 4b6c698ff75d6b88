#!/usr/bin/env python3
"""Per-policy mechanism statistics of a measure.sh output directory (docs/allocation.md):
rollouts, drawn, trained, extended (Pilot-Commit's commits granted, VIGOR's extensions) and
skipped groups per step, and the share of drawn groups filtered for zero variance, over the
first and the last ten steps (does GRPO's zero-variance share grow as it learns?).

    python3 scripts/alloc/mechanism.py runs/alloc-pool > docs/results/alloc/pool/mechanism.md
"""
import json
import pathlib
import statistics
import sys


def main(root):
    runs = {}
    for d in sorted(pathlib.Path(root).glob("*-s*")):
        if not (d / "metrics.jsonl").exists():
            continue
        policy = d.name.rsplit("-s", 1)[0]
        rows = [json.loads(l) for l in open(d / "metrics.jsonl") if l.strip()]
        runs.setdefault(policy, []).append(rows)
    print(f"Per step, mean over the steps of each run, then mean over {root}'s seeds.\n")
    print("| policy | seeds | rollouts | drawn | trained | extended | skipped | zero-var share of drawn, steps 0-9 | same, last 10 steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in ["grpo", "dapo", "vigor", "pilot_commit"]:
        if policy not in runs:
            continue
        def per_run(f, rows):
            return statistics.mean(f(r) for r in rows)
        def col(f):
            return statistics.mean(per_run(f, rows) for rows in runs[policy])
        def zv(rows):
            d = sum(r["drawn"] for r in rows)
            # Filtered groups other than skips (zero variance; attempts/non-finite are 0 here).
            z = sum(r["filtered"] - r["skipped"] for r in rows)
            return z / d if d else 0.0
        early = statistics.mean(zv(rows[:10]) for rows in runs[policy])
        late = statistics.mean(zv(rows[-10:]) for rows in runs[policy])
        print(f"| {policy} | {len(runs[policy])} | {col(lambda r: r['rollouts']):.1f} | {col(lambda r: r['drawn']):.1f} | "
              f"{col(lambda r: r['trained']):.1f} | {col(lambda r: r['extended']):.1f} | {col(lambda r: r['skipped']):.1f} | "
              f"{early:.3f} | {late:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
