#!/usr/bin/env bash
# The vLLM layout's CI part (what fits in 6 minutes, venv set-up included): the venv of
# scripts/vllm/setup.sh (pinned; the rolloutpipe wheel scripts/ci.d/python.sh built in this
# run), then the PyTorch trainer against `rolloutpipe grpo-step` (the binary `cargo test
# --workspace` built) and the vLLM adapter's tests. The rest (the train job in process and on
# Ray, the two-node cluster) runs in scripts/vllm/test.sh, by hand; docs/vllm.md says what runs
# where. Measured on the shared 2-core machine at load ~8: the venv from scratch 4 min 38 s
# (pip's downloads cached or at ~100 MB/s), the two test files 41 s (13 tests).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
bash scripts/vllm/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
for b in "$CARGO_TARGET_DIR"/debug/rolloutpipe "$CARGO_TARGET_DIR"/release/rolloutpipe; do
    [ -x "$b" ] && export ROLLOUTPIPE_BIN="$b" && break
done
venv="${VLLM_VENV:-$root/.venv-vllm}"
(cd harness/python && timeout 600 "$venv/bin/python" -m pytest -q \
    tests_vllm/test_torch_trainer.py tests_vllm/test_vllm_engine.py)
