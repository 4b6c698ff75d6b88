#!/usr/bin/env bash
# A rehearsal of the device scripts, so that a session lent a GPU does not spend its minutes on
# a broken script: packs dev-profile executables (scripts/device/pack.sh --dev: the debug builds
# of the cuda check before this one, plus the two benchmark executables), copies the tree as the
# device tool sends it (tracked and untracked-not-ignored files) to a folder of its own, and runs
# all.sh --smoke there (wgpu.sh --smoke on lavapipe, cuda.sh --smoke with no GPU: the CUDA tests
# skip) with no cargo on PATH, as on the lent machine. Both must end well and write their
# tables and logs.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
bare=$(mktemp -d)
trap 'rm -rf "$bare"' EXIT
export ROLLOUTPIPE_DEVICE_PACK="$PWD/target/device-pack-dev"
bash scripts/device/pack.sh --dev --no-vulkan | tail -3
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$bare"
nocargo=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
(cd "$bare" && env -i HOME="$bare/home" PATH="$nocargo" OUT="$bare/out" \
  ROLLOUTPIPE_DEVICE_PACK="$ROLLOUTPIPE_DEVICE_PACK" bash scripts/device/all.sh --smoke) \
  > "$bare/all.log" 2>&1 || { cat "$bare/all.log"; echo "device rehearsal: all.sh failed"; exit 1; }
fail() { cat "$bare/all.log"; echo "device rehearsal: $1"; exit 1; }
grep -q "test result: ok. [1-9]" "$bare/out/wgpu/wgpu-log.txt" || fail "wgpu.sh ran no test"
grep -q "^tensor-core tests: " "$bare/out/wgpu/wgpu-log.txt" || fail "wgpu.sh ran no tensor-core step"
grep -q "^look-ahead tests: passed" "$bare/out/wgpu/wgpu-log.txt" || fail "wgpu.sh's look-ahead tests did not pass"
grep -q "^| wgpu_matmul | 64x128x384 " "$bare/out/wgpu/wgpu-table.md" || fail "wgpu.sh wrote no benchmark table"
grep -q "test result: ok. [1-9]" "$bare/out/cuda/conformance.log" || fail "cuda.sh ran no test"
grep -q "^SKIP: " "$bare/out/cuda/bench.err" || fail "cuda.sh's benchmark did not run"
echo "device rehearsal took $(( $(date +%s) - start )) s"
