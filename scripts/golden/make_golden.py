#!/usr/bin/env python3
"""Makes the golden fixtures that `backends/tests/golden.rs` checks the CPU backend against.

Run by hand (not in CI), from the repository root (add `--qwen3-0.6b DIR` for the opt-in
real-size case, written under DIR/qwen3-0.6b instead of the committed fixtures):

    python3 -m venv /tmp/gv && /tmp/gv/bin/pip install torch transformers safetensors numpy
    /tmp/gv/bin/python scripts/golden/make_golden.py

For each variant it builds a tiny random Hugging Face `Qwen3ForCausalLM` (head_dim 16 is not
hidden/heads = 8 on purpose, grouped-query attention 4 heads / 2 kv heads), saves it as a model
directory, runs a fixed GRPO batch (2 groups x 3 responses of different lengths) and records

- `batch.json`: the batch in the `grpo-step` format (docs/batch-format.md);
- `expected.safetensors`: `logits.{g}.{j}` ([prompt+response length, vocab], raw logits of the
  whole sequence), `logprobs.{g}.{j}` (response tokens, at the sampling temperature) and
  `grad.{hf name}` for every parameter: the gradient of the *normalized* loss;
- `expected.json`: the loss, the objective's settings and the tool versions.

The GRPO loss is SPEC.md section 6 written out independently of the Rust code: advantages with
the sample std (ddof 1) + 1e-6, ratio clipped with eps_low/eps_high, k3 KL to reference
log-probs from a perturbed copy of the model (beta > 0, so the KL gradient is exercised),
token-mean over all response tokens of the batch, log-probs of log_softmax(logits / T).
Variant `tied` (config.json with a top-level `rope_theta`, Hub style) uses old log-probs = detached current (ratio 1, as in the first optimizer step of
a rollout); `untied` gives explicit old log-probs from another perturbed copy, so that some
ratios leave [1 - eps_low, 1 + eps_high] and the clip's zero gradient is exercised too
(config.json with `rope_parameters`, as transformers 5 writes it).
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
OUT = os.path.join(ROOT, "backends", "tests", "fixtures", "golden")

VOCAB = 48
TEMPERATURE = 0.7
EPS_LOW = 0.2
EPS_HIGH = 0.2
BETA = 0.05
STD_EPS = 1e-6


# The opt-in real-size case (`--qwen3-0.6b DIR`): Qwen3-0.6B's shapes, random weights.
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def make_model(tied: bool, seed: int) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(
        **SHAPE,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        attention_bias=False,
        use_cache=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    # HF's init (std 0.02, norms at 1) gives near-uniform logits and tiny gradients that would
    # hide errors; larger weights and non-unit norm gains make every term matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 / p.shape[1] ** 0.5))
    model.eval()
    return model


def perturbed(model: Qwen3ForCausalLM, seed: int, scale: float) -> Qwen3ForCausalLM:
    other = Qwen3ForCausalLM(model.config).to(torch.float32)
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * p.abs().mean())
    other.eval()
    return other


def batch_def():
    """2 groups x 3 responses; prompts and responses of different lengths, varied rewards."""
    g = np.random.default_rng(1234)
    groups = []
    for prompt_len, resp_lens, rewards in [
        (5, [3, 6, 4], [1.0, 0.0, 0.5]),
        (3, [7, 2, 5], [0.0, 1.0, 1.0]),
    ]:
        vocab = SHAPE["vocab_size"]
        prompt = [1] + [int(x) for x in g.integers(3, vocab, prompt_len - 1)]
        responses = []
        for n, r in zip(resp_lens, rewards):
            responses.append({"tokens": [int(x) for x in g.integers(3, vocab, n)], "reward": r})
        groups.append({"prompt": prompt, "responses": responses})
    return groups


def response_logprobs(model, prompt, tokens):
    """Logits of the whole sequence and the response tokens' log-probs at TEMPERATURE."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids).logits[0]  # [len, vocab]
    lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    # The token at position p is predicted by the logits at p - 1.
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logits, lp[pos, torch.tensor(tokens)]


def grpo_loss(model, groups, ref_lps, old_lps):
    total = None
    count = 0
    logits_out, lps_out = {}, {}
    for gi, group in enumerate(groups):
        r = torch.tensor([resp["reward"] for resp in group["responses"]], dtype=torch.float64)
        adv = ((r - r.mean()) / (r.std(unbiased=True) + STD_EPS)).to(torch.float32)
        for j, resp in enumerate(group["responses"]):
            logits, lp = response_logprobs(model, group["prompt"], resp["tokens"])
            logits_out[f"{gi}.{j}"] = logits.detach().clone()
            lps_out[f"{gi}.{j}"] = lp.detach().clone()
            old = lp.detach() if old_lps is None else old_lps[gi][j]
            ratio = torch.exp(lp - old)
            a = adv[j]
            pg = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
            d = ref_lps[gi][j] - lp
            kl = torch.exp(d) - d - 1
            term = (pg + BETA * kl).sum()
            total = term if total is None else total + term
            count += len(resp["tokens"])
    return total / count, logits_out, lps_out


