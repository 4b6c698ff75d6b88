#!/usr/bin/env bash
# Builds, here, what the device scripts run on a lent GPU machine, into target/device-pack.
#
# The lent machine has no Rust toolchain and no network (/work/.library/device: its image holds
# CUDA, PyTorch and transformers, nothing is fetched there), so `cargo build` cannot run on it.
# This script builds the release test and benchmark executables on this machine instead, strips
# them, and adds the Vulkan loader (Debian's libvulkan1, unpacked there only when the machine
# has none) for wgpu. The device scripts (wgpu.sh, cuda.sh) run the pack when they find it and
# fall back to cargo only where cargo exists. Carry the folder with the device call:
#   carry: ["target/device-pack"]   command: bash scripts/device/wgpu.sh   (or cuda.sh)
#
# One build serves both scripts: --features cuda on top of the default wgpu feature gives the
# conformance suite of both backends, the library's unit tests (cuda.sh runs the CUDA ones) and
# the two benchmark executables. The kernels (WGSL and PTX) are compiled into the executables.
# The binaries are built against this machine's glibc (Debian 12, 2.36), which runs on newer ones.
#
# Usage: scripts/device/pack.sh [--no-vulkan] [--dev]
#   --no-vulkan  skip the loader download;
#   --dev        dev-profile executables, for a rehearsal of the device scripts here (CI's
#                scripts/ci.d/device.sh: it reuses the debug builds of the other checks); too
#                slow and too large to carry.
# ROLLOUTPIPE_DEVICE_PACK names another folder (the device scripts read the same variable).
set -euo pipefail
cd "$(dirname "$0")/../.."

vulkan=1
profile=release
for arg in "$@"; do
  case "$arg" in
    --no-vulkan) vulkan=0 ;;
    --dev) profile=dev ;;
    *) echo "pack.sh: unknown argument $arg (only --no-vulkan, --dev)" >&2; exit 2 ;;
  esac
done
command -v cargo >/dev/null || { echo "pack.sh: cargo not found: run this where the project builds" >&2; exit 2; }

pack="${ROLLOUTPIPE_DEVICE_PACK:-target/device-pack}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t0=$SECONDS

echo "== building the $profile executables (--features cuda, with the default wgpu)"
# --dev: cargo test's own (test) profile, whose builds the other CI checks already made.
test_profile=(--release)
bench_profile=bench
[ "$profile" = dev ] && test_profile=() bench_profile=dev
cargo test "${test_profile[@]}" --locked -p rolloutpipe-backends --features cuda --lib \
  --test conformance --test engine --test wgpu_coop --test wgpu_lookahead --no-run --message-format=json-render-diagnostics > "$tmp/tests.json"
cargo bench --profile "$bench_profile" --locked -p rolloutpipe-backends --features cuda \
  --bench wgpu --bench cuda --no-run --message-format=json-render-diagnostics > "$tmp/benches.json"

# target name (kind) -> executable, from cargo's own report of what it built.
python3 - "$tmp/tests.json" "$tmp/benches.json" > "$tmp/exes" <<'EOF'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") == "compiler-artifact" and m.get("executable"):
            kind = m["target"]["kind"][0]
            name = "unit" if kind == "lib" else m["target"]["name"]
            if kind == "bench":
                name = "bench-" + name
            print(name, m["executable"])
EOF
for want in unit conformance engine wgpu_coop wgpu_lookahead bench-wgpu bench-cuda; do
  grep -q "^$want " "$tmp/exes" || { echo "pack.sh: cargo built no '$want' executable" >&2; exit 1; }
done

rm -rf "$pack"
mkdir -p "$pack/bin"
while read -r name exe; do
  strip -o "$pack/bin/$name" "$exe"
done < "$tmp/exes"

if [ "$vulkan" = 1 ]; then
  echo "== the Vulkan loader (libvulkan1) for a machine that has none"
  mkdir -p "$pack/debs" "$tmp/lists/partial"
  o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$tmp/lists")
  apt-get "${o[@]}" update -qq 2>&1 | grep -v "^W: Download is performed unsandboxed" || true
  (cd "$pack/debs" && apt-get "${o[@]}" download libvulkan1 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
  ls "$pack/debs"/libvulkan1_*.deb >/dev/null || { echo "pack.sh: libvulkan1 was not downloaded" >&2; exit 1; }
fi

{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!target' || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), profile $profile, $(ldd --version | head -1)"
  (cd "$pack" && find . -type f ! -name MANIFEST | sort | xargs sha256sum)
} > "$pack/MANIFEST"

size=$(du -sb "$pack" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "== $pack: $((size / 1048576)) MiB (the tracked tree is $((tree / 1048576)) MiB; a device call carries 64 MiB in all), $((SECONDS - t0)) s"
cat "$pack/MANIFEST"
if [ "$profile" = release ] && [ $((size + tree)) -gt $((60 * 1048576)) ]; then
  echo "pack.sh: the pack and the tree come within 4 MiB of the device's 64 MiB limit" >&2
  exit 1
fi
