"""Wire hosts for ``rolloutpipe.train``'s remote transport, written in Python: vLLM rollout
engines (:class:`VllmEngineHost`) and the PyTorch trainer (:class:`TorchTrainerHost`).

They answer the messages ``rolloutpipe.EngineHost`` and ``rolloutpipe.TrainerHost`` answer
(harness/src/train/wire.rs, remote/mod.rs), so ``rolloutpipe.train(config, out, send=...)``
drives them exactly as it drives its own workers: the core decides admission, dispatch,
aborts and the step boundary; these hosts only execute. Worker failures are answered as
``Fatal`` (the run stops with the message); a frame that does not parse raises
:class:`rolloutpipe.wire.WireFormatError`.

Not offered (refused with ``Fatal`` at ``Init`` or on the message): tail multiplexing
(``rollout.multiplex``: the engine's reference model), long-tail migration
(``rollout.migrate``), and engine weight dtypes other than f32.
"""

import os
import shutil
import tempfile
import threading
import time

from . import wire
from .torch_trainer import TorchTrainer, advantages, load_safetensors

# Several vLLM engines in one process share vLLM's module-level forward context, so their
# calls take turns (the trainer still runs beside them); each Ray actor has its own process.
VLLM_LOCK = threading.Lock()


def rid_key(rid):
    """The engine-level key of a core request id (a JSON object)."""
    return f"{rid['step']}/{rid['group']}/{rid['sample']}/{rid['attempt']}"


def fatal(msg):
    return wire.encode({"Fatal": msg})


