"""Shared fixtures of the vLLM and PyTorch tests (they need the venv of
scripts/vllm/setup.sh: torch, transformers, vLLM's CPU build, Ray, and the rolloutpipe wheel).

The job of the end-to-end tests is the tiny one of tests/test_ray.py (a 1-layer model
warm-started on 1-digit addition, 4 groups of 4 per step, 2 engines of 4 slots) with heads of
width 32, the narrowest vLLM's CPU attention takes."""

import os
import shutil
import subprocess

import pytest


REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

TINY = """
[run]
seed = 3
steps = 2
mode = "sync"
eval_every = 0
eval_problems = 24
test_problems = 0
checkpoint_every = 1
progress = false
[task]
name = "add"
digits = 1
[model]
hidden_size = 32
intermediate_size = 64
layers = 1
heads = 2
kv_heads = 1
head_dim = 32
[sft]
steps = 40
batch = 16
lr = 1e-2
carry_drop = 0.0
[rl]
batch_groups = 4
group_size = 4
micro_batch = 1
max_new_tokens = 4
lr = 1e-3
[rollout]
engines = 2
verifiers = 1
slots = 4
max_groups_factor = 4.0
"""


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
