#!/usr/bin/env bash
# Before/after end-to-end timing of the wgpu backend across commits: builds
# backends/examples/wgpu_e2e_ab.rs against an older commit (the file is copied into an
# export of that commit, since it did not exist there) and against this tree, runs the two
# binaries alternately, and prints one table: each phase's median seconds before and after,
# and the after/before speed.
#
#   bash scripts/bench/wgpu_ab.sh [--pairs N] [--shape 0.6b|small] <older-commit>
#
# Defaults: 2 pairs, the Qwen3-0.6B shape. Each run's raw lines go to target/ab/<side>-<i>.log.
# Writes only under target/ab. Lavapipe's numbers are only relative: compare the ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
pairs=2
shape=0.6b
old=""
while [ $# -gt 0 ]; do
  case "$1" in
    --pairs) pairs="$2"; shift 2 ;;
    --shape) shape="$2"; shift 2 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) old="$1"; shift ;;
  esac
done
[ -n "$old" ] || { echo "error: name the older commit (see --help)" >&2; exit 2; }
case "$pairs" in ''|*[!0-9]*|0) echo "error: --pairs must be a positive integer, not $pairs" >&2; exit 2 ;; esac
old_full=$(git rev-parse --verify --quiet "$old^{commit}") ||
  { echo "error: $old is not a commit of this repository" >&2; exit 2; }

root=$PWD
ab=target/ab
mkdir -p "$ab/bin"
build=(cargo build --profile dev -q -p rolloutpipe-backends --features wgpu --example wgpu_e2e_ab)

echo "== building the probe at ${old_full:0:10} (before)"
rm -rf "$ab/src"
mkdir -p "$ab/src"
# -m: files dated now, not at the commit, so that no artefact of an earlier export looks newer.
git archive "$old_full" | tar -x -m -C "$ab/src"
mkdir -p "$ab/src/backends/examples"
cp backends/examples/wgpu_e2e_ab.rs "$ab/src/backends/examples/"
# A target directory of its own: the two trees' crates share names and versions, so in one
# directory each build would replace the other's artefacts.
(cd "$ab/src" && CARGO_TARGET_DIR="$root/$ab/target" "${build[@]}")
cp "$ab/target/debug/examples/wgpu_e2e_ab" "$ab/bin/before"

echo "== building the probe at this tree (after)"
CARGO_TARGET_DIR="$root/target" "${build[@]}"
cp target/debug/examples/wgpu_e2e_ab "$ab/bin/after"

for i in $(seq 1 "$pairs"); do
  for side in before after; do
    echo "== pair $i/$pairs: $side"
    "$ab/bin/$side" "$shape" | tee "$ab/$side-$i.log"
  done
done

python3 - "$ab" "$pairs" "$shape" "${old_full:0:10}" "$(git rev-parse --short=10 HEAD)" <<'EOF'
import statistics, sys
ab, pairs, shape, old, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
phases, runs, why = [], {}, {}
for side in ("before", "after"):
    for i in range(1, pairs + 1):
        for line in open(f"{ab}/{side}-{i}.log"):
            f = line.split()
            if len(f) < 3 or f[0] != "phase":
                continue
            if f[1] not in phases:
                phases.append(f[1])
            if f[2] == "failed":
                why.setdefault((side, f[1]), " ".join(f[3:]))
            runs.setdefault((side, f[1]), []).append(
                None if f[2] == "failed" else (float(f[2]), int(f[3])))
def cell(side, p):
    got = runs.get((side, p), [])
    if not got or any(r is None for r in got):
        return None, "failed" if got else "—"
    s = statistics.median(r[0] for r in got)
    tok = got[0][1]
    return s, f"{s:.2f} s" + (f" ({tok / s:.3f} tok/s)" if tok else "")
print(f"\nwgpu end to end, shape {shape}, {pairs} pair(s), medians; before {old}, after {new} (+ uncommitted)")
print("| phase | before | after | after/before speed |")
print("|---|---:|---:|---:|")
for p in phases:
    (b, bt), (a, at) = cell("before", p), cell("after", p)
    ratio = f"{b / a:.2f}x" if a and b else "—"
    print(f"| {p} | {bt} | {at} | {ratio} |")
for (side, p), w in why.items():
    print(f"{side} {p} failed: {w}")
EOF
