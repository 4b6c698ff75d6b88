"""Measurements of the vLLM layout (docs/vllm.md), run with the venv of scripts/vllm/setup.sh:

    nice -n 10 .venv-vllm/bin/python scripts/vllm/measure.py --out runs/vllm-measure [PARTS]

PARTS (default all, in this order):

* ``compare``: ``rolloutpipe compare``'s tail workload (1 engine, up to 192 tokens, 8 groups
  of 8, one group per micro-batch, malformed answers -0.5, sampled at temperature 8 so that
  end-of-sequence is uncertain) on the Ray layout (a vLLM engine actor and the PyTorch trainer
  actor, separate processes: in one process the two share the GIL and cannot overlap). vLLM
  refuses temperatures above 2, so the temperature is folded into the model: the SFT model's
  final RMSNorm weight divided by 8 makes its logits those of T = 8, sampled and trained at
  T = 1 (the same distributions and log-probs). Sync and rolloutpipe alternate
  for ``--repeats`` rounds from one SFT model (300 steps);
  each run summarised by the medians over its steps after step 0; per mode the median over
  runs with a percentile-bootstrap 95% interval (10,000 seeded resamples), and the paired
  per-round change rolloutpipe / sync - 1 with its interval (compare's method).
* ``overhead``: the default job's shape (16 groups of 8, 2 engines, 6 tokens) for 8 steps from
  the same kind of SFT model, three ways alternating for ``--repeats`` rounds: RolloutPipe's own
  engines and trainer in process (threads), vLLM engines with RolloutPipe's trainer (its
  ``TrainerHost`` behind the wire), and vLLM engines with the PyTorch trainer; per-step
  medians of the step time, rollout, rollout-to-train-end, weight sync and trainer busy time.
* ``learn``: the default job (SFT 3,000 steps, 150 GRPO steps, rolloutpipe mode) with vLLM
  engines and the PyTorch trainer for each of ``--seeds``: independent test accuracy at RL
  start and at the end (summary.json).

Each part writes ``OUT/<part>.json`` and ``OUT/<part>.md`` as its runs end, so an interrupted
measurement keeps what finished; a finished run is not rerun (its metrics are read back).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

import rolloutpipe as rp
from rolloutpipe import vllm as rp_vllm

QUIET = ["run.progress=false", "run.test_problems=0", "run.eval_every=0",
         "run.checkpoint_every=0", "run.eval_problems=50"]
TAIL = QUIET + ["run.steps=12", "rl.batch_groups=8", "rl.micro_batch=1", "rollout.engines=1",
                "rl.max_new_tokens=192", "task.format_penalty=0.5"]
FLATTEN = 8.0  # compare's temperature, folded into the model (vLLM refuses T > 2)
SHAPE = QUIET + ["run.steps=8"]


def median_ci(values, seed=0, resamples=10_000):
    """Median with a percentile-bootstrap 95% interval (compare's ``median_ci``)."""
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=float)
    if len(v) < 2:
        m = float(np.median(v)) if len(v) else float("nan")
        return {"median": m, "lo": m, "hi": m, "n": len(v)}
    rng = np.random.default_rng(seed)
    meds = np.median(v[rng.integers(0, len(v), size=(resamples, len(v)))], axis=1)
    return {"median": float(np.median(v)), "lo": float(np.quantile(meds, 0.025)),
            "hi": float(np.quantile(meds, 0.975)), "n": len(v)}


def fmt(iv, digits=3, pct=False):
    k = 100.0 if pct else 1.0
    s = "%" if pct else ""
    return (f"{k * iv['median']:+.{digits}f}{s} [{k * iv['lo']:+.{digits}f}, "
            f"{k * iv['hi']:+.{digits}f}]" if pct else
            f"{iv['median']:.{digits}f} [{iv['lo']:.{digits}f}, {iv['hi']:.{digits}f}]")


