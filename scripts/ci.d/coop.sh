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

# The test executables of `cargo test --workspace --locked` (the same command and features as
# scripts/test.sh's, so after it nothing is rebuilt; a per-package build with other features
# rebuilt the dependency tree, about 20 CPU minutes), by test name.
bins=$(cargo test --workspace --locked --no-run --message-format=json |
  python3 -c 'import json,sys
want = {"wgpu_coop", "train_tensor_cores"}
for l in sys.stdin:
    m = json.loads(l)
    name = m.get("target", {}).get("name")
    if m.get("reason") == "compiler-artifact" and name in want and m.get("executable"):
        print(name, m["executable"])')

for t in wgpu_coop train_tensor_cores; do
  bin=$(awk -v t="$t" '$1 == t { print $2 }' <<<"$bins")
  [ -n "$bin" ] || { echo "coop.sh: no $t test binary was built"; exit 1; }
  ROLLOUTPIPE_REQUIRE_GPU=1 ROLLOUTPIPE_REQUIRE_COOP=1 target/coop-lavapipe/run "$bin"
done
