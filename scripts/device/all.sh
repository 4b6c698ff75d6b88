#!/usr/bin/env bash
# Both device scripts in one call of the device tool, so a lent machine is started once:
# wgpu.sh --quick, then cuda.sh --quick, each under its own deadline so that the whole call ends
# within the tool's 10-minute command limit whatever a step does (scripts/device/lib.sh's `limit`
# cuts every step's timeout to what is left). Results: $OUT/wgpu (wgpu-log.txt, wgpu-table.md)
# and $OUT/cuda (device.txt, conformance.log, bench.txt, bench.err, torch.txt): 7 files, within
# the 8 the tool brings back. docs/device.md says how to call it:
#   run(command="bash scripts/device/all.sh", carry=["target/device-pack"], timeout_s=600)
#
# Usage: scripts/device/all.sh [--smoke]
#   --smoke  both scripts' rehearsals (CI runs it on lavapipe: scripts/ci.d/device.sh).
# Budget: ROLLOUTPIPE_DEVICE_BUDGET seconds in all (default 560), of which wgpu gets the first
# 55% (its conformance suite, kernel and end-to-end benchmarks and PyTorch's) and cuda the rest.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=--quick
case "${1:-}" in
  "") ;;
  --smoke) mode=--smoke ;;
  *) echo "all.sh: unknown argument $1 (only --smoke)" >&2; exit 2 ;;
esac
budget=${ROLLOUTPIPE_DEVICE_BUDGET:-560}
out=${OUT:-target/device}
start=$(date +%s)
rc=0
mkdir -p "$out/wgpu" "$out/cuda"
OUT="$out/wgpu" ROLLOUTPIPE_DEVICE_DEADLINE=$((start + budget * 55 / 100)) \
  bash scripts/device/wgpu.sh "$mode" || { echo "all.sh: wgpu.sh failed (exit $?)"; rc=1; }
OUT="$out/cuda" ROLLOUTPIPE_DEVICE_DEADLINE=$((start + budget)) \
  bash scripts/device/cuda.sh "$mode" || { echo "all.sh: cuda.sh failed (exit $?)"; rc=1; }
echo "all.sh: $(( $(date +%s) - start )) s of the $budget s budget; results under $out/wgpu and $out/cuda"
exit $rc
