"""TensorBoard (and wandb) logging of a run under Slime's metric names, beside metrics.jsonl.

Slime (THUDM/slime, ``slime/observability``) logs through ``logging_utils.log(args, metrics,
step_key)``: TensorBoard scalars at the step the dict carries (``rollout/step`` for rollout
and ``perf/`` metrics, ``train/step`` for trainer metrics), and ``wandb.log`` of the whole
dict. This module writes the metrics we measure *with the same meaning* under Slime's names,
and every numeric field of metrics.jsonl under ``rolloutpipe/<field>`` (docs/ray.md lists
which Slime names are left out and why):

======================== ======================================================================
Slime name               ours
======================== ======================================================================
``perf/rollout_time``    ``rollout_s``: rollout start to batch final (Slime: the seconds of
                         the rollout's ``generate`` call, start to a complete batch)
``perf/train_wait_time`` the trainer's idle seconds since its last training ended (or since
                         it was built), measured in the Ray trainer actor with Slime's
                         ``Timer`` rule (``inverse_timer("train_wait")`` around ``train``)
``perf/train_time``      first micro-batch start to last optimizer step end of the step
``perf/step_time``       ``train_wait_time + train_time``
``perf/wait_time_ratio`` ``train_wait_time / step_time``
``perf/update_weights_time`` ``sync_s`` of the step before: Slime's ``@timer update_weights``
                         runs after ``train(k)`` and is logged with step k + 1's perf
                         metrics; ``sync_s`` of step k is that weight sync (the new weights
                         from the trainer loaded in every engine)
``train/grad_norm``      ``grad_norm``: the pre-clip global gradient norm of the step's last
                         optimizer step, at ``train/step = (step + 1) * opt_steps - 1``
======================== ======================================================================

The ``perf/train_*`` metrics need the trainer's own timestamps, which only the Ray launcher
records (``rolloutpipe.ray``); the in-process run logs the rest.
"""

import json
import os
import sys
import threading

# Slime names for fields of metrics.jsonl with the same definition.
SAME_AS_SLIME = {"perf/rollout_time": "rollout_s"}


def slime_rollout_metrics(m):
    """Slime-named rollout-side metrics of one metrics.jsonl line (step key ``rollout/step``)."""
    return {name: float(m[field]) for name, field in SAME_AS_SLIME.items() if field in m}


def slime_perf_metrics(perf):
    """Slime's ``log_perf_data`` from the trainer's wait and train seconds of one step."""
    wait, train = perf["train_wait_time"], perf["train_time"]
    out = {"perf/train_wait_time": wait, "perf/train_time": train}
    total = wait + train
    if total > 0:  # as Slime: no ratio without time
        out["perf/step_time"] = total
        out["perf/wait_time_ratio"] = wait / total
    return out


def own_metrics(m):
    """Every numeric field of a metrics.jsonl line as ``rolloutpipe/<field>``."""
    return {
        f"rolloutpipe/{k}": float(v)
        for k, v in m.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
    }


