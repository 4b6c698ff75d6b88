#!/usr/bin/env bash
# Ours (release CPU backend) vs PyTorch + transformers (CPU) on the same random Qwen3-0.6B-shaped
# model, side by side: one GRPO step, the logits of 64 tokens, and generation of 16 requests x 64
# new tokens. Each workload runs as its own process, ours and PyTorch's one at a time (a 0.6B
# PyTorch GRPO step needs ~16 GB); each is timed from model loaded to result (printed by the
# process) and as a whole process, with peak RSS, by /usr/bin/time -v. Prints one table and
# writes it, with the command and the machine, to docs/performance.md.
#
# Usage: scripts/bench/vs_torch.sh [--layers N] [--only grpo|logits|generate] [--no-doc|--doc]
#   --layers N  a reduced model (real vocabulary and widths, N layers) for development;
#               docs/performance.md is only written for the full 28 layers unless --doc.
#   --only T    run only workload T; --sides ours re-runs only our side (the table then reuses
#               PyTorch's last results from target/vs_torch/log-lN).
#   VS_TORCH_STEPS=N (environment) repeats the GRPO step N times on both sides: step 1 touches
#               the gradients and moments for the first time, later ones are the steady state.
# Needs python3 (with venv), cargo and /usr/bin/time. The venv is .venv-bench in the repository
# (ignored by git), with pinned versions from PyPI; the model is built once under
# target/vs_torch/ (about 1.2 GB on disk for 28 layers).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

layers=28
only=""
sides="torch ours"
doc=auto
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) layers="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --sides) sides="$2"; shift 2 ;;
    --no-doc) doc=no; shift ;;
    --doc) doc=yes; shift ;;
    *) echo "vs_torch.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ "$doc" = auto ] && { [ "$layers" = 28 ] && doc=yes || doc=no; }
[ -x /usr/bin/time ] || { echo "vs_torch.sh: /usr/bin/time is missing (apt-get install time)" >&2; exit 1; }

# VS_TORCH_PYTHON: an interpreter that already has the pinned packages (skips the venv).
if [ -n "${VS_TORCH_PYTHON:-}" ]; then
  PY="$VS_TORCH_PYTHON"
else
  VENV="$ROOT/.venv-bench"
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet -r scripts/bench/requirements.txt
  fi
  PY="$VENV/bin/python"
fi

MODEL="$ROOT/target/vs_torch/qwen3-0.6b-shape-l$layers"
if [ ! -f "$MODEL/model.safetensors" ]; then
  mkdir -p "$MODEL"
  "$PY" scripts/bench/vs_torch.py make-model "$MODEL" --layers "$layers"
fi

cargo bench --quiet -p rolloutpipe-backends --no-default-features --bench vs_torch --no-run
OURS=$(cargo bench -p rolloutpipe-backends --no-default-features --bench vs_torch --no-run \
  --message-format=json 2>/dev/null | "$PY" -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "vs_torch" and m.get("executable"):
        print(m["executable"])')

LOG="$ROOT/target/vs_torch/log-l$layers"
mkdir -p "$LOG"
tasks="grpo logits generate"
[ -n "$only" ] && tasks="$only"
for task in $tasks; do
  for side in $sides; do
    echo "== $task / $side (free: $(free -g | awk '/Mem:/{print $7}') GiB available)" >&2
    if [ "$side" = torch ]; then cmd=("$PY" scripts/bench/vs_torch.py "$task" "$MODEL")
    else cmd=("$OURS" "$task" "$MODEL"); fi
    /usr/bin/time -v -o "$LOG/$task.$side.time" "${cmd[@]}" > "$LOG/$task.$side.json"
    cat "$LOG/$task.$side.json" >&2
  done
done

"$PY" - "$LOG" "$layers" "$doc" <<'EOF'
import json, os, platform, subprocess, sys
log, layers, doc = sys.argv[1], sys.argv[2], sys.argv[3]
# every workload with results from both sides (this run's or an earlier one's)
tasks = [t for t in ("grpo", "logits", "generate")
         if all(os.path.exists(f"{log}/{t}.{s}.{e}") for s in ("torch", "ours") for e in ("json", "time"))]

def clock(s):
    parts = [float(p) for p in s.split(":")]
    return sum(p * 60 ** i for i, p in enumerate(reversed(parts)))

def timing(path):
    t = {}
    for line in open(path):
        k, _, v = line.strip().rpartition(": ")
        if k.startswith("Elapsed (wall clock)"): t["wall"] = clock(v)
        elif k == "Maximum resident set size (kbytes)": t["rss"] = int(v) / 1024 ** 2
        elif k == "User time (seconds)": t["user"] = float(v)
        elif k == "System time (seconds)": t["sys"] = float(v)
    return t

rows = []
for task in tasks:
    r = {}
    for side in ("torch", "ours"):
        j = json.loads(open(f"{log}/{task}.{side}.json").read().strip().splitlines()[-1])
        j.update(timing(f"{log}/{task}.{side}.time"))
        r[side] = j
    rows.append((task, r))

lines = [
    "| workload | side | load s | model loaded → result s | whole process s | CPU s (user+sys) | peak RSS GiB | result |",
    "|---|---|---:|---:|---:|---:|---:|---|",
]
ratios = []
for task, r in rows:
    for side in ("torch", "ours"):
        j = r[side]
        steps = lambda j: ("" if len(j.get("step_s", [])) < 2 else
                           ", steps " + " / ".join(f"{x:.2f}" for x in j["step_s"]) + " s")
        res = {"grpo": lambda j: f"loss {j['loss']:.6g}, grad norm {j['grad_norm']:.5g}{steps(j)}",
               "logits": lambda j: f"Σ logits {j['logits_sum']:.6g}",
               "generate": lambda j: f"{j['tok_per_s']:.1f} tok/s, first {j['first'][:4]}"}[task](j)
        name = "PyTorch" if side == "torch" else "ours"
        lines.append(f"| {task} | {name} | {j['load_s']:.1f} | {j['run_s']:.2f} | {j['wall']:.1f} | "
                     f"{j['user'] + j['sys']:.1f} | {j['rss']:.2f} | {res} |")
    t, o = r["torch"], r["ours"]
    ratios.append(f"{task}: ours/PyTorch result time {o['run_s'] / t['run_s']:.2f}x, "
                  f"whole process {o['wall'] / t['wall']:.2f}x, peak RSS {o['rss'] / t['rss']:.2f}x")
    if task == "generate":
        ratios[-1] += f", tokens/s {o['tok_per_s'] / t['tok_per_s']:.2f}x"
table = "\n".join(lines)
print(table)
print()
print("\n".join(ratios))
if doc == "yes":
    import torch, transformers
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    load = open("/proc/loadavg").read().split()[:3]
    path = os.path.join(os.path.dirname(log), "..", "..", "docs", "performance.md")
    marker = "<!-- vs_torch table -->"
    text = open(path).read() if os.path.exists(path) else ""
    block = (f"{marker}\nMeasured by `scripts/bench/vs_torch.sh` on {os.cpu_count()} cores ({cpu}), "
             f"load average {' '.join(load)} at the end, Qwen3-0.6B shape with {layers} layers, "
             f"torch {torch.__version__}, transformers {transformers.__version__}:\n\n{table}\n\n"
             + "\n".join(f"- {x}" for x in ratios) + f"\n{marker}")
    if marker in text:
        a, _, rest = text.partition(marker)
        _, _, b = rest.partition(marker)
        text = a + block + b
    else:
        text = text + "\n" + block + "\n"
    open(path, "w").write(text)
    print(f"wrote {os.path.normpath(path)}")
EOF
