"""Shared by the measure scripts' summaries: per-run medians over the timed steps of a
metrics.jsonl (step 0 left out) and a 95% percentile-bootstrap interval of a median."""
import json
import random
import statistics as st

# One generator for the whole summary, so that reprinting (SUMMARY_ONLY=1) gives the same bits.
_rng = random.Random(1)


def run(out, v, r, keys):
    ms = [json.loads(l) for l in open(f"{out}/{v}/rep{r}/metrics.jsonl")][1:]
    return {k: st.median(m.get(k, 0) for m in ms) for k in keys}


def ci(xs):
    b = sorted(st.median(_rng.choices(xs, k=len(xs))) for _ in range(10000))
    return b[250], b[9749]
