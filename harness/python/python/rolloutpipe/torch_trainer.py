"""A PyTorch GRPO trainer with RolloutPipe's objective: transformers' ``Qwen3ForCausalLM`` and
``torch.optim.AdamW``.

The objective and optimizer are the Rust trainer's (backends/src/grpo.rs, optim.rs, SPEC §6),
so that a run trains the same step whichever trainer it uses:

* advantages per group ``(r - mean) / (std + 1e-6)`` (sample or population std, or none);
* per token ``w * (-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * k3)``,
  ``rho = exp(logp - old)``, ``k3 = exp(ref - logp) - (ref - logp) - 1``, log-probs of
  ``log_softmax(logits / T)``; ``w`` is 1 (token-mean) or 1 / len (seq-mean);
* gradients accumulate as *unnormalised* sums per micro-batch; the optimizer step divides by
  the step's normaliser (response tokens or sequences), clips the global norm with torch's
  ``clip_grad_norm_`` rule ``min(1, max / (norm + 1e-6))`` and applies AdamW.

``old`` is the rollout's log-probs (``rl.old_logprobs = "rollout"``) or the current weights'
own, detached (``"recompute"``: ratio 1); ``ref`` is the reference model's (``rl.beta > 0``)
or the current weights' (KL 0). ``tests_vllm/test_torch_trainer.py`` checks loss, gradients
and the updated weights against ``rolloutpipe grpo-step`` on the same batch.
"""

import math

import numpy as np
import torch

GRPO_KEYS = ("eps_low", "eps_high", "beta", "temperature")


def param_names(cfg):
    """The parameters in the Rust trainer's flat order (backends/src/weights.rs
    ``param_specs``): the order of the AdamW moments in checkpoints."""
    names = ["model.embed_tokens.weight"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + n for n in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    names.append("model.norm.weight")
    if not cfg.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    return names


def advantages(rewards, std="sample"):
    """GRPO advantages of one group's rewards (backends/src/grpo.rs ``advantages``)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        raise ValueError("group has no rewards")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"non-finite reward in the group: {r.tolist()}")
    mean = r.sum() / r.size
    ss = ((r - mean) ** 2).sum()
    if std == "none":
        denom = 1.0
    elif std in ("pop", "population"):
        denom = math.sqrt(ss / r.size) + 1e-6
    elif std == "sample":
        if r.size < 2:
            raise ValueError("sample standard deviation needs at least 2 rewards per group")
        denom = math.sqrt(ss / (r.size - 1)) + 1e-6
    else:
        raise ValueError(f"std {std!r}: expected sample, pop or none")
    return ((r - mean) / denom).tolist()


def load_safetensors(blob):
    """Named tensors of a safetensors blob."""
    from safetensors.torch import load

    return load(bytes(blob))


def save_safetensors(tensors):
    """A safetensors blob of named tensors (contiguous f32 copies), byte for byte what the Rust
    side writes for the same tensors (its ``{"format": "pt"}`` metadata included), so the Ray
    driver recognises a sync's weights as the trainer's export and passes the trainer's own
    object-store copy on instead of putting them again."""
    from safetensors.torch import save

    return save({k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()},
                metadata={"format": "pt"})


def build_model(model_config, weights, dtype=torch.float32):
    """A ``Qwen3ForCausalLM`` with ``model_config`` (HF config.json values) holding ``weights``
    (name -> tensor, HF names; a tied model's ``lm_head.weight`` may be absent)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config.from_dict(dict(model_config))
    cfg._attn_implementation = "eager"
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in weights.items()}, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return model


SMALL = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
         "tie_word_embeddings": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0}


