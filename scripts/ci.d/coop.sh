#!/usr/bin/env bash
# Tensor cores (cooperative matrices) on a lavapipe that has them. The system Mesa of this
# machine kind (22.3) has none, so in `cargo test` backends/tests/wgpu_coop.rs and
# harness/tests/train_tensor_cores.rs check only the refusals and print SKIP for the rest. Here
# scripts/coop_lavapipe.py unpacks Mesa 26's lavapipe from Debian's trixie-backports into
# target/coop-lavapipe (SHA-256 checked, cached, nothing installed) and the same test binaries
# run against it with ROLLOUTPIPE_REQUIRE_COOP=1, so a skip is an error: matmul_fwd_coop's and
# matmul_bwd_coop's products, batch invariance, log-probs, decoding and training gradients, and
# `train` with tensor-core engines and a tensor-core trainer (in-process and remote) are proven
# on every CI run.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 scripts/coop_lavapipe.py

# The test executable cargo builds for `--test $2` of package $1 (features as `cargo test
# --workspace` builds them, so nothing is rebuilt after it).
test_bin() {
  cargo test --locked -p "$1" --features wgpu --test "$2" --no-run --message-format=json |
    python3 -c 'import json,sys
name = sys.argv[1]
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        print(m["executable"])' "$2"
}

for t in rolloutpipe-backends:wgpu_coop rolloutpipe-harness:train_tensor_cores; do
  bin=$(test_bin "${t%%:*}" "${t#*:}")
  [ -n "$bin" ] || { echo "coop.sh: no ${t#*:} test binary was built"; exit 1; }
  ROLLOUTPIPE_REQUIRE_GPU=1 ROLLOUTPIPE_REQUIRE_COOP=1 target/coop-lavapipe/run "$bin"
done
