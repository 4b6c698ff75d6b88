"""RolloutPipe's train job with vLLM rollout engines and a PyTorch trainer:
``python -m rolloutpipe.vllm train --config F --out DIR [--ray]``.

The job is ``rolloutpipe train``'s (same config keys, modes, run directory: metrics.jsonl,
trace.json, checkpoints, ``sft/``, ``final/``, ``--resume``; TensorBoard under Slime's names):
the scheduling core in this process decides every admission, dispatch, abort and step
boundary (``rolloutpipe.train`` with a ``send``), and

* each rollout engine is a :class:`~rolloutpipe.vllm_hosts.VllmEngineHost` (one vLLM engine),
* the trainer is a :class:`~rolloutpipe.vllm_hosts.TorchTrainerHost` (transformers' Qwen3
  and ``torch.optim.AdamW``, RolloutPipe's GRPO objective),
* the verifiers are the wheel's ``VerifierHost`` (the task's verifier and tokenizer),

either in this process (the default: the hosts answer ``send`` directly; vLLM engines take
turns, the trainer runs beside them) or, with ``--ray``, as Ray actors
(``rolloutpipe.ray``: engines and trainer as actors, the trainer's weights put once into the
object store per sync, ``--placement pack|spread``, ``--address`` to join a cluster).

The SFT warm start (``sft.steps``) runs in this process on RolloutPipe's CPU backend and its
model goes to the vLLM engines and the trainer as the first published weights; ``model.dir``
with ``sft.steps = 0`` starts from a Hugging Face Qwen3 directory instead. The run directory
also gets ``vllm.json``: each engine's start seconds, its weight loads through vLLM's update
route, and how vLLM's own scheduling departed from the core's admission order.
"""

import argparse
import functools
import json
import os
import sys
import time

from . import _core
from .vllm_hosts import TorchTrainerHost, VllmEngineHost


class LocalWorkers:
    """The hosts in this process and the ``send`` that reaches them. ``trainer_host`` replaces
    the PyTorch trainer (``rolloutpipe.TrainerHost()``: RolloutPipe's own, for comparisons)."""

    def __init__(self, cfg, kv_cache_mib=64, trainer_host=None):
        r = cfg["rollout"]
        self.engines = [VllmEngineHost(r["slots"], kv_cache_mib=kv_cache_mib)
                        for _ in range(r["engines"])]
        self.verifiers = [_core.VerifierHost() for _ in range(r["verifiers"])]
        self.trainer = TorchTrainerHost() if trainer_host is None else trainer_host
        self.published = None

    def send(self, route, message):
        if route == "publish":
            self.published = message
            return b""
        kind, _, rest = route.partition("/")
        if kind == "engine":
            i, _, sync = rest.partition("/")
            return self.engines[int(i)].handle(message, self.published if sync else None)
        if kind == "verifier":
            return self.verifiers[int(rest)].handle(message)
        if kind == "trainer":
            return self.trainer.handle(message)
        raise ValueError(f"unknown route {route!r}")

    def reports(self):
        return [e.report() for e in self.engines]

    def close(self):
        for e in self.engines:
            e.close()


