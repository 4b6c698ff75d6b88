"""One markdown table from criterion's results of the wgpu benchmarks (target/criterion/wgpu_*)
and, when given, PyTorch's matmul timings (scripts/device/torch_matmul.py's JSON lines).

Usage: table.py CRITERION_DIR TORCH_JSONL ADAPTER
Throughput is criterion's: elements per second are FLOP/s for the matrix products and
attention, rows or tokens per second for sampling, generate and train; bytes per second for
the memory-bound ops."""

import json
import os
import sys


def main():
    crit, torch_path, adapter = sys.argv[1], sys.argv[2], sys.argv[3]
    torch = {}
    if os.path.exists(torch_path):
        for line in open(torch_path):
            if line.strip():
                r = json.loads(line)
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
        t32 = torch.get((name, "float32")) if group == "wgpu_matmul" else None
        t16 = torch.get((name, "bfloat16")) if group == "wgpu_matmul" else None
        rate_s = fmt_rate(rate, unit) if rate else ""
        print(f"| {group} | {name} | {fmt(secs)} | {rate_s} | {fmt(t32)} | {fmt(t16)} | "
              f"{'' if not t32 else f'{t32 / secs:.2f}x'} |")


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
