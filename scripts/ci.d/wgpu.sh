#!/usr/bin/env bash
# The wgpu conformance suite on a real adapter: CI installs Mesa's lavapipe (scripts/setup.sh),
# so here a missing adapter is a failure (ROLLOUTPIPE_REQUIRE_GPU=1) instead of the SKIP line
# that `cargo test --workspace` prints on machines without one. The kernels' naga validation
# needs no adapter and already ran in the workspace tests. `golden` checks the wgpu backend
# against transformers directly, as the CPU backend.
# ROLLOUTPIPE_PROD_SHAPES=1 adds the production-shape run (every op at Qwen3-0.6B's shapes:
# head_dim 128, vocabulary 151,936, K = 3072; backends/tests/support/op_shapes.rs), which
# prints its own wall time.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROLLOUTPIPE_REQUIRE_GPU=1 ROLLOUTPIPE_PROD_SHAPES=1 \
  cargo test --locked -p rolloutpipe-backends --features wgpu --test conformance --test engine --test golden
