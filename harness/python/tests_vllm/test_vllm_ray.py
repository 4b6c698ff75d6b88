"""The vLLM layout on a local Ray instance (127.0.0.1): engines and the PyTorch trainer as
actors in a placement group, the trainer's weights put once per sync; an engine actor killed
mid-step is reported, its requests re-admitted on the other engine, and the run then resumes
from its checkpoint with fresh actors."""

import json

import pytest

ray = pytest.importorskip("ray")
from rolloutpipe import ray as rp_ray  # noqa: E402
from rolloutpipe import vllm as rp_vllm  # noqa: E402
from test_vllm_train import accounted  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    node = rp_ray.start_ray(num_cpus=4)
    yield node
    ray.shutdown()


def test_ray_layout_runs_rolloutpipe_mode(cluster, tmp_path, tiny_config):
    out = tmp_path / "ray"
    r = rp_vllm.train(tiny_config, str(out), sets=['run.mode="rolloutpipe"'], use_ray=True,
                      placement="pack")
    accounted(r, 4)
    info = r["ray"]
    assert info["placement"] == "pack" and len(info["engine_reports"]) == 2
    assert all(e["order"]["started"] > 0 for e in info["engine_reports"])
    # The start's weights are the driver's put; every sync after reads the one object the
    # trainer actor put (the PyTorch trainer's export is byte for byte the blob the driver
    # would publish, so the driver passes the trainer's reference on).
    assert info["publishes"] == 1 + 2 and info["trainer_publishes"] == 2
    v = json.load(open(out / "vllm.json"))
    assert v["layout"] == "ray"


def test_killed_engine_actor_is_reported_and_the_run_resumes(cluster, tmp_path, tiny_config):
    out = str(tmp_path / "kill")
    r = rp_vllm.train(tiny_config, out, sets=["run.steps=1"], use_ray=True,
                      kill_engine_at=(0, 3))
    assert r["ray"]["killed"] == [0]
    accounted(r, 4)
    assert [e.get("lost") is None for e in r["ray"]["engine_reports"]] == [True]
    resumed = rp_vllm.train(None, out, sets=["run.steps=2"], resume=True, use_ray=True)
    assert [m["step"] for m in resumed["metrics"]][-1] == 1
    accounted({"counters": resumed["counters"][-1:], "metrics": resumed["metrics"][-1:]}, 4)
