"""PyTorch eager on the CUDA benchmark's end-to-end shapes (backends/benches/cuda.rs):
generation (16 requests, 16-token prompts, 64 new tokens, greedy, KV cache) and one GRPO-like
step (8 sequences of 64 + 192 tokens: forward, token log-probs, backward, AdamW) of a randomly
initialised Qwen3 at 0.6B and 1.7B shapes, f32 weights like ours. Prints rows in the bench's
format. Needs torch and transformers already installed (nothing is downloaded); otherwise it
says so and exits 0. Usage: python3 scripts/device/torch_eager.py [--quick]"""
import sys
import time

try:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
    print(f"torch eager: not available ({type(e).__name__}: {e})")
    sys.exit(0)

QUICK = "--quick" in sys.argv
SHAPES = [("Qwen3-0.6B", 1024, 3072), ("Qwen3-1.7B", 2048, 6144)]


def row(what, shape, us, rate):
    print(f"{what:<28} {shape:<22} {us:>10.1} {rate:>14} {'-':>9} {'torch eager':>16}")


def main():
    if not torch.cuda.is_available():
        print("torch eager: torch sees no CUDA device")
        return
    dev = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    for name, d, f in SHAPES:
        cfg = Qwen3Config(vocab_size=151936, hidden_size=d, intermediate_size=f,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                          max_position_embeddings=4096, attn_implementation="eager")
        torch.manual_seed(1)
        model = Qwen3ForCausalLM(cfg).to(dev, torch.float32)
        reqs, prompt, new = 16, 16, 16 if QUICK else 64
        ids = torch.tensor([[(i * 7919 + j * 104729) % 151936 for j in range(prompt)]
                            for i in range(reqs)], device=dev)
        model.eval()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
            s = time.perf_counter() - t
        row(f"{name} generate", f"{reqs} req x {new} new", s * 1e6 / new, f"{reqs * new / s:.0f} tok/s")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        seqs, pl, rl = 8, 64, 64 if QUICK else 192
        x = torch.tensor([[(i * 31 + j * 17) % 151936 for j in range(pl)]
                          + [(i * 13 + j * 7 + 5) % 151936 for j in range(rl)] for i in range(seqs)],
                         device=dev)
        adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(seqs)], device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            logits = model(x).logits[:, pl - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, x[:, pl:, None]).squeeze(-1)
            ratio = torch.exp(lp - lp.detach())
            loss = -(ratio * adv[:, None]).sum() / (seqs * rl)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        step()
        torch.cuda.synchronize()
        n = 1 if QUICK else 3
        t = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        s = (time.perf_counter() - t) / n
        row(f"{name} GRPO step", f"{seqs} x ({pl}+{rl})", s * 1e6, f"{seqs * (pl + rl) / s:.0f} tok/s")
        del model, opt
        torch.cuda.empty_cache()


main()
