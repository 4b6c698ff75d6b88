#!/usr/bin/env python3
"""Assembles every kernels/ptx/*.ptx with ptxas for sm_80 and sm_90 and checks each entry's
resources against the committed report kernels/ptx/resources.toml.

Fails (exit 1, one line per problem) when, for any entry and architecture:
  - ptxas reports an error or a warning (it runs with --warning-as-error --warn-on-spills);
  - registers exceed the entry's stated bound `max_registers` (itself <= 255), or exceed the
    committed `registers` (growth), or shared memory exceeds the committed `shared` (growth)
    or 48 KiB (the static limit: every kernel uses static shared memory only);
  - any spill store or load, any local memory, or any stack frame;
  - an entry is missing from the report, or the report lists one that no longer exists.
A kernel that got smaller passes with a note to refresh the report. `--write` regenerates the
report from the current ptxas output, keeping the stated bounds (new entries get the bound of
their class in DEFAULT_BOUND). Usage: ptx_resources.py PTXAS [--write]
"""
import concurrent.futures
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PTX_DIR = ROOT / "kernels" / "ptx"
REPORT = PTX_DIR / "resources.toml"
ARCHS = ("sm_80", "sm_90")
SMEM_LIMIT = 48 * 1024
HARD_MAX_REGISTERS = 255
# Register bound of a new entry until the report states its own: 32 registers per thread is
# what full occupancy (64 warps of 32 threads in a 64K-register SM) allows. The committed
# bounds are 32 for elementwise kernels, 40 for row reductions, 64 for attention, sampling
# and the f32 GEMM, 96 for the tensor-core GEMMs (docs/cuda.md explains each class).
DEFAULT_BOUND = 32
FIELDS = ("registers", "shared", "spill_stores", "spill_loads", "local", "stack")


def assemble(ptxas, path, arch):
    cmd = [ptxas, f"-arch={arch}", "-v", "--warning-as-error", "--warn-on-spills",
           "-o", "/dev/null", str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    out = res.stdout + res.stderr
    if res.returncode != 0:
        return path, arch, None, out
    kernels, cur = {}, None
    for line in out.splitlines():
        m = re.search(r"Function properties for (\w+)", line)
        if m:
            cur = kernels.setdefault(m.group(1), dict.fromkeys(FIELDS, 0))
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur is not None:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur is not None:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["shared"] = int(s.group(1)) if s else 0
            lm = re.search(r"(\d+) bytes lmem", line)
            cur["local"] = int(lm.group(1)) if lm else 0
    return path, arch, kernels, out


def load_report(path):
    """The report's own subset of TOML: `[arch.entry]` sections of `key = integer` lines
    (parsed here so that any Python 3 works, tomllib needs 3.11)."""
    report, cur = {}, None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            cur = report.setdefault(line[1:-1], {})
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        if cur is None or not sep or not value.isdigit():
            sys.exit(f"{path.name}:{n}: expected `[arch.entry]` or `key = integer`, got {raw!r}")
        cur[key] = int(value)
    return report


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: ptx_resources.py PTXAS [--write]")
    ptxas, write = sys.argv[1], "--write" in sys.argv[2:]
    files = sorted(PTX_DIR.glob("*.ptx"))
    measured, errors = {}, []
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        jobs = [pool.submit(assemble, ptxas, f, a) for f in files for a in ARCHS]
        for job in jobs:
            path, arch, kernels, out = job.result()
            if kernels is None:
                errors.append(f"{path.name} ({arch}): ptxas failed:\n{out.strip()}")
                continue
            for name, res in kernels.items():
                measured[f"{arch}.{name}"] = res
    flat = load_report(REPORT) if REPORT.exists() else {}
    if write and not errors:
        lines = ["# Resources of every PTX entry as ptxas -v reports them (registers per thread,",
                 "# static shared memory in bytes, spill/local/stack bytes), per architecture.",
                 "# max_registers is the stated bound the check enforces; registers and shared",
                 "# are the committed values no change may exceed. Regenerate with",
                 "# `bash scripts/ci.d/ptx.sh --write` (bounds are kept).", ""]
        for key in sorted(measured, key=lambda k: (k.split(".")[0], k.split(".")[1])):
            res = measured[key]
            bound = flat.get(key, {}).get("max_registers", DEFAULT_BOUND)
            lines.append(f"[{key}]")
            lines += [f"{f} = {res[f]}" for f in FIELDS]
            lines += [f"max_registers = {bound}", ""]
        REPORT.write_text("\n".join(lines))
        print(f"wrote {REPORT.relative_to(ROOT)} ({len(measured)} entries)")
        flat = {k: dict(v, max_registers=flat.get(k, {}).get("max_registers", DEFAULT_BOUND))
                for k, v in measured.items()}
    notes = []
    for key, res in sorted(measured.items()):
        ref = flat.get(key)
        if ref is None:
            errors.append(f"{key}: not in {REPORT.name} (run with --write and commit it)")
            continue
        bound = min(ref.get("max_registers", DEFAULT_BOUND), HARD_MAX_REGISTERS)
        if res["registers"] > bound:
            errors.append(f"{key}: {res['registers']} registers > stated bound {bound}")
        for f in ("registers", "shared"):
            if res[f] > ref[f]:
                errors.append(f"{key}: {f} grew from {ref[f]} to {res[f]}")
            elif res[f] < ref[f]:
                notes.append(f"{key}: {f} shrank from {ref[f]} to {res[f]} (refresh the report)")
        if res["shared"] > SMEM_LIMIT:
            errors.append(f"{key}: {res['shared']} bytes shared > {SMEM_LIMIT}")
        for f in ("spill_stores", "spill_loads", "local", "stack"):
            if res[f]:
                errors.append(f"{key}: {res[f]} bytes of {f}")
    for key in sorted(set(flat) - set(measured)):
        errors.append(f"{key}: in {REPORT.name} but no such entry was assembled")
    for n in notes:
        print("note:", n)
    print(f"{len(files)} files, {len(measured)} entry/arch pairs assembled for {', '.join(ARCHS)}")
    if errors:
        for e in errors:
            print("error:", e, file=sys.stderr)
        sys.exit(1)
    print("ptx resources ok")


if __name__ == "__main__":
    main()