def read_metrics(d):
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_once(kind, out, sets):
    """One run (skipped when ``out`` holds a finished one); its metrics lines."""
    if os.path.exists(os.path.join(out, "summary.json")):
        with open(os.path.join(out, "summary.json")) as f:
            if json.load(f).get("complete"):
                return read_metrics(out)
    t = time.time()
    if kind == "ours":
        rp.train(None, out, sets=sets, force=True)
    elif kind == "vllm-ray":
        rp_vllm.train(None, out, sets=sets, force=True, tracking=False, use_ray=True)
    elif kind == "vllm+rust-trainer":
        cfg = json.loads(rp.resolve_config(None, out, sets, False))
        w = rp_vllm.LocalWorkers(cfg, trainer_host=rp.TrainerHost())
        try:
            rp.train(None, out, send=w.send, sets=sets, force=True)
        finally:
            w.close()
    else:
        rp_vllm.train(None, out, sets=sets, force=True, tracking=False)
    print(f"  {kind} -> {out} in {time.time() - t:.0f}s", flush=True)
    return read_metrics(out)


def per_run(ms):
    """A run's medians over its steps after step 0."""
    ms = ms[1:]
    el = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(ms, ms[1:])]
    pick = lambda k: float(np.median([m[k] for m in ms]))  # noqa: E731
    return {"r2t": pick("rollout_to_train_end_s"), "wait": pick("trainer_wait_ratio"),
            "rollout": pick("rollout_s"), "busy": pick("train_busy_s"), "sync": pick("sync_s"),
            "step": float(np.median(el)) if el else float("nan")}


def sft_base(out, sets):
    """An SFT model (the run's ``sft/``) every run of a part starts from."""
    base = os.path.join(out, "sft-base")
    if not os.path.exists(os.path.join(base, "sft", "model.safetensors")):
        rp.train(None, base, sets=sets + ["run.steps=1"], force=True)
    return os.path.join(base, "sft")


def flattened(model, out, k):
    """``model`` with its final RMSNorm weight divided by ``k``: its logits are the original's
    over k, so sampling it at T = 1 samples the original at T = k."""
    import shutil

    from safetensors.torch import load_file, save_file

    flat = os.path.join(out, f"sft-flat{k:g}")
    if not os.path.exists(os.path.join(flat, "model.safetensors")):
        os.makedirs(flat, exist_ok=True)
        shutil.copy(os.path.join(model, "config.json"), flat)
        w = load_file(os.path.join(model, "model.safetensors"))
        w["model.norm.weight"] = w["model.norm.weight"] / k
        save_file(w, os.path.join(flat, "model.safetensors"), metadata={"format": "pt"})
    return flat


def write(out, name, data, md):
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md, flush=True)


def compare(out, repeats):
    model = flattened(sft_base(out, TAIL + ["sft.steps=300"]), out, FLATTEN)
    sets = TAIL + [f'model.dir="{model}"', "sft.steps=0"]
    runs = {"sync": [], "rolloutpipe": []}
    for k in range(repeats):
        for mode in runs:
            ms = run_once("vllm-ray", os.path.join(out, "compare", mode, f"rep{k}"),
                          sets + [f'run.mode="{mode}"'])
            runs[mode].append(per_run(ms))
        summary = {m: {q: median_ci([r[q] for r in rs], seed=7) for q in rs[0]}
                   for m, rs in runs.items()}
        n = len(runs["rolloutpipe"])
        cut = {q: median_ci([runs["rolloutpipe"][i][q] / runs["sync"][i][q] - 1
                             for i in range(n)], seed=7) for q in ("r2t", "wait")}
        share = summary["sync"]["rollout"]["median"] / summary["sync"]["r2t"]["median"]
        md = (f"compare on vLLM (Ray: 1 engine actor + trainer actor, tail workload), {n} "
              "interleaved round(s); medians "
              "with 95% bootstrap intervals\n\n| mode | rollout-to-train-end s | trainer waiting "
              "ratio | rollout s | trainer busy s | weight sync s |\n|---|---|---|---|---|---|\n")
        for m, s in summary.items():
            md += (f"| {m} | {fmt(s['r2t'])} | {fmt(s['wait'])} | {fmt(s['rollout'])} | "
                   f"{fmt(s['busy'])} | {fmt(s['sync'], 4)} |\n")
        md += (f"\nrolloutpipe vs sync, paired by round: rollout-to-train-end "
               f"{fmt(cut['r2t'], 1, True)}, trainer waiting ratio {fmt(cut['wait'], 1, True)}; "
               f"the rollout is {share:.2f} of a sync step.\n")
        write(out, "compare", {"runs": runs, "summary": summary, "cut": cut}, md)


