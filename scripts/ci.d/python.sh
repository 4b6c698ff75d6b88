#!/usr/bin/env bash
# The Python package: makes a venv under the repo (.venv-py, git-ignored), installs maturin and
# pytest into it, builds the `rolloutpipe` wheel (PyO3 abi3) with harness/python's own
# Cargo.lock, installs the wheel and runs harness/python/tests with pytest. Measured: a clean
# release build without the harness library took 73 s CPU; adding the harness library (for
# `Task`) took another 228 s CPU (11.5 min wall on the shared, loaded 2-core machine), so about
# 5 min CPU from a clean target; pytest about 2 s. Ray (for rolloutpipe.ray and
# tests/test_ray.py, on a local Ray instance bound to 127.0.0.1) is installed into the same
# venv; see docs/ray.md for what that adds to CI. tensorboardX (the launcher's TensorBoard
# writer) and tensorboard (its event reader, for the test that reads the log back) add 11 s
# to a fresh venv here (pip install, measured once).
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
venv="$root/.venv-py"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "maturin>=1.5,<2" "pytest>=7" "ray>=2.40,<3" \
    "tensorboardX>=2.6,<3" "tensorboard>=2.14,<3"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
wheels="$CARGO_TARGET_DIR/wheels-ci"
rm -rf "$wheels" # only this script's own build output
(cd harness/python && "$venv/bin/maturin" build --locked --release --out "$wheels")
"$venv/bin/pip" install -q --force-reinstall --no-deps "$wheels"/rolloutpipe-*.whl
(cd harness/python && "$venv/bin/python" -m pytest -q)
