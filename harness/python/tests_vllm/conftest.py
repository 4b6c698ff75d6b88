"""Shared fixtures of the vLLM and PyTorch tests (they need the venv of
scripts/vllm/setup.sh: torch, transformers, vLLM's CPU build, Ray, and the rolloutpipe wheel).

The job of the end-to-end tests is the tiny one of tests/test_ray.py (a 1-layer model
warm-started on 1-digit addition, 4 groups of 4 per step, 2 engines of 4 slots) with heads of
width 32, the narrowest vLLM's CPU attention takes, and one group per micro-batch."""

import os
import shutil
import subprocess
import sys

import pytest


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_ray import TINY as RAY_TINY  # noqa: E402

# One group per micro-batch (so rolloutpipe mode pipelines the trainer), heads of 32.
TINY = RAY_TINY.replace("head_dim = 16", "head_dim = 32").replace("micro_batch = 4",
                                                                    "micro_batch = 1")
assert "head_dim = 32" in TINY and "micro_batch = 1" in TINY


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(TINY)
    return str(path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A seeded random small Qwen3 directory (tied embedding, head_dim 32)."""
    from rolloutpipe.torch_trainer import write_random_model

    return write_random_model(str(tmp_path_factory.mktemp("model") / "small"), 7)


@pytest.fixture(scope="session")
def rolloutpipe_bin():
    """The ``rolloutpipe`` binary (for ``grpo-step``): $ROLLOUTPIPE_BIN, else a build under
    $CARGO_TARGET_DIR or target/. A missing binary fails the test (scripts/vllm/test.sh
    builds it)."""
    cands = [os.environ.get("ROLLOUTPIPE_BIN")]
    for root in (os.environ.get("CARGO_TARGET_DIR"), os.path.join(REPO, "target")):
        if root:
            cands += [os.path.join(root, p, "rolloutpipe") for p in ("release", "debug")]
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    found = shutil.which("rolloutpipe")
    if found:
        return found
    pytest.fail("no rolloutpipe binary: set ROLLOUTPIPE_BIN or run "
                "`cargo build --bin rolloutpipe` (scripts/vllm/test.sh does)")


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, **kw)
