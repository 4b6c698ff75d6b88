"""The PyTorch trainer against RolloutPipe's own: the same GRPO batch through
``rolloutpipe grpo-step`` (the Rust CPU trainer) and through ``TorchTrainer`` gives the same
loss, the same normalised gradient per tensor and the same updated weights (within 1e-5
relative), for token-mean and seq-mean, each std mode, clipping active, the KL term on, and
rollout / reference log-probs given or not."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import run
from rolloutpipe.torch_trainer import TorchTrainer, advantages, load_safetensors

REL = 1e-5


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_batch(vocab, seed, with_old):
    """Three groups of 4 with responses of 1-7 tokens, mixed rewards, and (when ``with_old``)
    rollout / reference log-probs near the model's, so ratios move past the clip range."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(3):
        prompt = rng.integers(1, vocab, size=int(rng.integers(2, 6))).tolist()
        responses = []
        for s in range(4):
            n = int(rng.integers(1, 8))
            r = {"tokens": rng.integers(0, vocab, size=n).tolist(),
                 "reward": float([1.0, 0.0, 0.5, -0.5][(g + s) % 4]),
                 "old_logprobs": None, "ref_logprobs": None}
            if with_old and s % 2 == 0:
                r["old_logprobs"] = (-4.2 + rng.normal(0, 0.5, n)).tolist()
                r["ref_logprobs"] = (-4.2 + rng.normal(0, 0.3, n)).tolist()
            responses.append(r)
        groups.append({"prompt": prompt, "responses": responses})
    return {"groups": groups}


CASES = [
    # (agg, std, beta, temperature, with rollout/ref log-probs)
    ("token-mean", "sample", 0.0, 1.0, False),
    ("token-mean", "sample", 0.05, 0.7, True),
    ("seq-mean", "pop", 0.1, 1.0, True),
    ("token-mean", "none", 0.0, 1.3, True),
]


@pytest.mark.parametrize("agg,std,beta,temp,with_old", CASES)
def test_loss_gradients_and_step_match_grpo_step(tmp_path, model_dir, rolloutpipe_bin, agg,
                                                 std, beta, temp, with_old):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    batch = make_batch(cfg["vocab_size"], seed=len(agg) + int(10 * temp), with_old=with_old)
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    out = tmp_path / "out"
    lr, wd, clip = 1e-3, 0.01, 0.5
    run([rolloutpipe_bin, "grpo-step", "--model", model_dir,
         "--batch", str(tmp_path / "batch.json"), "--out", str(out), "--save-grads", "--lr", str(lr), "--wd", str(wd), "--clip", str(clip),
         "--beta", str(beta), "--agg", agg, "--std", std, "--temperature", str(temp),
         "--threads", "1"])
    want = json.load(open(out / "result.json"))

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    rl = {"lr": lr, "weight_decay": wd, "max_grad_norm": clip, "eps_low": 0.2, "eps_high": 0.2,
          "beta": beta, "temperature": temp, "std": {"pop": "pop"}.get(std, std),
          "aggregation": agg.replace("-", "_"), "old_logprobs": "rollout"}
    # No reference model: a response without ref_logprobs is scored against the current
    # weights (KL 0), as grpo-step does.
    tr = TorchTrainer(cfg, weights, rl)
    seqs = []
    for g in batch["groups"]:
        adv = advantages([r["reward"] for r in g["responses"]], rl["std"])
        for r, a in zip(g["responses"], adv):
            seqs.append({"prompt": g["prompt"], "response": r["tokens"], "advantage": a,
                         "old_logprobs": r["old_logprobs"], "ref_logprobs": r["ref_logprobs"]})
    stats = tr.accumulate(seqs)
    norm = tr.normalizer()
    assert rel(stats["loss_sum"] / norm, want["loss"]) < REL, (stats["loss_sum"] / norm, want)

    grads = load_file(str(out / "grads.safetensors"))
    mine = tr.gradients()
    assert set(grads) == set(mine)
    worst = max(rel(mine[k].numpy(), grads[k].numpy()) for k in grads)
    assert worst < REL, worst
    total = rel(np.concatenate([mine[k].numpy().ravel() for k in sorted(grads)]),
                np.concatenate([grads[k].numpy().ravel() for k in sorted(grads)]))
    assert total < REL

    st = tr.optimizer_step()
    assert rel(st["grad_norm"], want["grad_norm"]) < REL
    stepped = load_file(str(out / "model.safetensors"))
    w = tr.weights()
    worst_w = max(rel(w[k].numpy(), stepped[k].numpy()) for k in stepped)
    assert worst_w < REL, worst_w
    print(f"\n{agg} {std} beta={beta} T={temp}: relative error loss "
          f"{rel(stats['loss_sum'] / norm, want['loss']):.1e}, gradient worst tensor {worst:.1e} "
          f"(all {total:.1e}), grad norm {rel(st['grad_norm'], want['grad_norm']):.1e}, "
          f"updated weights worst tensor {worst_w:.1e}")


def test_moments_round_trip_in_the_rust_layout(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    rl = {"lr": 1e-2, "weight_decay": 0.0, "max_grad_norm": 1.0, "eps_low": 0.2,
          "eps_high": 0.2, "beta": 0.0, "temperature": 1.0, "std": "sample",
          "aggregation": "token_mean", "old_logprobs": "recompute"}
    seqs = [{"prompt": [1, 2, 3], "response": [4, 5], "advantage": a} for a in (1.0, -1.0)]
    a, b = TorchTrainer(cfg, weights, rl), TorchTrainer(cfg, weights, rl)
    for t in (a, b):
        t.accumulate(seqs)
        t.optimizer_step()
    blob, step = a.export_moments()
    m = load_safetensors(blob)
    total = sum(p.numel() for p in a.params)
    assert step == 1 and m["adam.m"].shape == (total,) and float(m["adam.v"].abs().sum()) > 0
    # A trainer restored from the moments steps exactly as the one that wrote them.
    c = TorchTrainer(cfg, {k: v.clone() for k, v in a.weights().items()}, rl)
    c.import_moments(blob, step)
    for t in (a, c):
        t.accumulate(seqs)
        t.optimizer_step()
    for k, v in a.weights().items():
        assert torch.equal(v, c.weights()[k]), k
    assert not torch.equal(a.weights()["model.norm.weight"], b.weights()["model.norm.weight"])