class VllmEngineHost:
    """A rollout engine answering ``EngineMsg``s with a :class:`~rolloutpipe.vllm_engine.
    VllmEngine`. ``slots`` is the run's ``rollout.slots`` (vLLM's ``max_num_seqs``);
    ``kv_cache_mib`` its KV cache; ``workdir`` where the model directory vLLM opens is written
    (a fresh temporary directory by default, removed by :meth:`close`)."""

    def __init__(self, slots, kv_cache_mib=64, workdir=None, seed=0):
        self.slots = slots
        self.kv_cache_mib = kv_cache_mib
        self.seed = seed
        self.workdir = workdir
        self.own_dir = None
        self.engine = None
        self.index = None
        self.version = 0
        self.rids = {}  # key -> rid (JSON) of the running requests
        self.decode = []  # (running, seconds) per iteration since the last sync
        self.sync_s = []  # seconds of each weight load through vLLM's update route
        self.fail_at = None
        self.added = 0
        self.dead = False

    # -- messages --------------------------------------------------------------------------

    def handle(self, message, published=None):
        name, body = wire.variant(wire.decode(message)[0])
        try:
            with VLLM_LOCK:
                if name == "Init":
                    return self._init(body, published)
                if self.engine is None and not self.dead:
                    raise RuntimeError("the engine host has not been initialised "
                                       "(send Init first)")
                if name == "Step":
                    return self._step(body)
                if name == "Sync":
                    return self._sync(body, published)
                if name == "Migrate":
                    return fatal("vLLM engines: long-tail migration (rollout.migrate) is "
                                 "not supported")
                if name == "RefLogprobs":
                    return fatal("vLLM engines: tail multiplexing (rollout.multiplex) is "
                                 "not supported")
        except Exception as e:  # noqa: BLE001 - a worker failure is the run's Fatal
            return fatal(f"vLLM engine {self.index}: {type(e).__name__}: {e}")
        raise wire.WireFormatError(f"bad message header: unknown engine message {name!r}")

    def _init(self, m, published):
        from .vllm_engine import VllmEngine, write_model_dir

        self.index = m["engine"]
        if published is None:
            raise wire.WireFormatError("message is missing its published weights part")
        if m.get("reference"):
            return fatal("vLLM engines: tail multiplexing (rollout.multiplex) is not "
                         "supported")
        if m.get("dtype", "f32") != "f32":
            return fatal(f"vLLM engines: rollout.dtype {m['dtype']!r} is not supported "
                         "(f32 only)")
        if self.workdir is None:
            self.own_dir = self.workdir = tempfile.mkdtemp(prefix=f"rp-vllm-{self.index}-")
        path = write_model_dir(os.path.join(self.workdir, "model"), m["model"],
                               bytes(published))
        self.engine = VllmEngine(path, self.slots, seed=self.seed,
                                 kv_cache_mib=self.kv_cache_mib)
        self.fail_at = m.get("fail_at_request")
        return wire.encode("Ready")

    def _add(self, a, outs):
        rid, p = a["rid"], a["params"]
        if self.dead:
            outs.append({"Lost": [rid]})
            return
        key = rid_key(rid)
        self.engine.add_request(
            key, a["prompt"], max_new_tokens=p["max_new_tokens"],
            temperature=wire.f32_from_bit(p["temperature"]), top_k=p["top_k"],
            top_p=wire.f32_from_bit(p["top_p"]), seed=p["seed"], stop_tokens=p["stop_tokens"])
        self.rids[key] = rid
        self.added += 1
        if self.fail_at is not None and self.added == self.fail_at:
            # Injected failure (fault.fail_engine_at_request): every running request is lost.
            for k in list(self.rids):
                self.engine.cancel_request(k)
            outs.append({"Lost": list(self.rids.values())})
            self.rids.clear()
            self.dead = True

    def _step(self, m):
        if m.get("resumes"):
            return fatal("vLLM engines: long-tail migration (rollout.migrate) is not "
                         "supported")
        outs = []
        for a in m["adds"]:
            self._add(a, outs)
        for rid in m["cancels"]:
            key = rid_key(rid)
            if key in self.rids and self.engine.cancel_request(key):
                del self.rids[key]
                outs.append({"Aborted": rid})
        if m["decode"] and self.rids:
            running = self.engine.active_requests
            t = time.perf_counter()
            done = self.engine.step()
            self.decode.append([running, time.perf_counter() - t])
            for f in done:
                rid = self.rids.pop(f.key)
                outs.append({"Generated": {
                    "rid": rid, "version": self.version, "tokens": f.tokens,
                    "logprobs": wire.f32_bits(f.logprobs)}})
        return wire.encode({"Stepped": {"outs": outs, "active": len(self.rids),
                                        "reprefilled": []}})

    def _sync(self, m, published):
        if published is None:
            raise wire.WireFormatError("message is missing its published weights part")
        if not self.dead:
            self.sync_s.append(self.engine.load_weights(published, m["version"]))
        self.version = m["version"]
        decode, self.decode = self.decode, []
        return wire.encode({"Synced": {"decode": decode}})

    # -- reports ---------------------------------------------------------------------------

    def report(self):
        """The engine's start seconds, weight loads and how vLLM reordered the core's
        admissions (:meth:`VllmEngine.order_report`)."""
        if self.engine is None:
            return {}
        return {"engine": self.index, "start_s": self.engine.start_s, "sync_s": self.sync_s,
                "order": self.engine.order_report()}

    def close(self):
        self.engine = None
        if self.own_dir:
            shutil.rmtree(self.own_dir, ignore_errors=True)
            self.own_dir = None


def _accum(stats):
    return {k: stats[k] for k in ("loss_sum", "tokens", "sequences", "kl_sum",
                                  "entropy_sum", "clipped")}


