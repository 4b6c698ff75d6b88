"""RolloutPipe on Ray: ``python -m rolloutpipe.ray train --config F --out DIR``.

The job is ``rolloutpipe train``'s (same config format, same run directory: metrics.jsonl,
trace.json, checkpoints, ``--resume``), laid out on a Ray cluster:

* each rollout engine is an actor (``EngineActor``) holding an ``EngineHost`` (its backend);
* each verifier is an actor (``VerifierActor``) holding a ``VerifierHost``;
* the trainer is an actor (``TrainerActor``) holding a ``TrainerHost``;
* the driver (this process) holds the scheduling core and carries out its decisions: it runs
  ``rolloutpipe.train`` with ``send`` = :meth:`RayWorkers.send`, which turns each message into
  one actor call.

Weight sync at a step boundary: the trainer actor answers the export and puts the weights
blob it exported into the object store itself (``ray.put`` in the actor); when the driver's
``send("publish", blob)`` carries the same bytes, the driver passes the trainer's
``ObjectRef`` on instead of putting them again (only the start's weights, which come from the
driver's SFT or checkpoint, are put by the driver). Each engine's sync call passes that one
``ObjectRef``, so every engine gets the same object from the store (one put, many gets). The
puts' seconds are recorded beside the run's own ``sync_s`` (metrics.jsonl) in ``ray.json``.

Metrics also go to TensorBoard (and wandb when installed) under Slime's names
(``rolloutpipe.tracking``); the trainer actor measures Slime's ``perf/train_wait_time`` and
``perf/train_time`` with Slime's timer rule.

Ray is started on the loopback address only (``ray.init(address="local",
_node_ip_address="127.0.0.1", include_dashboard=False)``), or joined with ``--address`` to a
cluster started by ``ray start --head --node-ip-address=127.0.0.1`` (see docs/ray.md).
"""

import argparse
import json
import os
import re
import struct
import sys
import time

# Ray turns a node address of 127.0.0.1 into the machine's interface address (and listens on
# every interface) unless clusters are "disabled", as on macOS and Windows; this switch is
# what keeps the node, its servers and its workers on the loopback address. Set before Ray is
# imported (child processes inherit it), and again in `start_ray` if Ray was imported first.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from . import _core
from .tracking import MetricsFollower, Tracker

LOOPBACK = "127.0.0.1"
PLACEMENTS = ("none", "pack", "spread")


def frame_parts(frame):
    """The parts of a wire frame (part 0 is the JSON header) as memoryviews, or None when
    ``frame`` is not one. The layout (harness/src/train/wire.rs): ``b"RPW1"``, u32 LE part
    count n, n u64 LE part lengths, then the parts."""
    if len(frame) < 8 or frame[:4] != b"RPW1":
        return None
    n = int.from_bytes(frame[4:8], "little")
    if not 1 <= n <= 16 or len(frame) < 8 + 8 * n:
        return None
    view, at, parts = memoryview(frame), 8 + 8 * n, []
    for length in struct.unpack_from(f"<{n}Q", frame, 8):
        if at + length > len(frame):
            return None
        parts.append(view[at:at + length])
        at += length
    return parts


def frame_kind(frame):
    """The message's variant name (``"MicroBatch"``, ``"OptStep"``, ``"Exported"``, ...): the
    header is serde's externally tagged JSON, ``"Unit"`` or ``{"Variant": ...}``."""
    parts = frame_parts(frame)
    m = parts and re.match(rb'\{?"(\w+)"', bytes(parts[0][:64]))
    return m.group(1).decode() if m else None


class TrainTimer:
    """Slime's trainer timers (slime/backends/megatron_utils/actor.py): ``train_wait`` starts
    when the trainer is built and whenever a training ends; ``train`` runs from the first
    training call to the end of the last. One record per weight export (a step boundary)
    that had training since the last one: ``train_wait_time`` and ``train_time`` seconds."""

    def __init__(self):
        self.wait_since = None
        self.train_start = None
        self.train_end = None

    def built(self, t):
        self.wait_since = t

    def trained(self, t0, t1):
        if self.train_start is None:
            self.train_start = t0
        self.train_end = t1

    def boundary(self):
        if self.train_start is None or self.wait_since is None:
            return None
        rec = {"train_wait_time": max(self.train_start - self.wait_since, 0.0),
               "train_time": self.train_end - self.train_start}
        self.wait_since, self.train_start = self.train_end, None
        return rec


