"""Markdown tables from criterion's results of the wgpu benchmarks (target/criterion/wgpu_*)
and, when given, PyTorch's timings: one table of every benchmark (with PyTorch's matmul times
from scripts/device/torch_matmul.py), then one of end-to-end generate and train tokens/s at
the default model and at Qwen3-0.6B and 1.7B shapes (with scripts/device/torch_e2e.py's).

Usage: table.py CRITERION_DIR TORCH_JSONL ADAPTER
TORCH_JSONL holds both scripts' JSON lines: a matmul line has "rows", an end-to-end line "e2e".
Throughput is criterion's: elements per second are FLOP/s for the matrix products and
attention, rows or tokens per second for sampling, generate and train; bytes per second for
the memory-bound ops."""

import json
import os
import sys


def main():
    crit, torch_path, adapter = sys.argv[1], sys.argv[2], sys.argv[3]
    torch, torch_e2e = {}, {}
    if os.path.exists(torch_path):
        for line in open(torch_path):
            if line.strip():
                r = json.loads(line)
                if "e2e" in r:
                    torch_e2e[(r["e2e"], r["case"], r["dtype"])] = r["tokens"] / r["seconds"]
                else:
                    torch[(f"{r['rows']}x{r['in']}x{r['out']}", r["dtype"])] = r["seconds"]
    rows = []
    for group in sorted(os.listdir(crit)) if os.path.isdir(crit) else []:
        if not group.startswith("wgpu_"):
            continue
        for root, _, files in os.walk(os.path.join(crit, group)):
            if not root.endswith(os.sep + "new") or "estimates.json" not in files:
                continue
            est = json.load(open(os.path.join(root, "estimates.json")))
            bench = json.load(open(os.path.join(root, "benchmark.json")))
            secs = est["mean"]["point_estimate"] / 1e9
            thr = bench.get("throughput") or {}
            if "Elements" in thr:
                rate, unit = thr["Elements"] / secs, "elem/s"
            elif "Bytes" in thr:
                rate, unit = thr["Bytes"] / secs, "B/s"
            else:
                rate, unit = None, ""
            name = bench.get("full_id", "").removeprefix(group + "/")
            rows.append((group, name, secs, rate, unit))
    rows.sort()
    print(f"wgpu benchmarks on: {adapter}\n")
    print("| group | benchmark | time per iteration | throughput | PyTorch f32 | PyTorch bf16 "
          "| PyTorch f32 time / ours |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for group, name, secs, rate, unit in rows:
        # A tensor-core row (tc_<shape>) is the same product as <shape>.
        key = name.removeprefix("tc_")
        t32 = torch.get((key, "float32")) if group == "wgpu_matmul" else None
        t16 = torch.get((key, "bfloat16")) if group == "wgpu_matmul" else None
        rate_s = fmt_rate(rate, unit) if rate else ""
        print(f"| {group} | {name} | {fmt(secs)} | {rate_s} | {fmt(t32)} | {fmt(t16)} | "
              f"{'' if not t32 else f'{t32 / secs:.2f}x'} |")
    e2e_table({(g, n): rate for g, n, _, rate, _ in rows}, torch_e2e)


# (model, workload, torch_e2e.py's shape key, criterion benchmark of wgpu f32, of wgpu bf16,
# of wgpu on tensor cores: the bf16 engine for generate, the f32 trainer with tensor-core
# forward and backward products for train; of the f32 engine with look-ahead decoding); the
# bf16 train cell stays empty: the wgpu trainer keeps f32 weights.
E2E = [
    ("default model", "generate 16 × (16 + 32)", None,
     ("wgpu_generate", "wgpu/16"), ("wgpu_generate", "wgpu_bf16/16"),
     ("wgpu_generate", "wgpu_bf16_tc/16"), ("wgpu_generate", "wgpu_lookahead/16")),
    ("default model", "GRPO step 8 × (16 + 48)", None,
     ("wgpu_train", "wgpu/grpo_step_8x64"), None, ("wgpu_train", "wgpu_tc/grpo_step_8x64"),
     None),
]
for shape, model in [("0.6b", "Qwen3-0.6B"), ("1.7b", "Qwen3-1.7B")]:
    E2E += [
        (model, "generate 8 × (64 + 32)", (shape, "generate"),
         (f"wgpu_e2e_{shape}", "generate/f32"), (f"wgpu_e2e_{shape}", "generate/bf16"),
         (f"wgpu_e2e_{shape}", "generate/bf16_tc"), (f"wgpu_e2e_{shape}", "generate/f32_ahead")),
        (model, "GRPO step 4 × (64 + 64)", (shape, "train"),
         (f"wgpu_e2e_{shape}", "train/f32"), None, (f"wgpu_e2e_{shape}", "train/f32_tc"), None),
    ]


def e2e_table(rate, torch_e2e):
    """Tokens/s end to end (generated tokens for generate, prompt + response tokens for a
    train step) of wgpu and PyTorch, and wgpu's as a fraction of PyTorch's per dtype. A row
    is printed when criterion or PyTorch measured any of its cells."""
    print("\nEnd to end, tokens/s (generate: new tokens, prefill included; train: prompt + "
          "response tokens of one forward, backward and AdamW step; PyTorch bf16 train is "
          "autocast over f32 weights)\n")
    print("| model | workload | wgpu f32 | wgpu bf16 | wgpu tensor cores | wgpu f32 look-ahead "
          "| PyTorch f32 | PyTorch bf16 | wgpu / PyTorch f32 | wgpu bf16 / PyTorch bf16 "
          "| wgpu tensor cores / PyTorch bf16 | look-ahead / wgpu f32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, work, tkey, b32, b16, btc, bla in E2E:
        w32 = rate.get(b32) if b32 else None
        w16 = rate.get(b16) if b16 else None
        wtc = rate.get(btc) if btc else None
        wla = rate.get(bla) if bla else None
        t32 = torch_e2e.get((*tkey, "float32")) if tkey else None
        t16 = torch_e2e.get((*tkey, "bfloat16")) if tkey else None
        if not any([w32, w16, wtc, wla, t32, t16]):
            continue
        print(f"| {model} | {work} | {fmt_tok(w32)} | {fmt_tok(w16)} | {fmt_tok(wtc)} | "
              f"{fmt_tok(wla)} | {fmt_tok(t32)} | {fmt_tok(t16)} | {ratio(w32, t32)} | "
              f"{ratio(w16, t16)} | {ratio(wtc, t16)} | {ratio(wla, w32)} |")


def fmt_tok(r):
    return "" if r is None else f"{r:,.4g}" if r < 1000 else f"{r:,.0f}"


def ratio(a, b):
    return f"{a / b:.3g}x" if a and b else ""


def fmt_rate(rate, unit):
    for scale, prefix in [(1e9, "G"), (1e6, "M"), (1e3, "k")]:
        if rate >= scale:
            return f"{rate / scale:.3g} {prefix}{unit}"
    return f"{rate:.3g} {unit}"


def fmt(s):
    if s is None:
        return ""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


if __name__ == "__main__":
    main()