class Tracker:
    """Writes scalars to TensorBoard (``<out>/tensorboard``, with tensorboardX) and to wandb
    when ``import wandb`` works (offline unless ``WANDB_MODE`` says otherwise, files under
    ``<out>``). A missing tensorboardX is reported once on stderr, not an error: the run and
    metrics.jsonl do not depend on it. ``enabled=False`` writes nothing."""

    def __init__(self, out, cfg, enabled=True, stderr=sys.stderr):
        self.out, self.cfg, self.stderr = out, cfg, stderr
        self.enabled = enabled
        self.writer = None
        self.wandb = None
        self.opened = False
        self.opt_steps = int(cfg.get("rl", {}).get("opt_steps", 1) or 1)
        self.sync_s = {}  # step -> its sync_s, for the next step's perf/update_weights_time
        self.lock = threading.Lock()

    def _open(self):
        # On the first scalar, so that a run refused at its start (a run directory that
        # exists, a bad config) finds nothing of ours in its directory.
        self.opened = True
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            print("rolloutpipe: tensorboardX is not installed, so no TensorBoard log "
                  "(pip install tensorboardX)", file=self.stderr)
        else:
            self.writer = SummaryWriter(logdir=os.path.join(self.out, "tensorboard"))
        try:
            import wandb
        except ImportError:
            return
        self.wandb = wandb.init(project="rolloutpipe", dir=self.out, config=self.cfg,
                                name=os.path.basename(os.path.abspath(self.out)),
                                mode=os.environ.get("WANDB_MODE", "offline"))
        for key in ("train", "rollout"):
            self.wandb.define_metric(f"{key}/step")
        self.wandb.define_metric("train/*", step_metric="train/step")
        for prefix in ("rollout", "perf", "rolloutpipe"):
            self.wandb.define_metric(f"{prefix}/*", step_metric="rollout/step")

    @property
    def active(self):
        return self.enabled

    def log(self, metrics, step_key, step):
        """Logs ``metrics`` at ``step``, as Slime's ``logging_utils.log`` does (TensorBoard:
        every key but the step key; wandb: the dict with the step key in it)."""
        with self.lock:
            if not metrics or not self.enabled:
                return
            if not self.opened:
                self._open()
            if self.writer is not None:
                for k, v in metrics.items():
                    self.writer.add_scalar(k, v, step)
                self.writer.flush()
            if self.wandb is not None:
                self.wandb.log({**metrics, step_key: step})

    def log_line(self, m):
        """One metrics.jsonl line: rollout-side and own metrics at ``rollout/step``, the
        trainer's at ``train/step``."""
        step = int(m["step"])
        rollout = {**slime_rollout_metrics(m), **own_metrics(m)}
        self.sync_s[step] = float(m.get("sync_s", 0.0))
        if step - 1 in self.sync_s:
            rollout["perf/update_weights_time"] = self.sync_s[step - 1]
        self.log(rollout, "rollout/step", step)
        if "grad_norm" in m and m.get("train_busy_s", 0) > 0:
            train_step = (step + 1) * self.opt_steps - 1
            self.log({"train/grad_norm": float(m["grad_norm"])}, "train/step", train_step)

    def log_perf(self, step, perf):
        self.log(slime_perf_metrics(perf), "rollout/step", step)

    def close(self):
        with self.lock:
            if self.writer is not None:
                self.writer.close()
                self.writer = None
            if self.wandb is not None:
                self.wandb.finish()
                self.wandb = None


class MetricsFollower:
    """Logs each line of ``<out>/metrics.jsonl`` that was not there, as it is, when the follower
    started, while the run writes it (a thread polling every ``interval`` s), and the rest when
    stopped, so TensorBoard follows a long run live. A resumed run rewrites the steps after its
    checkpoint; those lines differ (timings) and are logged again at their step, which
    TensorBoard takes as a restart (it drops the older points from that step on)."""

    def __init__(self, out, tracker, interval=0.5):
        self.path = os.path.join(out, "metrics.jsonl")
        self.tracker = tracker
        self.interval = interval
        self.seen = set(self._lines())
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rolloutpipe-metrics", daemon=True)

    def _lines(self):
        try:
            with open(self.path) as f:
                # A line without its newline is still being written.
                return [line for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []

    def _drain(self):
        for line in self._lines():
            if line not in self.seen:
                self.seen.add(line)
                self.tracker.log_line(json.loads(line))

    def _run(self):
        while not self.stop_event.wait(self.interval):
            self._drain()

    def start(self):
        if self.tracker.active:
            self.thread.start()
        return self

    def stop(self):
        if self.thread.is_alive():
            self.stop_event.set()
            self.thread.join()
        if self.tracker.active:
            self._drain()


def train(config, out, send=None, sets=(), resume=False, force=False, tracking=False):
    """``rolloutpipe train``'s whole job (``rolloutpipe._core.train``: same arguments, same
    result). With ``tracking`` the metrics also go to ``<out>/tensorboard`` (and wandb when
    installed) under Slime's names as they are written; the in-process run has no trainer
    timers, so no ``perf/train_*`` (the Ray launcher logs those)."""
    from . import _core

    if not tracking:
        return _core.train(config, out, send=send, sets=list(sets), resume=resume, force=force)
    cfg = json.loads(_core.resolve_config(config, out, list(sets), resume))
    tracker = Tracker(cfg["run"]["out"], cfg)
    follower = MetricsFollower(cfg["run"]["out"], tracker).start()
    try:
        return _core.train(config, out, send=send, sets=list(sets), resume=resume, force=force)
    finally:
        follower.stop()
        tracker.close()
