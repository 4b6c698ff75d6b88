"""PyTorch side of scripts/device/wgpu.sh, end to end: the workloads of backends/benches/wgpu.rs's
`wgpu_e2e_<shape>` groups (ROLLOUTPIPE_BENCH_SHAPES=prod) in transformers' Qwen3ForCausalLM on
CUDA, built from a config (random init; nothing is downloaded, HF_HUB_OFFLINE is set):

- generate: 8 prompts of 64 tokens, `model.generate(do_sample=True, top_k=0, top_p=1,
  max_new_tokens=32, min_new_tokens=32)`, prefill included: 256 generated tokens a call;
- train: one GRPO-like step on 4 sequences of 64 prompt + 64 response tokens: forward,
  loss = -(advantage · logp of the response tokens).mean(), backward, AdamW step, zero_grad:
  512 tokens a step.

Each in float32 (TF32 off: the same arithmetic as our f32 kernels) and bfloat16 (generate: the
model cast to bf16; train: autocast to bf16 over f32 master weights and f32 AdamW, what a
mixed-precision trainer runs). Time: wall clock between torch.cuda.synchronize() calls, the
median of 5 calls after 1 warm-up call.

Prints one JSON line per shape, case and dtype: {"e2e": "0.6b", "case": "generate",
"dtype": "bfloat16", "tokens": 256, "seconds": ...}, which scripts/device/table.py merges with
the criterion results. Without torch, transformers or CUDA it prints a one-line reason on
stderr, nothing on stdout, and exits 0 (the table then has no PyTorch end-to-end columns).

Usage: torch_e2e.py [--tiny] [--shapes 0.6b,1.7b]
  --tiny  a small config (also on the CPU when there is no CUDA), to check the code path."""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REQUESTS, PROMPT, NEW = 8, 64, 32
SEQS, TRAIN_PROMPT, TRAIN_RESPONSE = 4, 64, 64
REPS = 5

# The shapes of ModelConfig::qwen3_0_6b() / qwen3_1_7b() (backends/src/config.rs), which the
# bench's wgpu_e2e_* groups use: the Hub models' config.json.
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144),
}
QWEN3 = dict(vocab_size=151_936, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
             tie_word_embeddings=True, max_position_embeddings=40_960)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512)


def unavailable(why):
    print(f"torch_e2e.py: {why}; no PyTorch end-to-end timings", file=sys.stderr)
    sys.exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shapes", default="0.6b,1.7b")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        unavailable("torch is not installed")
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM
    except ImportError:
        unavailable("transformers (with Qwen3) is not installed")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif args.tiny:
        dev = torch.device("cpu")
    else:
        unavailable("torch has no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    cases = [("tiny", TINY)] if args.tiny else [
        (s, {**QWEN3, **SHAPES[s]}) for s in args.shapes.split(",") if s]
    for shape, fields in cases:
        cfg = Qwen3Config(**fields, attention_bias=False, use_cache=True,
                          bos_token_id=None, eos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(dev):
            model = Qwen3ForCausalLM(cfg)
        model.eval()
        vocab = cfg.vocab_size
        for dtype in [torch.float32, torch.bfloat16]:
            model.to(dtype)  # in place
            secs = time_generate(torch, model, vocab, dev)
            emit(shape, "generate", dtype, REQUESTS * NEW, secs)
        # Back to f32 master weights (random ones: their rounding through bf16 is no matter).
        model.float().train()
        for dtype in [torch.float32, torch.bfloat16]:
            secs = time_train(torch, model, vocab, dev, dtype)
            emit(shape, "train", dtype, SEQS * (TRAIN_PROMPT + TRAIN_RESPONSE), secs)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def emit(shape, case, dtype, tokens, secs):
    print(json.dumps({"e2e": shape, "case": case, "dtype": str(dtype).removeprefix("torch."),
                      "tokens": tokens, "seconds": secs}), flush=True)


def timed(torch, dev, f):
    """Median wall time of REPS calls of f after one warm-up call, synchronized."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    f()
    sync()
    times = []
    for _ in range(REPS):
        sync()
        t = time.perf_counter()
        f()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_generate(torch, model, vocab, dev):
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, vocab, (REQUESTS, PROMPT), device=dev, generator=gen)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW,
                                 min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
        assert out.shape == (REQUESTS, PROMPT + NEW), out.shape
    return timed(torch, dev, run)


def time_train(torch, model, vocab, dev, dtype):
    gen = torch.Generator(device=dev).manual_seed(2)
    n = TRAIN_PROMPT + TRAIN_RESPONSE
    ids = torch.randint(0, vocab, (SEQS, n), device=dev, generator=gen)
    adv = torch.tensor([1.0 if s % 2 == 0 else -1.0 for s in range(SEQS)], device=dev)
    # logits at position t predict token t + 1; the response is tokens TRAIN_PROMPT..n-1.
    mask = torch.zeros(SEQS, n - 1, device=dev)
    mask[:, TRAIN_PROMPT - 1:] = 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    secs = timed(torch, dev, step)
    del opt
    return secs


if __name__ == "__main__":
    main()