def lps_of(model, groups):
    with torch.no_grad():
        return [[response_logprobs(model, g["prompt"], r["tokens"])[1] for r in g["responses"]] for g in groups]


def make(name: str, tied: bool, seed: int, explicit_old: bool, hub_style_rope: bool, out=OUT):
    model = make_model(tied, seed)
    groups = batch_def()
    ref = lps_of(perturbed(model, seed + 1, 0.05), groups)
    old = lps_of(perturbed(model, seed + 2, 0.04), groups) if explicit_old else None

    model.zero_grad()
    loss, logits, lps = grpo_loss(model, groups, ref, old)
    loss.backward()

    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)
    if hub_style_rope:
        # Checkpoints on the Hub (and transformers < 5) keep rope_theta at the top level;
        # newer transformers writes rope_parameters. One fixture of each keeps both readers tested.
        cfg_path = os.path.join(d, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg["rope_scaling"] = None
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)

    batch = {"groups": []}
    for gi, g in enumerate(groups):
        rs = []
        for j, r in enumerate(g["responses"]):
            rs.append({
                "tokens": r["tokens"],
                "reward": r["reward"],
                "old_logprobs": None if old is None else [float(x) for x in old[gi][j]],
                "ref_logprobs": [float(x) for x in ref[gi][j]],
            })
        batch["groups"].append({"prompt": g["prompt"], "responses": rs})
    with open(os.path.join(d, "batch.json"), "w") as f:
        json.dump(batch, f, indent=1)

    tensors = {}
    for k, v in logits.items():
        tensors[f"logits.{k}"] = v.contiguous()
    for k, v in lps.items():
        tensors[f"logprobs.{k}"] = v.contiguous()
    names = set()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        tensors[f"grad.{pname}"] = p.grad.detach().clone().contiguous()
        names.add(pname)
    if tied:
        assert "lm_head.weight" not in names, "tied model must expose one embedding parameter"
    save_file(tensors, os.path.join(d, "expected.safetensors"))

    # Tokens outside the clip range, and those where the clipped branch is the active one of the
    # min (zero surrogate gradient: A > 0 above 1 + eps_high, A < 0 below 1 - eps_low).
    clipped = 0
    clip_active = 0
    if old is not None:
        for gi, g in enumerate(groups):
            r = torch.tensor([resp["reward"] for resp in g["responses"]], dtype=torch.float64)
            adv = (r - r.mean()) / (r.std(unbiased=True) + STD_EPS)
            for j in range(len(g["responses"])):
                ratio = torch.exp(lps[f"{gi}.{j}"] - old[gi][j])
                clipped += int(((ratio < 1 - EPS_LOW) | (ratio > 1 + EPS_HIGH)).sum())
                if adv[j] > 0:
                    clip_active += int((ratio > 1 + EPS_HIGH).sum())
                elif adv[j] < 0:
                    clip_active += int((ratio < 1 - EPS_LOW).sum())
    meta = {
        "loss": float(loss.detach()),
        "temperature": TEMPERATURE,
        "eps_low": EPS_LOW,
        "eps_high": EPS_HIGH,
        "beta": BETA,
        "agg": "token-mean",
        "std": "sample",
        "tokens": sum(len(r["tokens"]) for g in groups for r in g["responses"]),
        "clipped_tokens": clipped,
        "clip_active_tokens": clip_active,
        "tied": tied,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{name}: loss {float(loss.detach()):.6f}, clipped tokens {clipped} ({clip_active} active), params {len(names)}", file=sys.stderr)


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)
    if len(sys.argv) == 3 and sys.argv[1] == "--qwen3-0.6b":
        # Real size, not committed (~5 GB: the f32 model and every gradient). The golden test
        # runs it when ROLLOUTPIPE_GOLDEN_LARGE names this directory; explicit old log-probs so
        # that clipping is exercised, tied embeddings as in Qwen3-0.6B.
        SHAPE.update(QWEN3_06B)
        make("qwen3-0.6b", tied=True, seed=9, explicit_old=True, hub_style_rope=False, out=sys.argv[2])
        sys.exit(0)
    make("tied", tied=True, seed=7, explicit_old=False, hub_style_rope=True)
    make("untied", tied=False, seed=8, explicit_old=True, hub_style_rope=False)