def train(config=None, out=None, sets=(), resume=False, force=False, use_ray=False,
          address=None, placement="none", num_cpus=None, tracking=True, kv_cache_mib=64,
          trainer_restarts=0, kill_engine_at=None, kill_trainer_at=None):
    """Runs the job with vLLM engines and the PyTorch trainer; returns ``rolloutpipe.train``'s
    result dict plus ``vllm`` (per engine: start seconds, weight-load seconds, order stats).
    ``use_ray`` lays it out on Ray (``rolloutpipe.ray.train``'s ``address``, ``placement``,
    ``num_cpus``, ``trainer_restarts`` and fault switches apply)."""
    cfg = json.loads(_core.resolve_config(config, out, list(sets), resume))
    t = time.perf_counter()
    if use_ray:
        from . import ray as rp_ray

        engine_host = functools.partial(VllmEngineHost, cfg["rollout"]["slots"],
                                        kv_cache_mib=kv_cache_mib)
        result = rp_ray.train(
            config, out, sets=sets, resume=resume, force=force, num_cpus=num_cpus,
            address=address, placement=placement, tracking=tracking,
            trainer_restarts=trainer_restarts, kill_engine_at=kill_engine_at,
            kill_trainer_at=kill_trainer_at, engine_host=engine_host,
            trainer_host=TorchTrainerHost)
        reports = result["ray"]["engine_reports"]
    else:
        if kill_engine_at or kill_trainer_at or trainer_restarts:
            raise ValueError("fault switches and trainer restarts need use_ray=True")
        from .tracking import train as tracked_train

        workers = LocalWorkers(cfg, kv_cache_mib=kv_cache_mib)
        try:
            result = tracked_train(config, out, send=workers.send, sets=sets, resume=resume,
                                   force=force, tracking=tracking)
            reports = workers.reports()
        finally:
            workers.close()
    info = {"layout": "ray" if use_ray else "in-process", "engines": reports,
            "wall_s": time.perf_counter() - t, "wire": result.get("wire")}
    result["vllm"] = info
    with open(os.path.join(result["dir"], "vllm.json"), "w") as f:
        json.dump(info, f, indent=1)
    return result


def order_totals(reports):
    """The engines' order stats added up."""
    tot = {}
    for r in reports:
        for k, v in r.get("order", {}).items():
            tot[k] = max(tot.get(k, 0), v) if k == "max_wait" else tot.get(k, 0) + v
    return tot


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m rolloutpipe.vllm",
                                description="RolloutPipe's train job with vLLM rollout "
                                            "engines and a PyTorch trainer")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="rolloutpipe train with vLLM engines and the PyTorch "
                                     "trainer, in this process or on Ray")
    t.add_argument("--config", help="TOML file over the default config (as rolloutpipe train)")
    t.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument("--out", help="run directory (overrides run.out)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint")
    t.add_argument("--force", action="store_true")
    t.add_argument("--ray", action="store_true", help="engines and trainer as Ray actors")
    t.add_argument("--address", help="with --ray: join this Ray cluster")
    t.add_argument("--placement", choices=("none", "pack", "spread"), default="none")
    t.add_argument("--num-cpus", type=int, default=None)
    t.add_argument("--trainer-restarts", type=int, default=1,
                   help="with --ray: continue from the last checkpoint after a lost trainer")
    t.add_argument("--kv-cache-mib", type=int, default=64, help="each vLLM engine's KV cache")
    t.add_argument("--no-tracking", action="store_true")
    a = p.parse_args(argv)
    if a.resume and a.out:
        p.error("--resume and --out are exclusive")
    if not a.ray and (a.address or a.placement != "none"):
        p.error("--address and --placement need --ray")
    try:
        r = train(config=a.config, out=a.resume or a.out, sets=a.sets, resume=bool(a.resume),
                  force=a.force, use_ray=a.ray, address=a.address, placement=a.placement,
                  num_cpus=a.num_cpus, tracking=not a.no_tracking, kv_cache_mib=a.kv_cache_mib,
                  trainer_restarts=a.trainer_restarts if a.ray else 0)
    except (_core.RolloutPipeError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    last = r["metrics"][-1] if r["metrics"] else {}
    v = r["vllm"]
    order = order_totals(v["engines"])
    print(f"run {r['dir']}: {r['steps']} steps, vLLM engines {v['layout']}; last step reward "
          f"{last.get('reward', float('nan')):.3f}, weight sync {last.get('sync_s', 0):.4f}s; "
          f"vLLM reordering: {order.get('waited', 0)} of {order.get('started', 0)} requests "
          f"waited, {order.get('overtaken', 0)} overtaken, {order.get('stalls', 0)} stalls")
    return 0


if __name__ == "__main__":
    # Run the importable module's main, so the classes Ray ships are found by import.
    from rolloutpipe import vllm as _launcher

    sys.exit(_launcher.main())
