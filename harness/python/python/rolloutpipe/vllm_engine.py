"""A vLLM engine as a RolloutPipe rollout engine.

:class:`VllmEngine` wraps one in-process vLLM engine (``vllm.LLM``, its ``LLMEngine`` stepped
by the caller) behind the calls a RolloutPipe engine answers, so the scheduling core decides
what runs and vLLM only executes it:

* **Admission is the core's.** A request reaches vLLM only when the core admits it
  (``add_request``), never earlier, and with ``priority`` = its admission index on this
  engine: under vLLM's ``scheduling_policy="priority"`` its waiting queue, its token budget and
  its preemption victim (the largest priority value) all follow the core's admission order.
* **Aborts are vLLM's abort** (``LLMEngine.abort_request``); a request already finished is
  not running and is not reported again.
* **Sampling maps one to one:** temperature, top-k (0 = off), top-p, the per-request seed,
  ``stop_token_ids`` = the request's stop tokens (with ``ignore_eos`` so the model config's EOS
  adds nothing), ``max_tokens`` = ``max_new_tokens``; a stop token is part of the response as
  in RolloutPipe's engines. Log-probs are vLLM's ``processed_logprobs`` of the sampled token:
  ``log_softmax(logits / T)``, RolloutPipe's definition, when top-k and top-p are off (with
  them vLLM renormalises over the kept tokens; RolloutPipe's engines do not).
* **Weights** load through vLLM's RL weight-update route (``start_weight_update`` /
  ``update_weights`` / ``finish_weight_update``, the layerwise reload that the NCCL and IPC
  transfer engines use), with a transfer backend registered here that carries a safetensors
  blob in host memory (``rolloutpipe_host``): vLLM's own backends need CUDA. After the reload
  it repacks the CPU GEMM of the embedding and a tied LM head, which the reload leaves stale
  on vLLM's CPU backend (:func:`_repack_cpu_embeddings`).

Where vLLM can still reorder what the core decided, and what :meth:`VllmEngine.order_report`
counts: a request waits in vLLM's queue when an iteration's token budget, ``max_num_seqs``
or the KV cache cannot take it (``waited``); a running request can be preempted when the KV
cache runs out and resumes later (``stalls``: iterations in which a started, unfinished
request produced no token); and requests can start in another order than admitted
(``overtaken``: a request's first token came before that of one admitted earlier on the same
engine and still waiting).

Chunked prefill is off: a prefill split over iterations makes vLLM's sampler rewind the
request's seeded generator, which its CPU generators refuse ("CPU Generator does not use
offset"); a prompt that does not fit an iteration's token budget waits whole instead.

vLLM must run in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before vLLM is
imported. Several engines may share a process (their calls must take turns), but they end
together: an engine's shutdown tears down vLLM's process-wide parallel state
(``cleanup_dist_env_and_memory``), which the others still use.
"""

import dataclasses
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

TRANSFER_BACKEND = "rolloutpipe_host"
_ARCH_KEYS = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


@dataclasses.dataclass
class Finished:
    """A response vLLM finished: tokens, their log-probs, and why it stopped (``stop``,
    ``length``)."""
    key: str
    tokens: list
    logprobs: list
    finish: str


@dataclasses.dataclass
class OrderStats:
    """How vLLM's own scheduling departed from the order the core admitted requests in."""
    admitted: int = 0
    started: int = 0
    waited: int = 0  # requests whose first token came later than the next iteration
    wait_iterations: int = 0  # iterations those requests waited in all
    max_wait: int = 0
    overtaken: int = 0  # (earlier-admitted, later-started-first) pairs
    stalls: int = 0  # iterations a started, unfinished request produced no token
    iterations: int = 0