@ray.remote
class EngineActor:
    """A rollout engine: one ``EngineHost`` (its backend and running requests), or the host
    ``host()`` builds (a picklable factory: ``rolloutpipe.vllm_hosts.VllmEngineHost``)."""

    def __init__(self, host=None):
        self.host = _core.EngineHost() if host is None else host()

    def handle(self, message, published=None):
        return self.host.handle(message, published)

    def report(self):
        """The host's own report (``{}`` for ``EngineHost``)."""
        return getattr(self.host, "report", dict)()

    def placement(self):
        return _placement()


@ray.remote
class VerifierActor:
    """A verifier: one ``VerifierHost`` (the task's verifier and the tokenizer)."""

    def __init__(self):
        self.host = _core.VerifierHost()

    def handle(self, message):
        return self.host.handle(message)

    def placement(self):
        return _placement()


def _placement():
    """Where this actor runs: its node and its placement group (None outside one)."""
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "placement_group_id": ctx.get_placement_group_id()}


@ray.remote
class TrainerActor:
    """The trainer: one ``TrainerHost`` (backend, optimizer state, pending micro-batches).

    ``handle`` answers ``(reply, extra)``. After a weight export, ``extra["weights"]`` is
    ``[ObjectRef]`` of the exported weights blob, put in the object store by this actor, with
    the put's seconds (``put_s``), and ``extra["perf"]`` the step's :class:`TrainTimer`
    record. ``host`` is a picklable factory of another host answering the same messages
    (``rolloutpipe.vllm_hosts.TorchTrainerHost``); default ``TrainerHost``."""

    def __init__(self, host=None):
        self.host = _core.TrainerHost() if host is None else host()
        self.timer = TrainTimer()

    def handle(self, message):
        kind = frame_kind(message)
        t0 = time.time()
        reply = self.host.handle(message)
        t1 = time.time()
        extra = {}
        if kind == "Init":
            self.timer.built(t1)
        elif kind in ("MicroBatch", "OptStep"):
            self.timer.trained(t0, t1)
        elif kind == "Export" and frame_kind(reply) == "Exported":
            t = time.perf_counter()
            extra["weights"] = [ray.put(bytes(frame_parts(reply)[1]))]
            extra["put_s"] = time.perf_counter() - t
            extra["perf"] = self.timer.boundary()
        return reply, extra

    def placement(self):
        return _placement()


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
    each actor asks for. ``placement`` lays the trainer and the engines out in one placement
    group, bundle 0 the trainer's and bundle 1 + i engine i's: ``"pack"`` (Ray's PACK: on as
    few nodes as fit), ``"spread"`` (SPREAD: across nodes), or ``"none"`` (no group: Ray
    places each actor by its resources alone). Verifiers ask for no resources and stay
    outside the group. ``kill_engine_at`` = ``(i, n)`` kills engine i's actor with
    ``ray.kill`` just before its n-th ``engine/i`` message (tests and fault drills: a lost
    engine mid-step); ``kill_trainer_at`` = n kills the trainer's actor just before its n-th
    message, ``kill_trainer_after_export`` = n just after its n-th weight export (before the
    engines fetch the weights object it owns). ``first_phase`` is the run's first step (the checkpoint's on ``--resume``) and
    ``tracker`` a :class:`~rolloutpipe.tracking.Tracker` for the trainer's Slime timers.
    ``engine_host`` / ``trainer_host`` are picklable factories of the hosts the actors hold
    (default: the wheel's ``EngineHost`` / ``TrainerHost``)."""

    def __init__(self, cfg, engine_cpus=1, trainer_cpus=1, engine_gpus=0, trainer_gpus=0,
                 kill_engine_at=None, kill_trainer_at=None, placement="none", first_phase=0,
                 tracker=None, placement_timeout_s=60, kill_trainer_after_export=None,
                 engine_host=None, trainer_host=None):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
        rollout = cfg["rollout"]
        need = rollout["engines"] * engine_cpus + trainer_cpus
        have = ray.cluster_resources().get("CPU", 0)
        if have < need:
            # Ray would queue the actors that do not fit forever; say so instead.
            raise RuntimeError(
                f"the Ray cluster has {have:g} CPUs; {rollout['engines']} engines x {engine_cpus} "
                f"+ the trainer's {trainer_cpus} need {need:g} (start it with num_cpus >= {need:g})")
        self.pg = None
        trainer_opts = {"num_cpus": trainer_cpus, "num_gpus": trainer_gpus}
        engine_opts = [{"num_cpus": engine_cpus, "num_gpus": engine_gpus}
                       for _ in range(rollout["engines"])]
        if placement != "none":
            self.pg = self._placement_group(placement, [trainer_opts] + engine_opts,
                                            placement_timeout_s)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            for b, opts in enumerate([trainer_opts] + engine_opts):
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=b)
        self.engines = [EngineActor.options(**o).remote(engine_host) for o in engine_opts]
        self.verifiers = [
            VerifierActor.options(num_cpus=0).remote() for _ in range(rollout["verifiers"])
        ]
        self.trainer = TrainerActor.options(**trainer_opts).remote(trainer_host)
        self.one_step_off = cfg["run"]["mode"] == "one-step-off"
        self.phase = first_phase
        self.tracker = tracker
        self.published = None
        self.exported = None  # (ObjectRef, weights blob) of the trainer's last export
        self.put_s = []  # the driver's puts (the start's weights)
        self.put_bytes = []
        self.trainer_put_s = []  # the trainer's puts (each export)
        self.trainer_publishes = 0
        self.perf = []
        self.calls = 0
        self.kill_engine_at = kill_engine_at
        self.engine_calls = [0] * len(self.engines)
        self.kill_trainer_at = kill_trainer_at
        self.kill_trainer_after_export = kill_trainer_after_export
        self.trainer_calls = 0
        self.exports = 0
        self.killed = []
        self.engine_reports = []
        self.final_placements = None

    @staticmethod
    def _placement_group(strategy, actor_opts, timeout_s):
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = []
        for o in actor_opts:
            b = {"CPU": o["num_cpus"]}
            if o["num_gpus"]:
                b["GPU"] = o["num_gpus"]
            bundles.append({k: v for k, v in b.items() if v})
        pg = placement_group(bundles, strategy=strategy.upper())
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(
                f"placement group {bundles} ({strategy.upper()}) was not placed within "
                f"{timeout_s}s: the cluster lacks the resources")
        return pg

    def placements(self):
        """Where each actor runs: ``{"trainer": ..., "engines": [...], "verifiers": [...]}``,
        each ``{"node_id", "placement_group_id"}``."""
        get = lambda actors: ray.get([a.placement.remote() for a in actors])  # noqa: E731
        return {"trainer": get([self.trainer])[0], "engines": get(self.engines),
                "verifiers": get(self.verifiers)}

    def _trainer(self, message):
        reply, extra = ray.get(self.trainer.handle.remote(message))
        if "weights" in extra:
            parts = frame_parts(reply)
            self.exported = (extra["weights"][0], bytes(parts[1]))
            self.trainer_put_s.append(extra["put_s"])
            # Export k ends phase k: its training is step k's batch (one-step-off: k - 1's).
            step = self.phase - 1 if self.one_step_off else self.phase
            self.phase += 1
            if extra["perf"] is not None:
                self.perf.append({"step": step, **extra["perf"]})
                if self.tracker is not None:
                    self.tracker.log_perf(step, extra["perf"])
            self.exports += 1
            if self.kill_trainer_after_export == self.exports:
                ray.kill(self.trainer, no_restart=True)
                self.killed.append("trainer")
        return reply

    def send(self, route, message):
        """Delivers one message: ``publish`` makes a weights blob the one engines sync from
        (the trainer's own put of it when it is the weights it exported last, else a put
        here); ``engine/i[/sync]``, ``verifier/i``, ``trainer`` call that actor and wait for
        its reply (the GIL is free while waiting, so the driver's other proxies run)."""
        self.calls += 1
        if route == "publish":
            if self.exported is not None and self.exported[1] == message:
                self.published = self.exported[0]
                self.trainer_publishes += 1
            else:
                t = time.perf_counter()
                self.published = ray.put(message)
                self.put_s.append(time.perf_counter() - t)
                self.put_bytes.append(len(message))
            self.exported = None
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
            return self._trainer(message)
        raise ValueError(f"unknown route {route!r}")

    def shutdown(self):
        self.engine_reports = []
        try:
            self.final_placements = self.placements()
        except Exception:  # noqa: BLE001 - a lost actor has no placement
            self.final_placements = None
        for i, e in enumerate(self.engines):
            if i not in self.killed:
                try:
                    self.engine_reports.append(ray.get(e.report.remote(), timeout=30))
                except Exception as err:  # noqa: BLE001 - a lost actor has no report
                    self.engine_reports.append({"engine": i, "lost": str(err)[:200]})
        for a in self.engines + self.verifiers + [self.trainer]:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)

    def report(self):
        return {
            "calls": self.calls,
            "publishes": self.trainer_publishes + len(self.put_s),
            "trainer_publishes": self.trainer_publishes,
            "put_s": self.put_s,
            "put_bytes": self.put_bytes,
            "trainer_put_s": self.trainer_put_s,
            "perf": self.perf,
            "killed": self.killed,
            "engine_reports": self.engine_reports,
            "placements": self.final_placements,
        }

