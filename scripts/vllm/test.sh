#!/usr/bin/env bash
# Every test of the vLLM layout: builds the venv (scripts/vllm/setup.sh), the `rolloutpipe`
# binary when none is built (for the trainer's check against `grpo-step`), then
#   harness/python/tests_vllm/  (pytest: the PyTorch trainer against grpo-step, the vLLM
#                                adapter, the train job in process, the Ray layout)
#   scripts/vllm/two_node.py    (the Ray layout on a two-node cluster on 127.0.0.1)
# CI runs only the part that fits its 6 minutes (scripts/ci.d/vllm.sh: the trainer and the
# adapter tests). Measured here (2 cores, load 7-14 from other builds): the trainer and adapter
# files 41 s together, the train job in process 52-110 s, Ray 112-187 s; two_node.py 65 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
bash scripts/vllm/setup.sh
venv="${VLLM_VENV:-$root/.venv-vllm}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
if [ -z "${ROLLOUTPIPE_BIN:-}" ]; then
    for b in "$CARGO_TARGET_DIR"/release/rolloutpipe "$CARGO_TARGET_DIR"/debug/rolloutpipe; do
        [ -x "$b" ] && export ROLLOUTPIPE_BIN="$b" && break
    done
fi
if [ -z "${ROLLOUTPIPE_BIN:-}" ]; then
    cargo build --locked --bin rolloutpipe -p rolloutpipe-harness --no-default-features
    export ROLLOUTPIPE_BIN="$CARGO_TARGET_DIR/debug/rolloutpipe"
fi
(cd harness/python && timeout 1800 "$venv/bin/python" -m pytest -q tests_vllm "$@")
timeout 900 "$venv/bin/python" scripts/vllm/two_node.py
