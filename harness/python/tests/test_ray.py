"""RolloutPipe on a local Ray cluster: the train job with engines, verifiers and the trainer
as actors trains what the in-process job trains; a killed engine actor's requests are
re-admitted on the others; a killed trainer actor is recovered from the last checkpoint.

The job is the tiny one of harness/tests/train_transport.rs (a 1-layer model warm-started on
1-digit addition, 4 groups of 4 per step, 2 engines, 2 verifiers)."""

import array
import json
import os
import struct

import pytest

import rolloutpipe as rp

ray = pytest.importorskip("ray")
from rolloutpipe import ray as rp_ray  # noqa: E402  (needs ray)

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
head_dim = 16
[sft]
steps = 40
batch = 16
lr = 1e-2
carry_drop = 0.0
[rl]
batch_groups = 4
group_size = 4
micro_batch = 4
max_new_tokens = 4
lr = 1e-3
[rollout]
engines = 2
verifiers = 2
slots = 4
max_groups_factor = 4.0
"""


@pytest.fixture(scope="module")
def cluster():
    node = rp_ray.start_ray(num_cpus=4)
    yield node
    ray.shutdown()


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return str(p)


def tensors(blob):
    """The f32 tensors of a safetensors blob, by name (pure Python: no numpy needed)."""
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", name
        a, b = t["data_offsets"]
        out[name] = array.array("f", data[a:b])
    return out


def max_abs_diff(x, y):
    tx, ty = tensors(x), tensors(y)
    assert tx.keys() == ty.keys()
    return max(abs(p - q) for k in tx for p, q in zip(tx[k], ty[k]))


def accounted(counters):
    for c in counters:
        filtered = (c["filtered_zero_variance"] + c["filtered_non_finite"]
                    + c["filtered_attempts"] + c["filtered_skipped"])
        assert c["drawn"] == c["trained"] + filtered + c["aborted"], c
        assert c["in_flight"] == 0, c


def test_ray_stays_on_the_loopback_address(cluster):
    assert cluster == "127.0.0.1"
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert nodes and all(n["NodeManagerAddress"] == "127.0.0.1" for n in nodes)


def test_ray_run_trains_what_the_in_process_run_trains(cluster, config, tmp_path):
    local = rp.train(config, str(tmp_path / "local"))
    remote = rp_ray.train(config, str(tmp_path / "ray"))
    assert local["steps"] == remote["steps"] == 2
    assert local["trained"], "something was trained"
    assert sorted(local["trained"]) == sorted(remote["trained"])
    for a, b in zip(local["metrics"], remote["metrics"]):
        assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"]
    accounted(remote["counters"])
    # Same weights, bit for bit (one micro-batch per step, groups summed in id order).
    assert local["weights"] == remote["weights"]
    with open(os.path.join(tmp_path, "local", "sft", "model.safetensors"), "rb") as f:
        assert max_abs_diff(f.read(), local["weights"]) > 1e-5, "the run moved the weights"
    # One put per weight sync (and one for the start), each read by both engines.
    info = remote["ray"]
    assert info["publishes"] == 1 + 2 and remote["wire"]["publishes"] == 3
    assert all(s > 0 for s in info["put_s"])
    assert all(m["sync_s"] > 0 for m in remote["metrics"])
    saved = json.load(open(os.path.join(tmp_path, "ray", "ray.json")))
    assert saved["publishes"] == 3 and saved["node_ip"] == "127.0.0.1"
    for f in ["metrics.jsonl", "trace.json", "checkpoints/latest", "final/model.safetensors"]:
        assert os.path.exists(os.path.join(tmp_path, "ray", f)), f


def test_killed_engine_actor_requests_are_readmitted(cluster, config, tmp_path):
    # Engine 0's actor is killed just before its third step message: it holds admitted
    # requests that have not finished.
    r = rp_ray.train(config, str(tmp_path / "kill"), sets=['run.mode="rolloutpipe"'],
                     kill_engine_at=(0, 3))
    assert r["ray"]["killed"] == [0]
    assert r["steps"] == 2
    accounted(r["counters"])
    assert sum(c["requests_requeued"] for c in r["counters"]) >= 1
    assert all(c["requests_failed"] == 0 for c in r["counters"])
    assert all(step == version for step, _, _, _, version in r["trained"])
    # A preempted request keeps its id and so its sampling seed: the run trains exactly what
    # the same run without the kill trains.
    whole = rp.train(config, str(tmp_path / "nokill"), sets=['run.mode="rolloutpipe"'])
    assert r["trained"] and sorted(r["trained"]) == sorted(whole["trained"])
    assert [c["trained"] for c in r["counters"]] == [c["trained"] for c in whole["counters"]]


def test_killed_trainer_actor_resumes_from_the_last_checkpoint(cluster, config, tmp_path):
    out = str(tmp_path / "trainer")
    # Trainer messages of step 0: Init, micro-batch, optimizer step, export; the 6th message
    # is step 1's optimizer step, after the step-0 checkpoint was written.
    r = rp_ray.train(config, out, kill_trainer_at=6, trainer_restarts=1)
    assert r["ray"]["killed"] == ["trainer"] and r["ray"]["restarts"] == 1
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [0, 1]
    # The resumed run ends where an uninterrupted one does.
    whole = rp.train(config, str(tmp_path / "whole"))
    assert max_abs_diff(whole["weights"], r["weights"]) <= 1e-6


def test_hosts_refuse_bad_messages():
    for host in [rp.EngineHost(), rp.TrainerHost(), rp.VerifierHost()]:
        with pytest.raises(rp.WireError):
            host.handle(b"not a frame")


def test_a_job_that_does_not_fit_the_cluster_is_refused(cluster):
    # Ray would queue actors that do not fit forever; the launcher refuses up front.
    with pytest.raises(RuntimeError, match="CPUs"):
        rp_ray.RayWorkers({"rollout": {"engines": 64, "verifiers": 1}})