def write_random_model(path, seed, **shape):
    """A seeded random Qwen3 directory (``config.json`` + ``model.safetensors``, HF names) of
    :data:`SMALL`'s shape with ``shape``'s overrides: head_dim 32, the smallest vLLM's CPU
    attention takes. Matrices and embeddings are N(0, 0.02²) as Qwen3 initialises them;
    RMSNorm weights are 1 + N(0, 0.1²), so that the norms' gradients are exercised too."""
    import json
    import os

    from safetensors.torch import save_file

    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
           "torch_dtype": "float32", "hidden_act": "silu", "attention_bias": False,
           **SMALL, **shape}
    if os.path.exists(os.path.join(path, "config.json")):
        raise FileExistsError(f"{path} already holds a model")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in param_names(cfg):
        shape_of = _shape(cfg, name)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(shape_of, generator=g)
        else:
            tensors[name] = 0.02 * torch.randn(shape_of, generator=g)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def _shape(cfg, name):
    d, f, v, hd = (cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"],
                   cfg["head_dim"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    for suffix, shape in (("embed_tokens.weight", (v, d)), ("lm_head.weight", (v, d)),
                          ("q_proj.weight", (q, d)), ("k_proj.weight", (kv, d)),
                          ("v_proj.weight", (kv, d)), ("o_proj.weight", (d, q)),
                          ("q_norm.weight", (hd,)), ("k_norm.weight", (hd,)),
                          ("gate_proj.weight", (f, d)), ("up_proj.weight", (f, d)),
                          ("down_proj.weight", (d, f))):
        if name.endswith(suffix):
            return shape
    return (d,)  # input / post-attention / final norms


class TorchTrainer:
    """GRPO on a ``Qwen3ForCausalLM`` with AdamW, accumulate-then-step like the Rust trainer.

    ``rl`` holds the objective and optimizer settings under the ``[rl]`` keys of the run's
    config (``lr``, ``weight_decay``, ``max_grad_norm``, ``eps_low``, ``eps_high``, ``beta``,
    ``temperature``, ``std``, ``aggregation``, ``old_logprobs``); ``reference`` the KL
    reference's weights: without it (or where a sequence brings none) the reference log-probs
    are the current weights' (KL 0), as in the Rust trainer and ``grpo-step``."""

    def __init__(self, model_config, weights, rl, reference=None, threads=None,
                 dtype=torch.float32):
        if threads is not None:
            # Process-wide: beside in-process vLLM engines leave it None (their CPU attention
            # checks that the thread count it planned with is the one it runs with).
            torch.set_num_threads(max(1, threads))
        self.cfg = dict(model_config)
        self.rl = dict(rl)
        self.dtype = dtype
        self.model = build_model(self.cfg, weights, dtype)
        self.model.train()
        self.names = param_names(self.cfg)
        params = dict(self.model.named_parameters())
        self.params = [params[n] for n in self.names]
        self.opt = torch.optim.AdamW(
            self.params, lr=self.rl["lr"], betas=(0.9, 0.999), eps=1e-8,
            weight_decay=self.rl["weight_decay"], foreach=False)
        self.ref = None
        if reference is not None:
            self.ref = build_model(self.cfg, reference, dtype).eval()
            self.ref.requires_grad_(False)
        self.since_opt = []  # (response tokens, sequences) per micro-batch since the step
        self.zero_grad()

    # -- forward ---------------------------------------------------------------------------

    def _scored(self, model, seqs, temperature):
        """Per sequence, the log-probs and entropies of its response tokens under ``model``
        (one right-padded forward; the pads follow every real token, so causal attention
        keeps them out of the real rows)."""
        n = max(len(p) + len(r) for p, r in seqs)
        ids = torch.zeros((len(seqs), n), dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, (p, r) in enumerate(seqs):
            ids[i, :len(p) + len(r)] = torch.tensor(list(p) + list(r))
            mask[i, :len(p) + len(r)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits
        out = []
        for i, (p, r) in enumerate(seqs):
            rows = logits[i, len(p) - 1:len(p) + len(r) - 1] / temperature
            logp_all = torch.log_softmax(rows, dim=-1)
            tgt = torch.tensor(list(r), dtype=torch.long)
            logp = logp_all.gather(1, tgt[:, None])[:, 0]
            ent = -(logp_all.exp() * logp_all).sum(-1)
            out.append((logp, ent))
        return out

    def logprobs(self, seqs, temperature=None):
        """Log-probs of each ``(prompt, response)``'s response tokens, as float lists."""
        t = self.rl["temperature"] if temperature is None else temperature
        with torch.no_grad():
            return [lp.tolist() for lp, _ in self._scored(self.model, seqs, t)]

    # -- training --------------------------------------------------------------------------

    def zero_grad(self):
        for p in self.params:
            p.grad = torch.zeros_like(p)

    def accumulate(self, seqs):
        """Forward and backward of one micro-batch, adding the gradient of Σ w·loss to the
        parameters' gradient sums. ``seqs`` are dicts ``prompt``, ``response``,
        ``advantage``, optional ``old_logprobs`` and ``ref_logprobs`` (per response token).
        Returns the sums (``loss_sum``, ``tokens``, ``sequences``, ``kl_sum``,
        ``entropy_sum``, ``clipped``)."""
        rl = self.rl
        t = rl["temperature"]
        lo, hi, beta = 1.0 - rl["eps_low"], 1.0 + rl["eps_high"], rl["beta"]
        scored = self._scored(self.model, [(s["prompt"], s["response"]) for s in seqs], t)
        need_ref = [i for i, s in enumerate(seqs)
                    if self.ref is not None and beta > 0 and s.get("ref_logprobs") is None]
        refs = {}
        if need_ref:
            with torch.no_grad():
                got = self._scored(self.ref, [(seqs[i]["prompt"], seqs[i]["response"])
                                              for i in need_ref], t)
            refs = {i: lp for i, (lp, _) in zip(need_ref, got)}
        total = torch.zeros((), dtype=self.dtype)
        stats = {"loss_sum": 0.0, "tokens": 0, "sequences": len(seqs), "kl_sum": 0.0,
                 "entropy_sum": 0.0, "clipped": 0}
        for i, (s, (logp, ent)) in enumerate(zip(seqs, scored)):
            n = len(s["response"])
            w = 1.0 if rl["aggregation"] == "token_mean" else 1.0 / max(n, 1)
            old = (torch.tensor(s["old_logprobs"], dtype=self.dtype)
                   if s.get("old_logprobs") is not None else logp.detach())
            if s.get("ref_logprobs") is not None:
                ref = torch.tensor(s["ref_logprobs"], dtype=self.dtype)
            else:
                ref = refs.get(i, logp.detach())
            adv = torch.tensor(s["advantage"], dtype=self.dtype)
            rho = torch.exp(logp - old)
            un, cl = rho * adv, torch.clamp(rho, lo, hi) * adv
            dr = ref - logp
            k3 = torch.exp(dr) - dr - 1.0
            loss = w * (-torch.minimum(un, cl) + beta * k3)
            total = total + loss.sum()
            stats["tokens"] += n
            stats["loss_sum"] += float(loss.detach().double().sum())
            stats["kl_sum"] += float(k3.detach().double().sum())
            stats["entropy_sum"] += float(ent.detach().double().sum())
            stats["clipped"] += int((cl < un).sum())
        if not math.isfinite(stats["loss_sum"]):
            raise ValueError("non-finite loss in the micro-batch")
        grads = torch.autograd.grad(total, self.params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if g is not None:
                    p.grad += g
        self.since_opt.append((stats["tokens"], stats["sequences"]))
        return stats

    def normalizer(self):
        """The step's normaliser: its response tokens (token-mean) or sequences (seq-mean)."""
        i = 0 if self.rl["aggregation"] == "token_mean" else 1
        return float(sum(b[i] for b in self.since_opt))

    def gradients(self, normalizer=None):
        """The normalised gradient (sums / normaliser) per parameter name (a tied embedding:
        one tensor, the sum of both uses)."""
        norm = self.normalizer() if normalizer is None else normalizer
        return {n: p.grad / norm for n, p in zip(self.names, self.params)}

    def optimizer_step(self, normalizer=None):
        """Normalises, clips and applies AdamW; zeroes the gradients. Returns ``grad_norm``
        (of the normalised gradient, before clipping), ``clip_scale`` and ``step``."""
        norm_by = self.normalizer() if normalizer is None else normalizer
        if not (math.isfinite(norm_by) and norm_by > 0):
            raise ValueError(f"normalizer {norm_by} is not a positive finite number")
        sq = sum(float(p.grad.double().pow(2).sum()) for p in self.params)
        norm = math.sqrt(sq) / norm_by
        if not math.isfinite(norm):
            raise ValueError("non-finite gradient (global norm)")
        mx = self.rl["max_grad_norm"]
        clip = min(mx / (norm + 1e-6), 1.0) if mx > 0 else 1.0
        scale = float(np.float32(clip / norm_by))
        with torch.no_grad():
            for p in self.params:
                p.grad.mul_(scale)
        self.opt.step()
        self.zero_grad()
        self.since_opt = []
        return {"grad_norm": norm, "clip_scale": clip, "step": self.adam_step()}

    # -- weights and moments ---------------------------------------------------------------

    def weights(self):
        """The weights under HF names in the flat order (no ``lm_head`` when tied)."""
        return {n: p.detach() for n, p in zip(self.names, self.params)}

    def export_weights(self):
        """The weights as a safetensors blob (f32, HF names)."""
        return save_safetensors(self.weights())

    def adam_step(self):
        st = self.opt.state.get(self.params[0], {})
        return int(st["step"]) if "step" in st else 0

    def export_moments(self):
        """``(blob, step)``: the AdamW moments flattened in the Rust trainer's order as
        ``adam.m`` / ``adam.v`` (wire.rs ``adam_blob``); zeros at step 0, which both trainers
        then step as fresh moments."""
        def flat(key):
            return torch.cat([self.opt.state[p][key].reshape(-1) if p in self.opt.state
                              else torch.zeros(p.numel(), dtype=self.dtype)
                              for p in self.params])

        return save_safetensors({"adam.m": flat("exp_avg"), "adam.v": flat("exp_avg_sq")}), \
            self.adam_step()

    def import_moments(self, blob, step):
        """Restores moments written by :meth:`export_moments` (or the Rust trainer)."""
        t = load_safetensors(blob)
        m, v = t["adam.m"], t["adam.v"]
        total = sum(p.numel() for p in self.params)
        if m.numel() != total or v.numel() != total:
            raise ValueError(f"optimizer moments hold {m.numel()} values; the model has {total}")
        at = 0
        for p in self.params:
            n = p.numel()
            self.opt.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": m[at:at + n].reshape(p.shape).to(self.dtype).clone(),
                "exp_avg_sq": v[at:at + n].reshape(p.shape).to(self.dtype).clone(),
            }
            at += n
