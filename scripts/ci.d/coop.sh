#!/usr/bin/env bash
# Tensor cores (cooperative matrices) on a lavapipe that has them. The system Mesa of this
# machine kind (22.3) has none, so in `cargo test` backends/tests/wgpu_coop.rs checks only
# the refusal and prints SKIP for the rest. Here scripts/coop_lavapipe.py unpacks Mesa 26's
# lavapipe from Debian's trixie-backports into target/coop-lavapipe (SHA-256 checked,
# cached, nothing installed) and the same test binary runs against it with
# ROLLOUTPIPE_REQUIRE_COOP=1, so a skip is an error: matmul_fwd_coop's products, batch
# invariance, log-probs, decoding and training gradients are proven on every CI run.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 scripts/coop_lavapipe.py
bin=$(cargo test --locked -p rolloutpipe-backends --features wgpu --test wgpu_coop --no-run \
  --message-format=json |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "wgpu_coop" and m.get("executable"):
        print(m["executable"])')
[ -n "$bin" ] || { echo "coop.sh: no wgpu_coop test binary was built"; exit 1; }
ROLLOUTPIPE_REQUIRE_GPU=1 ROLLOUTPIPE_REQUIRE_COOP=1 target/coop-lavapipe/run "$bin"