def overhead(out, repeats):
    model = sft_base(out, SHAPE + ["sft.steps=300"])
    sets = SHAPE + [f'model.dir="{model}"', "sft.steps=0"]
    kinds = ["ours", "vllm+rust-trainer", "vllm"]
    runs = {k: [] for k in kinds}
    for r in range(repeats):
        for kind in kinds:
            ms = run_once(kind, os.path.join(out, "overhead", kind, f"rep{r}"), sets)
            runs[kind].append(per_run(ms))
        summary = {k: {q: median_ci([x[q] for x in rs], seed=7) for q in rs[0]}
                   for k, rs in runs.items()}
        md = (f"per-step cost, default job's shape (16 x 8, 2 engines, 6 tokens), "
              f"{len(runs['vllm'])} interleaved round(s) of 8 steps; medians over rounds of "
              "each run's median over steps 1-7, 95% bootstrap intervals\n\n"
              "| engines + trainer | step s | rollout s | rollout-to-train-end s | weight sync s "
              "| trainer busy s |\n|---|---|---|---|---|---|\n")
        names = {"ours": "RolloutPipe CPU engines + trainer (threads)",
                 "vllm+rust-trainer": "vLLM engines + RolloutPipe trainer (wire)",
                 "vllm": "vLLM engines + PyTorch trainer (wire)"}
        for k, s in summary.items():
            md += (f"| {names[k]} | {fmt(s['step'])} | {fmt(s['rollout'])} | {fmt(s['r2t'])} | "
                   f"{fmt(s['sync'], 4)} | {fmt(s['busy'])} |\n")
        write(out, "overhead", {"runs": runs, "summary": summary}, md)


def learn(out, seeds):
    rows = []
    for s in seeds:
        d = os.path.join(out, "learn", f"seed{s}")
        run_once("vllm", d, [f"run.seed={s}", "run.progress=false"])
        with open(os.path.join(d, "summary.json")) as f:
            summ = json.load(f)
        with open(os.path.join(d, "vllm.json")) as f:
            order = rp_vllm.order_totals(json.load(f)["engines"])
        rows.append({"seed": s, "summary": summ, "order": order})
        md = ("default job with vLLM engines and the PyTorch trainer (rolloutpipe mode): "
              "independent test accuracy (1,000 additions, greedy)\n\n| seed | at RL start | "
              "after RL | change, points | vLLM: waited / started, overtaken, stalls |\n"
              "|---|---|---|---|---|\n")
        for r in rows:
            a, b = test_acc(r["summary"])
            o = r["order"]
            md += (f"| {r['seed']} | {a:.3f} | {b:.3f} | {100 * (b - a):+.1f} | "
                   f"{o.get('waited')} / {o.get('started')}, {o.get('overtaken')}, "
                   f"{o.get('stalls')} |\n")
        write(out, "learn", rows, md)


def test_acc(summary):
    """(test accuracy at RL start, at the end) of a summary.json."""
    return summary["test_accuracy_start"], summary["test_accuracy_end"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--overhead-repeats", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("parts", nargs="*", default=["compare", "overhead", "learn"])
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for part in a.parts:
        print(f"== {part}", flush=True)
        if part == "compare":
            compare(a.out, a.repeats)
        elif part == "overhead":
            overhead(a.out, a.overhead_repeats)
        elif part == "learn":
            learn(a.out, a.seeds)
        else:
            p.error(f"unknown part {part!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
