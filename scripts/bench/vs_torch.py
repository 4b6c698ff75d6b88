#!/usr/bin/env python3
"""PyTorch's side of scripts/bench/vs_torch.sh, and the random model both sides load.

    vs_torch.py make-model DIR [--layers N]   random Qwen3-0.6B-shaped HF directory (bf16)
    vs_torch.py (grpo|logits|generate) DIR    one workload; prints one JSON line

The workloads mirror backends/benches/vs_torch.rs exactly (same LCG token ids, rewards and
settings), timed from model loaded to result:
- grpo: 2 groups x 4 responses x 48 tokens after 16-token prompts; GRPO (SPEC section 6):
  advantages (r - mean)/(std ddof 1 + 1e-6), ratio clipped at 1 -/+ 0.2, k3 KL with beta 0.04,
  old and reference log-probs = the current ones detached (first step of a rollout),
  token-mean; then clip_grad_norm_(1.0) and one torch.optim.AdamW step (lr 1e-3, wd 0.01).
  Logits only at the response positions (`logits_to_keep`, as TRL does).
- logits: the full logits of 64 tokens;
- generate: 16 prompts of 16 tokens, 64 new tokens each, greedy, no EOS (transformers'
  `generate` with a KV cache).
Weights are f32 for every workload (a training run keeps f32 master weights).
"""

import json
import os
import sys
import time


def tokens(seed, n, vocab):
    s = seed
    out = []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((s >> 33) % vocab)
    return out


def make_model(path, layers):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def main():
    task, path = sys.argv[1], sys.argv[2]
    if task == "make-model":
        layers = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--layers" else 28
        make_model(path, layers)
        return
    import torch
    from transformers import Qwen3ForCausalLM

    t0 = time.perf_counter()
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    v = model.config.vocab_size
    t1 = time.perf_counter()
    if task == "grpo":
        model.train()
        rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        adv, ids = [], []
        for g in range(2):
            r = torch.tensor(rewards[g * 4 : g * 4 + 4], dtype=torch.float64)
            adv += ((r - r.mean()) / (r.std() + 1e-6)).tolist()
            prompt = tokens(100 + g, 16, v)
            for i in range(4):
                ids.append(prompt + tokens(200 + g * 4 + i, 48, v))
        ids = torch.tensor(ids)
        adv = torch.tensor(adv, dtype=torch.float32)[:, None]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        step_s = []
        # VS_TORCH_STEPS=N repeats the step on the same batch: step 1 allocates the gradients
        # and moments (first touch of every page), later steps show the steady state.
        for _ in range(int(os.environ.get("VS_TORCH_STEPS", "1"))):
            ts = time.perf_counter()
            opt.zero_grad()
            # logits at positions 15..62 predict the 48 response tokens
            logits = model(input_ids=ids, logits_to_keep=49).logits[:, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 16:, None])[..., 0]
            old = logp.detach()
            ref = logp.detach()
            rho = torch.exp(logp - old)
            surr = torch.minimum(rho * adv, rho.clamp(0.8, 1.2) * adv)
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            per_tok = -surr + 0.04 * kl
            loss = per_tok.sum() / per_tok.numel()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step_s.append(time.perf_counter() - ts)
        detail = {"loss": loss.item(), "grad_norm": grad_norm.item(), "step_s": step_s}
    elif task == "logits":
        with torch.no_grad():
            z = model(input_ids=torch.tensor([tokens(7, 64, v)])).logits
        detail = {"logits_sum": z.double().sum().item()}
    elif task == "generate":
        ids = torch.tensor([tokens(300 + r, 16, v) for r in range(16)])
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )
        new = out[:, 16:]
        secs = time.perf_counter() - t1
        detail = {"new_tokens": new.numel(), "tok_per_s": new.numel() / secs, "first": new[0, :8].tolist()}
    else:
        sys.exit(f"vs_torch.py: unknown task {task!r} (make-model, grpo, logits, generate)")
    run_s = time.perf_counter() - t1
    print(json.dumps({"side": "torch", "task": task, "load_s": load_s, "run_s": run_s, **detail}))


if __name__ == "__main__":
    main()
