"""PyTorch side of scripts/device/wgpu.sh: y = x·Wᵀ (torch.nn.functional.linear) on CUDA at the
shapes of backends/benches/wgpu.rs's `wgpu_matmul` group (with ROLLOUTPIPE_BENCH_SHAPES=prod),
in f32 with TF32 off (the same arithmetic as our f32 kernels) and in bf16 (what a tensor-core
trainer or server runs). Prints one JSON line per shape and dtype: rows, in, out, dtype,
seconds per product (median of CUDA-event timings over 50 launches after 10 warm-up ones).
Exits non-zero (and prints nothing) without torch or CUDA."""

import json
import sys

try:
    import torch
except ImportError:
    sys.exit("torch is not installed")
if not torch.cuda.is_available():
    sys.exit("torch has no CUDA device")

torch.backends.cuda.matmul.allow_tf32 = False
SHAPES = [(8, 128, 384), (64, 128, 384), (512, 128, 384), (512, 384, 128), (1024, 1024, 1024)]
for d, f in [(1024, 3072), (2048, 6144)]:
    for n in [8, 512]:
        SHAPES += [(n, d, f), (n, f, d)]

gen = torch.Generator(device="cuda").manual_seed(0)
for n, din, dout in SHAPES:
    for dtype in [torch.float32, torch.bfloat16]:
        x = torch.randn(n, din, device="cuda", dtype=dtype, generator=gen)
        w = torch.randn(dout, din, device="cuda", dtype=dtype, generator=gen)
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        times = []
        for _ in range(50):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            torch.nn.functional.linear(x, w)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        times.sort()
        print(json.dumps({"rows": n, "in": din, "out": dout,
                          "dtype": str(dtype).removeprefix("torch."),
                          "seconds": times[len(times) // 2]}))
