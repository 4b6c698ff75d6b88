"""RolloutPipe on Ray: ``python -m rolloutpipe.ray train --config F --out DIR``.

The job is ``rolloutpipe train``'s (same config format, same run directory: metrics.jsonl,
trace.json, checkpoints, ``--resume``), laid out on a Ray cluster:

* each rollout engine is an actor (``EngineActor``) holding an ``EngineHost`` (its backend);
* each verifier is an actor (``VerifierActor``) holding a ``VerifierHost``;
* the trainer is an actor (``TrainerActor``) holding a ``TrainerHost``;
* the driver (this process) holds the scheduling core and carries out its decisions: it runs
  ``rolloutpipe.train`` with ``send`` = :meth:`RayWorkers.send`, which turns each message into
  one actor call.

Weight sync at a step boundary: the driver serialises the new weights once (safetensors) and
``send("publish", blob)`` does one ``ray.put``; each engine's sync call passes that one
``ObjectRef``, so every engine gets the same object from the store (one put, many gets). The
put's seconds are recorded beside the run's own ``sync_s`` (metrics.jsonl) in ``ray.json``.

Ray is started on the loopback address only (``ray.init(address="local",
_node_ip_address="127.0.0.1", include_dashboard=False)``), or joined with ``--address`` to a
cluster started by ``ray start --head --node-ip-address=127.0.0.1`` (see docs/ray.md).
"""

import argparse
import json
import os
import sys
import time

# Ray turns a node address of 127.0.0.1 into the machine's interface address (and listens on
# every interface) unless clusters are "disabled", as on macOS and Windows; this switch is
# what keeps the node, its servers and its workers on the loopback address. Set before Ray is
# imported (child processes inherit it), and again in `start_ray` if Ray was imported first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from . import _core

LOOPBACK = "127.0.0.1"


@ray.remote
class EngineActor:
    """A rollout engine: one ``EngineHost`` (its backend and running requests)."""

    def __init__(self):
        self.host = _core.EngineHost()

    def handle(self, message, published=None):
        return self.host.handle(message, published)


@ray.remote
class VerifierActor:
    """A verifier: one ``VerifierHost`` (the task's verifier and the tokenizer)."""

    def __init__(self):
        self.host = _core.VerifierHost()

    def handle(self, message):
        return self.host.handle(message)


@ray.remote
class TrainerActor:
    """The trainer: one ``TrainerHost`` (backend, optimizer state, pending micro-batches)."""

    def __init__(self):
        self.host = _core.TrainerHost()

    def handle(self, message):
        return self.host.handle(message)


def start_ray(num_cpus=None, address=None):
    """Starts a local Ray instance on 127.0.0.1 (or joins ``address``); returns the node's
    address as Ray sees it."""
    if not ray.is_initialized():
        if not address:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
        if address:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(
                address="local",
                _node_ip_address=LOOPBACK,
                include_dashboard=False,
                num_cpus=num_cpus,
                log_to_driver=False,
            )
    node = ray.util.get_node_ip_address()
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    if not address and (node != LOOPBACK or addresses != {LOOPBACK}):
        ray.shutdown()
        raise RuntimeError(f"Ray did not stay on {LOOPBACK}: node {node}, nodes {addresses}")
    return node


class RayWorkers:
    """The job's actors and the ``send`` the driver's transport calls.

    ``engine_cpus`` / ``trainer_cpus`` / ``engine_gpus`` / ``trainer_gpus`` are the resources
    each actor asks for (a multi-node layout puts them with placement groups, docs/ray.md).
    ``kill_engine_at`` = ``(i, n)`` kills engine i's actor with ``ray.kill`` just before its
    n-th ``engine/i`` message (tests and fault drills: a lost engine mid-step);
    ``kill_trainer_at`` = n kills the trainer's actor just before its n-th message."""

    def __init__(self, cfg, engine_cpus=1, trainer_cpus=1, engine_gpus=0, trainer_gpus=0,
                 kill_engine_at=None, kill_trainer_at=None):
        rollout = cfg["rollout"]
        need = rollout["engines"] * engine_cpus + trainer_cpus
        have = ray.cluster_resources().get("CPU", 0)
        if have < need:
            # Ray would queue the actors that do not fit forever; say so instead.
            raise RuntimeError(
                f"the Ray cluster has {have:g} CPUs; {rollout['engines']} engines x {engine_cpus} "
                f"+ the trainer's {trainer_cpus} need {need:g} (start it with num_cpus >= {need:g})")
        self.engines = [
            EngineActor.options(num_cpus=engine_cpus, num_gpus=engine_gpus).remote()
            for _ in range(rollout["engines"])
        ]
        self.verifiers = [
            VerifierActor.options(num_cpus=0).remote() for _ in range(rollout["verifiers"])
        ]
        self.trainer = TrainerActor.options(num_cpus=trainer_cpus, num_gpus=trainer_gpus).remote()
        self.published = None
        self.put_s = []
        self.put_bytes = []
        self.calls = 0
        self.kill_engine_at = kill_engine_at
        self.engine_calls = [0] * len(self.engines)
        self.kill_trainer_at = kill_trainer_at
        self.trainer_calls = 0
        self.killed = []

    def send(self, route, message):
        """Delivers one message: ``publish`` puts a weights blob in the object store;
        ``engine/i[/sync]``, ``verifier/i``, ``trainer`` call that actor and wait for its
        reply (the GIL is free while waiting, so the driver's other proxies run)."""
        self.calls += 1
        if route == "publish":
            t = time.perf_counter()
            self.published = ray.put(message)
            self.put_s.append(time.perf_counter() - t)
            self.put_bytes.append(len(message))
            return b""
        kind, _, rest = route.partition("/")
        if kind == "engine":
            index, _, sync = rest.partition("/")
            i = int(index)
            actor = self.engines[i]
            if sync:
                return ray.get(actor.handle.remote(message, self.published))
            self.engine_calls[i] += 1
            if self.kill_engine_at and self.kill_engine_at == (i, self.engine_calls[i]):
                ray.kill(actor, no_restart=True)
                self.killed.append(i)
            return ray.get(actor.handle.remote(message))
        if kind == "verifier":
            return ray.get(self.verifiers[int(rest)].handle.remote(message))
        if kind == "trainer":
            self.trainer_calls += 1
            if self.kill_trainer_at == self.trainer_calls:
                ray.kill(self.trainer, no_restart=True)
                self.killed.append("trainer")
            return ray.get(self.trainer.handle.remote(message))
        raise ValueError(f"unknown route {route!r}")

    def shutdown(self):
        for a in self.engines + self.verifiers + [self.trainer]:
            ray.kill(a, no_restart=True)

    def report(self):
        return {
            "calls": self.calls,
            "publishes": len(self.put_s),
            "put_s": self.put_s,
            "put_bytes": self.put_bytes,
            "killed": self.killed,
        }


