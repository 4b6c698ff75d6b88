"""Per-step overhead of the Ray deployment against the in-process run, on the same job.

    python harness/python/bench/bench_ray.py [--steps 4] [--set KEY=VALUE ...]

Runs the job three ways in fresh directories under a temporary root: in-process
(``rolloutpipe.train``), through the wire with every host in this process (``send`` calls the
hosts directly: the cost of encoding and decoding alone), and on a local Ray instance
(127.0.0.1, one actor per engine, verifier and the trainer). Prints one Markdown table row per
way: seconds per step (rollout start to train end, the run's ``rollout_to_train_end_s``), the
weight sync's seconds (``sync_s``, mean over steps), the whole step boundary's (the trainer's
export, the sync and the rest between one step's train end and the next step's rollout start,
from ``elapsed_s``; the last step left out), the ``ray.put`` of the weights (mean over
the weight syncs' puts, the trainer actor's), messages per step and per second of step time,
bytes per step (both directions and the publishes), and the bytes the driver itself put in
the object store per step (the start's weights left out). Steps whose rollout did not produce
the same samples in every way are flagged (they should not be: the job is the default with fewer SFT
steps, in sync mode with one micro-batch per step).
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import rolloutpipe as rp

DEFAULT_SETS = [
    'run.mode="sync"',
    "run.eval_every=0",
    "run.eval_problems=50",
    "run.test_problems=0",
    "run.checkpoint_every=0",
    "run.progress=false",
    "sft.steps=300",
    "rl.micro_batch=16",
]


def loopback_send(cfg):
    """A ``send`` that calls hosts in this process (the wire without Ray)."""
    engines = [rp.EngineHost() for _ in range(cfg["rollout"]["engines"])]
    verifiers = [rp.VerifierHost() for _ in range(cfg["rollout"]["verifiers"])]
    trainer = rp.TrainerHost()
    published = {}
    calls = [0]

    def send(route, msg):
        calls[0] += 1
        if route == "publish":
            published["w"] = msg
            return b""
        kind, _, rest = route.partition("/")
        if kind == "engine":
            i, _, sync = rest.partition("/")
            return engines[int(i)].handle(msg, published.get("w") if sync else None)
        if kind == "verifier":
            return verifiers[int(rest)].handle(msg)
        return trainer.handle(msg)

    return send, calls


def summarize(name, r, wall):
    ms = r["metrics"]
    steps = len(ms)
    row = {
        "way": name,
        "steps": steps,
        "step_s": statistics.mean(m["rollout_to_train_end_s"] for m in ms),
        "rollout_s": statistics.mean(m["rollout_s"] for m in ms),
        "sync_s": statistics.mean(m["sync_s"] for m in ms),
        # The step boundary as a whole (the trainer's export, the weight sync, the metrics
        # line): from one metrics line to the next, less the next step's rollout-to-train-end
        # window; the last step is left out (it also saves final/).
        "boundary_s": statistics.mean(
            b["elapsed_s"] - a["elapsed_s"] - b["rollout_to_train_end_s"]
            for a, b in zip(ms[:-1], ms[1:-1])) if steps > 2 else float("nan"),
        "wall_s": wall,
    }
    wire = r.get("wire")
    if wire:
        row["msgs_per_step"] = wire["calls"] / steps
        row["bytes_per_step"] = (wire["bytes_out"] + wire["bytes_in"] + wire["published_bytes"]) / steps
        # Over the steps themselves (rollout start to train end), not the SFT before them.
        row["msgs_per_s"] = row["msgs_per_step"] / row["step_s"]
    if "ray" in r:
        info = r["ray"]
        # The driver puts the start's weights; the trainer actor puts each export (older
        # launchers: the driver put every publish).
        row["put_s"] = statistics.mean(info.get("trainer_put_s") or info["put_s"])
        row["driver_put_bytes_per_step"] = sum(info["put_bytes"][1:]) / steps
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--set", dest="sets", action="append", default=[])
    a = p.parse_args()
    sets = DEFAULT_SETS + [f"run.steps={a.steps}"] + a.sets
    root = tempfile.mkdtemp(prefix="rp-bench-ray-")
    cfg = json.loads(rp.resolve_config(None, os.path.join(root, "x"), sets))
    rows, trained = [], {}

    t = time.perf_counter()
    r = rp.train(None, os.path.join(root, "local"), sets=sets)
    rows.append(summarize("in-process threads", r, time.perf_counter() - t))
    trained["local"] = sorted(r["trained"])

    send, _ = loopback_send(cfg)
    t = time.perf_counter()
    r = rp.train(None, os.path.join(root, "wire"), send=send, sets=sets)
    rows.append(summarize("wire, hosts in-process", r, time.perf_counter() - t))
    trained["wire"] = sorted(r["trained"])

    from rolloutpipe import ray as rp_ray

    node = rp_ray.start_ray(num_cpus=max(os.cpu_count(), cfg["rollout"]["engines"] + 1))
    t = time.perf_counter()
    r = rp_ray.train(None, os.path.join(root, "ray"), sets=sets, tracking=False)
    rows.append(summarize(f"Ray actors ({node})", r, time.perf_counter() - t))
    trained["ray"] = sorted(r["trained"])

    same = trained["local"] == trained["wire"] == trained["ray"]
    print(f"job: default config with {' '.join(sets)}; same trained samples in all three: {same}")
    print("| way | step (s) | rollout (s) | weight sync `sync_s` (s) | boundary (s) | `ray.put` (s) | messages/step | messages/s | bytes/step | driver puts (bytes/step) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in rows:
        f = lambda k, fmt: (fmt.format(w[k]) if k in w else "–")  # noqa: E731
        print(f"| {w['way']} | {w['step_s']:.3f} | {w['rollout_s']:.3f} | {w['sync_s']:.4f} | "
              f"{w['boundary_s']:.4f} | "
              f"{f('put_s', '{:.4f}')} | {f('msgs_per_step', '{:.0f}')} | {f('msgs_per_s', '{:.0f}')} | "
              f"{f('bytes_per_step', '{:,.0f}')} | {f('driver_put_bytes_per_step', '{:,.0f}')} |")


if __name__ == "__main__":
    main()