def group_sequences(groups, rl):
    """The trainer's sequences of wire groups (``WireGroup``), in (step, group) order, with
    their advantages (steps.rs ``train_micro_batch``)."""
    seqs = []
    for g in sorted(groups, key=lambda g: (g["step"], g["group"])):
        rewards = [float(wire.f32_from_bit(s["reward"])) for s in g["samples"]]
        refs = g.get("ref_logprobs")
        for i, (s, a) in enumerate(zip(g["samples"], advantages(rewards, rl["std"]))):
            seq = {"prompt": g["prompt"], "response": s["tokens"], "advantage": a}
            if rl["old_logprobs"] == "rollout":
                seq["old_logprobs"] = wire.f32_from_bits(s["logprobs"]).tolist()
            if refs is not None and i < len(refs):
                if len(refs[i]) != len(s["tokens"]):
                    raise ValueError(f"group {g['group']}: {len(refs[i])} multiplexed reference "
                                     f"log-probs for a {len(s['tokens'])}-token response")
                seq["ref_logprobs"] = wire.f32_from_bits(refs[i]).tolist()
            seqs.append(seq)
    return seqs


class TorchTrainerHost:
    """The trainer answering ``TrainerMsg``s with a :class:`~rolloutpipe.torch_trainer.
    TorchTrainer` (transformers' Qwen3, AdamW)."""

    def __init__(self):
        self.trainer = None
        self.rl = None
        self.accum = None

    def handle(self, message):
        header, parts = wire.decode(message)
        name, body = wire.variant(header)
        t = time.perf_counter()
        try:
            if name == "Init":
                return self._init(body, parts)
            if self.trainer is None:
                raise RuntimeError("the trainer host has not been initialised (send Init first)")
            if name == "MicroBatch":
                return self._micro_batch(body, t)
            if name == "OptStep":
                return self._opt_step(t)
            if name == "Export":
                return self._export(body)
        except Exception as e:  # noqa: BLE001 - a worker failure is the run's Fatal
            return fatal(f"trainer: {type(e).__name__}: {e}")
        raise wire.WireFormatError(f"bad message header: unknown trainer message {name!r}")

    def _init(self, m, parts):
        parts = list(parts)
        if not parts:
            raise wire.WireFormatError("message is missing its weights part")
        weights = load_safetensors(parts.pop(0))
        moments = parts.pop(0) if m.get("adam_step") is not None else None
        reference = load_safetensors(parts.pop(0)) if m.get("reference") else None
        cfg = m["config"]
        self.rl = cfg["rl"]
        # trainer.threads is not applied: torch's thread count is process-wide, and vLLM
        # engines in the same process run with the count they started with (on Ray the
        # trainer actor's OpenMP threads are its CPUs).
        self.trainer = TorchTrainer(m["model"], weights, self.rl, reference=reference)
        if moments is not None:
            self.trainer.import_moments(moments, m["adam_step"])
        self.accum = _accum({"loss_sum": 0.0, "tokens": 0, "sequences": 0, "kl_sum": 0.0,
                             "entropy_sum": 0.0, "clipped": 0})
        return wire.encode("Ready")

    def _micro_batch(self, groups, t):
        seqs = group_sequences(groups, self.rl)
        stats = self.trainer.accumulate(seqs)
        for k in self.accum:
            self.accum[k] += stats[k]
        all_tokens = sum(len(s["prompt"]) + len(s["response"]) for s in seqs)
        return wire.encode({"MicroBatchDone": {
            "stats": _accum(stats), "tokens": stats["tokens"], "all_tokens": all_tokens,
            "secs": time.perf_counter() - t}})

    def _opt_step(self, t):
        norm = self.trainer.normalizer()
        st = self.trainer.optimizer_step(norm)
        accum, self.accum = self.accum, {k: type(v)(0) for k, v in self.accum.items()}
        return wire.encode({"OptDone": {
            "grad_norm": st["grad_norm"], "clip_scale": st["clip_scale"], "step": st["step"],
            "accum": accum, "normalizer": norm, "secs": time.perf_counter() - t}})

    def _export(self, m):
        parts = [self.trainer.export_weights()]
        step = None
        if m["optimizer"]:
            blob, step = self.trainer.export_moments()
            parts.append(blob)
        return wire.encode({"Exported": {"adam_step": step}}, parts)
