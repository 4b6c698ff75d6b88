#!/usr/bin/env bash
# The CUDA kernels without a GPU: assembles every kernels/ptx/*.ptx with NVIDIA's ptxas for
# sm_80 and sm_90 and checks registers, shared memory, spills and local memory against the
# committed report kernels/ptx/resources.toml (scripts/ci.d/ptx_resources.py says what fails),
# then checks that the PTX interpreter's NVRTC-compiled reference kernels
# (kernels/ptx-interp/tests/nvrtc/*.ptx, which `cargo test` runs) are fresh against their
# CUDA C sources (scripts/ci.d/ptx_nvrtc.py).
# ptxas and NVRTC come from the pinned PyPI wheels nvidia-cuda-nvcc-cu12 and
# nvidia-cuda-nvrtc-cu12 in the ignored /.venv-ptx.
# `bash scripts/ci.d/ptx.sh --write` regenerates the report and the reference PTX after a
# deliberate change.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC_VERSION=12.9.86
VENV=.venv-ptx
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  if ! python3 -m venv "$VENV" 2>/dev/null; then
    # Debian ships venv separately; install it the way scripts/setup.sh installs packages.
    rm -rf "$VENV"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    fi
    python3 -m venv "$VENV"
  fi
fi
for wheel in nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12; do
  if ! "$VENV/bin/python" -m pip show "$wheel" 2>/dev/null | grep -qx "Version: $NVCC_VERSION"; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel==$NVCC_VERSION"
  fi
done
PTXAS=$("$VENV/bin/python" -c 'import nvidia.cuda_nvcc, os; print(os.path.join(list(nvidia.cuda_nvcc.__path__)[0], "bin", "ptxas"))')
"$PTXAS" --version | tail -1
"$VENV/bin/python" scripts/ci.d/ptx_resources.py "$PTXAS" "$@"
if [ "${1:-}" = --write ]; then
  "$VENV/bin/python" scripts/ci.d/ptx_nvrtc.py
else
  "$VENV/bin/python" scripts/ci.d/ptx_nvrtc.py --check
fi
echo "ptx check took $(( $(date +%s) - start )) s"