def _register_transfer_backend():
    """Registers ``rolloutpipe_host``: a weight-transfer engine whose update carries the
    weights as a safetensors blob in host memory, loaded with the layerwise reload."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if TRANSFER_BACKEND in WeightTransferEngineFactory._registry:
        return

    @dataclasses.dataclass
    class HostInitInfo(WeightTransferInitInfo):
        pass

    @dataclasses.dataclass
    class HostUpdateInfo(WeightTransferUpdateInfo):
        blob: bytes = b""

    class HostWeightTransferEngine(WeightTransferEngine):
        init_info_cls = HostInitInfo
        update_info_cls = HostUpdateInfo

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            _repack_cpu_embeddings(self.model)

        def update_weights(self, update_info):
            # The CPU applies the load synchronously: no device to synchronise.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info):
            from safetensors.torch import load

            self.model.load_weights(list(load(update_info.blob).items()))

        def shutdown(self):
            pass

    WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, HostWeightTransferEngine)


def _repack_cpu_embeddings(model):
    """Rebuilds the CPU GEMM of the embedding and LM-head modules from their (reloaded)
    weights. vLLM's CPU backend multiplies by a packed copy of the weight
    (``dispatch_cpu_unquantized_gemm``, made when the weights are processed); a tied LM head
    shares the embedding's weight but loads nothing itself (``lm_head.weight`` is skipped), so
    the layerwise reload leaves its packed copy stale: the logits would come from the old
    weights. Running the layer's own ``process_weights_after_loading`` again (what vLLM runs at
    load) repacks it. Linear layers are repacked by the reload itself (their weight tensor is
    emptied after packing, so they are recognised by a weight with no elements and skipped)."""
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        w = getattr(m, "weight", None)
        if hasattr(m, "cpu_linear") and qm is not None and w is not None and w.numel() > 0:
            qm.process_weights_after_loading(m)


def write_model_dir(path, model_config, weights_blob=None):
    """A Hugging Face model directory vLLM can open: ``config.json`` (with Qwen3's
    architecture named) and, when given, ``model.safetensors``."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(model_config)
    for k, v in _ARCH_KEYS.items():
        cfg.setdefault(k, v)
    cfg.setdefault("torch_dtype", "float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if weights_blob is not None:
        with open(os.path.join(path, "model.safetensors"), "wb") as f:
            f.write(bytes(weights_blob))
    return path


class VllmEngine:
    """One vLLM engine stepped by the caller; see the module documentation.

    ``model_dir`` is a Hugging Face Qwen3 directory (``config.json`` + safetensors);
    ``slots`` is ``max_num_seqs`` (the core never admits more than that to one engine);
    ``kv_cache_mib`` sizes vLLM's CPU KV cache."""

    def __init__(self, model_dir, slots, max_model_len=None, seed=0, kv_cache_mib=64,
                 max_num_batched_tokens=None):
        _register_transfer_backend()
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        kw = {}
        if max_model_len:
            kw["max_model_len"] = max_model_len
        if max_num_batched_tokens:
            kw["max_num_batched_tokens"] = max_num_batched_tokens
        t = time.perf_counter()
        self.llm = LLM(
            model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
            max_num_seqs=slots, scheduling_policy="priority", seed=seed,
            logprobs_mode="processed_logprobs", kv_cache_memory_bytes=int(kv_cache_mib * (1 << 20)),
            weight_transfer_config=WeightTransferConfig(backend=TRANSFER_BACKEND),
            enable_prefix_caching=False, enable_chunked_prefill=False, disable_log_stats=True,
            **kw)
        self.start_s = time.perf_counter() - t
        self.engine = self.llm.llm_engine
        self.llm.init_weight_transfer_engine({"init_info": {}})
        self.slots = slots
        self.active = {}  # key -> {"tokens", "logprobs", "admitted", "first", "order"}
        self.order = OrderStats()
        self.admissions = 0
        self.iteration = 0

    @property
    def active_requests(self):
        return len(self.active)

    def add_request(self, key, prompt_ids, max_new_tokens, temperature=1.0, top_k=0,
                    top_p=1.0, seed=0, stop_tokens=()):
        """Submits one request the core admitted; its vLLM priority is its admission index
        on this engine (earlier admitted, earlier served)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if key in self.active:
            raise ValueError(f"request {key} is already running on this engine")
        params = SamplingParams(
            n=1, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
            seed=int(seed) % (1 << 63), stop_token_ids=[int(s) for s in stop_tokens],
            ignore_eos=True, max_tokens=int(max_new_tokens), min_tokens=0, logprobs=0,
            detokenize=False, output_kind=RequestOutputKind.DELTA)
        prompt = self.engine.renderer.render_cmpl(
            [{"prompt_token_ids": [int(t) for t in prompt_ids]}])[0]
        self.engine.add_request(key, prompt, params, priority=self.admissions)
        self.active[key] = {"tokens": [], "logprobs": [], "admitted": self.iteration,
                            "first": None, "order": self.admissions}
        self.admissions += 1
        self.order.admitted += 1

    def cancel_request(self, key):
        """Aborts a running request in vLLM; False when it is not running here (finished
        and reported already, or never added)."""
        if self.active.pop(key, None) is None:
            return False
        self.engine.abort_request([key])
        return True

    def step(self):
        """One vLLM iteration (prefill and decode of what its scheduler picks); the requests
        it finished."""
        if not self.active:
            return []
        outs = self.engine.step()
        self.iteration += 1
        self.order.iterations += 1
        produced, done = set(), []
        for o in outs:
            st = self.active.get(o.request_id)
            if st is None:
                continue  # cancelled here already
            c = o.outputs[0]
            if c.token_ids:
                produced.add(o.request_id)
                if st["first"] is None:
                    self._started(o.request_id, st)
                st["tokens"] += list(c.token_ids)
                st["logprobs"] += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            if o.finished:
                del self.active[o.request_id]
                done.append(Finished(o.request_id, st["tokens"], st["logprobs"],
                                     c.finish_reason or "stop"))
        self.order.stalls += sum(1 for k, st in self.active.items()
                                 if st["first"] is not None and k not in produced)
        return done

    def _started(self, key, st):
        st["first"] = self.iteration
        wait = self.iteration - st["admitted"] - 1
        o = self.order
        o.started += 1
        if wait > 0:
            o.waited += 1
            o.wait_iterations += wait
            o.max_wait = max(o.max_wait, wait)
        o.overtaken += sum(1 for other in self.active.values()
                           if other["first"] is None and other["order"] < st["order"])

    def order_report(self):
        """The :class:`OrderStats` so far, as a dict."""
        return dataclasses.asdict(self.order)

    def unfinished_in_vllm(self):
        """Requests vLLM itself still holds (waiting or running)."""
        return self.engine.get_num_unfinished_requests()

    def load_weights(self, blob, version=None):
        """Loads a safetensors blob (HF names) through vLLM's weight-update route; refused
        while requests run. Returns the seconds it took."""
        if self.active:
            raise RuntimeError(f"weights cannot change while {len(self.active)} requests run")
        t = time.perf_counter()
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"blob": bytes(blob)}})
        self.llm.finish_weight_update(None if version is None else str(version))
        return time.perf_counter() - t
