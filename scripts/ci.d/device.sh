#!/usr/bin/env bash
# A rehearsal of the device scripts, so that a session lent a GPU does not spend its minutes on
# a broken script: packs dev-profile executables (scripts/device/pack.sh --dev: the debug builds
# of the cuda check before this one, plus the two benchmark executables), copies the tree as the
# device tool sends it (tracked and untracked-not-ignored files) to a folder of its own, and runs
# wgpu.sh --smoke (on lavapipe) and cuda.sh --smoke (no GPU: the CUDA tests skip) there with no
# cargo on PATH, as on the lent machine. Each must end well and write its table or log.
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
bare=$(mktemp -d)
trap 'rm -rf "$bare"' EXIT
export ROLLOUTPIPE_DEVICE_PACK="$PWD/target/device-pack-dev"
bash scripts/device/pack.sh --dev --no-vulkan | tail -3
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$bare"
nocargo=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
for script in wgpu cuda; do
  mkdir -p "$bare/out-$script"
  (cd "$bare" && env -i HOME="$bare/home" PATH="$nocargo" OUT="$bare/out-$script" \
    ROLLOUTPIPE_DEVICE_PACK="$ROLLOUTPIPE_DEVICE_PACK" bash "scripts/device/$script.sh" --smoke) \
    > "$bare/$script.log" 2>&1 || { cat "$bare/$script.log"; echo "device rehearsal: $script.sh failed"; exit 1; }
done
grep -q "test result: ok. [1-9]" "$bare/wgpu.log" || { cat "$bare/wgpu.log"; echo "wgpu.sh ran no test"; exit 1; }
grep -q "^| wgpu_matmul | 64x128x384 " "$bare/out-wgpu/wgpu-table.md" \
  || { cat "$bare/wgpu.log"; echo "wgpu.sh wrote no benchmark table"; exit 1; }
grep -q "test result: ok. [1-9]" "$bare/out-cuda/conformance.log" \
  || { cat "$bare/cuda.log"; echo "cuda.sh ran no test"; exit 1; }
grep -q "^SKIP: " "$bare/out-cuda/bench.err" || { cat "$bare/cuda.log"; echo "cuda.sh's benchmark did not run"; exit 1; }
echo "device rehearsal took $(( $(date +%s) - start )) s"