def checkpoint_next_step(out):
    """The step a ``--resume`` of ``out`` starts at (its latest checkpoint's ``next_step``);
    0 when there is no readable checkpoint (the run itself then refuses to resume, with its
    own message)."""
    root = os.path.join(out, "checkpoints")
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
        with open(os.path.join(root, name, "state.json")) as f:
            return int(json.load(f)["next_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def train(config=None, out=None, sets=(), resume=False, force=False, num_cpus=None,
          address=None, kill_engine_at=None, kill_trainer_at=None, trainer_restarts=0,
          placement="none", tracking=True, kill_trainer_after_export=None, engine_host=None,
          trainer_host=None):
    """Runs the job on Ray and returns ``rolloutpipe.train``'s result dict plus ``ray``
    (actor calls, weight puts and their seconds, the trainer's Slime timers, the node
    address).

    With ``trainer_restarts`` > 0, a run whose trainer actor died (or any run error) is
    continued from its last checkpoint with fresh actors, up to that many times.
    ``placement`` is :class:`RayWorkers`'. With ``tracking`` the metrics also go to
    ``<out>/tensorboard`` (and wandb when installed) under Slime's names, as they are written
    (``rolloutpipe.tracking``). ``engine_host`` / ``trainer_host``: :class:`RayWorkers`'."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    cfg = json.loads(_core.resolve_config(config, out, list(sets), resume))
    out = cfg["run"]["out"]
    if num_cpus is None:
        # Logical CPUs: one per engine and one for the trainer, at least what the machine has.
        num_cpus = max(os.cpu_count() or 1, cfg["rollout"]["engines"] + 1)
    node = start_ray(num_cpus=num_cpus, address=address)
    tracker = Tracker(out, cfg, enabled=tracking)
    attempts = 0
    killed, perf = [], []
    try:
        while True:
            first = checkpoint_next_step(out) if resume else 0
            workers = RayWorkers(cfg, kill_engine_at=kill_engine_at,
                                 kill_trainer_at=kill_trainer_at, placement=placement,
                                 first_phase=first, tracker=tracker,
                                 kill_trainer_after_export=kill_trainer_after_export,
                                 engine_host=engine_host, trainer_host=trainer_host)
            follower = MetricsFollower(out, tracker).start()
            t = time.perf_counter()
            try:
                result = _core.train(config, out, send=workers.send, sets=list(sets),
                                     resume=resume, force=force)
                break
            except _core.RunError:
                killed += workers.killed
                perf += workers.perf
                has_ckpt = os.path.exists(os.path.join(out, "checkpoints", "latest"))
                if attempts >= trainer_restarts or not has_ckpt:
                    raise
                attempts += 1
                # Continue from the last checkpoint with new actors (the run directory's
                # config).
                config, resume, force = None, True, False
                kill_engine_at = kill_trainer_at = kill_trainer_after_export = None
            finally:
                follower.stop()
                workers.shutdown()
    finally:
        tracker.close()
    info = workers.report()
    info.update(node_ip=node, wall_s=time.perf_counter() - t, restarts=attempts,
                killed=killed + info["killed"], perf=perf + info["perf"], placement=placement)
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
    t.add_argument("--placement", choices=PLACEMENTS, default="none",
                   help="lay the trainer and engines out in one placement group: pack, "
                        "spread, or none (default: no group)")
    t.add_argument("--no-tracking", action="store_true",
                   help="no TensorBoard / wandb logging (metrics.jsonl only)")
    a = p.parse_args(argv)
    if a.resume and a.out:
        p.error("--resume and --out are exclusive")
    r = train(config=a.config, out=a.resume or a.out, sets=a.sets, resume=bool(a.resume),
              force=a.force, num_cpus=a.num_cpus, address=a.address,
              trainer_restarts=a.trainer_restarts, placement=a.placement,
              tracking=not a.no_tracking)
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