def train(config=None, out=None, sets=(), resume=False, force=False, num_cpus=None,
          address=None, kill_engine_at=None, kill_trainer_at=None, trainer_restarts=0):
    """Runs the job on Ray and returns ``rolloutpipe.train``'s result dict plus ``ray``
    (actor calls, weight puts and their seconds, the node address).

    With ``trainer_restarts`` > 0, a run whose trainer actor died (or any run error) is
    continued from its last checkpoint with fresh actors, up to that many times."""
    cfg = json.loads(_core.resolve_config(config, out, list(sets), resume))
    out = cfg["run"]["out"]
    if num_cpus is None:
        # Logical CPUs: one per engine and one for the trainer, at least what the machine has.
        num_cpus = max(os.cpu_count() or 1, cfg["rollout"]["engines"] + 1)
    node = start_ray(num_cpus=num_cpus, address=address)
    attempts = 0
    killed = []
    while True:
        workers = RayWorkers(cfg, kill_engine_at=kill_engine_at,
                             kill_trainer_at=kill_trainer_at)
        t = time.perf_counter()
        try:
            result = _core.train(config, out, send=workers.send, sets=list(sets),
                                 resume=resume, force=force)
            break
        except _core.RunError:
            killed += workers.killed
            has_ckpt = os.path.exists(os.path.join(out, "checkpoints", "latest"))
            if attempts >= trainer_restarts or not has_ckpt:
                raise
            attempts += 1
            # Continue from the last checkpoint with new actors (the run directory's config).
            config, resume, force = None, True, False
            kill_engine_at = kill_trainer_at = None
        finally:
            workers.shutdown()
    info = workers.report()
    info.update(node_ip=node, wall_s=time.perf_counter() - t, restarts=attempts,
                killed=killed + info["killed"])
    result["ray"] = info
    with open(os.path.join(out, "ray.json"), "w") as f:
        json.dump({**info, "wire": result.get("wire")}, f, indent=1)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m rolloutpipe.ray",
                                description="RolloutPipe's train job on a Ray cluster")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="rolloutpipe train, with engines, verifiers and the "
                                     "trainer as Ray actors")
    t.add_argument("--config", help="TOML file over the default config (as rolloutpipe train)")
    t.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    t.add_argument("--out", help="run directory (overrides run.out)")
    t.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its checkpoint")
    t.add_argument("--force", action="store_true")
    t.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    t.add_argument("--num-cpus", type=int, default=None)
    t.add_argument("--trainer-restarts", type=int, default=1,
                   help="continue from the last checkpoint after a lost trainer (default 1)")
    a = p.parse_args(argv)
    if a.resume and a.out:
        p.error("--resume and --out are exclusive")
    r = train(config=a.config, out=a.resume or a.out, sets=a.sets, resume=bool(a.resume),
              force=a.force, num_cpus=a.num_cpus, address=a.address,
              trainer_restarts=a.trainer_restarts)
    last = r["metrics"][-1] if r["metrics"] else {}
    ray_info = r["ray"]
    print(f"run {r['dir']}: {r['steps']} steps on Ray (node {ray_info['node_ip']}); "
          f"last step reward {last.get('reward', float('nan')):.3f}, "
          f"weight sync {last.get('sync_s', float('nan')):.4f}s; "
          f"{ray_info['calls']} actor calls in {ray_info['wall_s']:.1f}s")
    return 0


if __name__ == "__main__":
    # Run the importable module's main, so the actor classes Ray ships are
    # `rolloutpipe.ray.*` (found by import in the workers), not `__main__.*`.
    from rolloutpipe import ray as _launcher

    sys.exit(_launcher.main())
