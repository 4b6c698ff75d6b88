"""RolloutPipe on a local Ray cluster: the train job with engines, verifiers and the trainer
as actors trains what the in-process job trains (laid out in a placement group), the trainer
puts the weights it exports and the engines sync from that object, TensorBoard gets metrics
under Slime's names; a killed engine actor's requests are re-admitted on the others; a killed
trainer actor is recovered from the last checkpoint; long-tail migration moves requests
between engine actors and trains what the run without it trains.

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


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


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


def f32(x):
    """``x`` as TensorBoard stores a scalar (an f32)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def scalars(logdir):
    """Every scalar of a TensorBoard log directory, as ``{tag: [(step, value), ...]}``, read
    back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(logdir, size_guidance={"scalars": 0})
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_ray_run_trains_what_the_in_process_run_trains(cluster, config, tmp_path):
    local = rp.train(config, str(tmp_path / "local"), tracking=True)
    remote = rp_ray.train(config, str(tmp_path / "ray"), placement="pack")
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
    # One put per weight sync (and one for the start), each read by both engines. The
    # driver puts only the start's weights; the syncs read what the trainer actor put.
    info = remote["ray"]
    assert info["publishes"] == 1 + 2 and remote["wire"]["publishes"] == 3
    assert info["trainer_publishes"] == 2 and len(info["put_s"]) == 1
    assert len(info["trainer_put_s"]) == 2
    assert all(s > 0 for s in info["put_s"] + info["trainer_put_s"])
    assert all(m["sync_s"] > 0 for m in remote["metrics"])
    saved = json.load(open(os.path.join(tmp_path, "ray", "ray.json")))
    assert saved["publishes"] == 3 and saved["node_ip"] == "127.0.0.1"
    for f in ["metrics.jsonl", "trace.json", "checkpoints/latest", "final/model.safetensors"]:
        assert os.path.exists(os.path.join(tmp_path, "ray", f)), f
    check_tensorboard(os.path.join(tmp_path, "ray"), info["perf"])
    # The in-process run logs the same, less the trainer timers it does not have.
    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "local", "metrics.jsonl"))]
    tb = scalars(os.path.join(tmp_path, "local", "tensorboard"))
    assert tb["perf/rollout_time"] == [(m["step"], f32(m["rollout_s"])) for m in lines]
    assert tb["train/grad_norm"] == [(m["step"], f32(m["grad_norm"])) for m in lines]
    assert not any(tag.startswith("perf/train") for tag in tb)


def check_tensorboard(out, perf):
    """The run's TensorBoard log holds metrics.jsonl's values under Slime's names and ours,
    and the trainer's Slime timers as Slime derives its perf metrics from them."""
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    tb = scalars(os.path.join(out, "tensorboard"))
    steps = [m["step"] for m in lines]
    assert tb["perf/rollout_time"] == [(m["step"], f32(m["rollout_s"])) for m in lines]
    assert tb["rolloutpipe/reward"] == [(m["step"], f32(m["reward"])) for m in lines]
    assert tb["rolloutpipe/sync_s"] == [(m["step"], f32(m["sync_s"])) for m in lines]
    # Slime times update_weights after train(k) and logs it with step k + 1.
    assert tb["perf/update_weights_time"] == [
        (b["step"], f32(a["sync_s"])) for a, b in zip(lines, lines[1:])]
    # One optimizer step per step: Slime's train/step is the step.
    assert tb["train/grad_norm"] == [(m["step"], f32(m["grad_norm"])) for m in lines]
    assert all(m["grad_norm"] > 0 for m in lines)
    # Slime's perf/ metrics from the trainer actor's timers, one record per trained step.
    assert [p["step"] for p in perf] == steps
    ratio = [p["train_wait_time"] / (p["train_wait_time"] + p["train_time"]) for p in perf]
    assert tb["perf/wait_time_ratio"] == [(p["step"], f32(r)) for p, r in zip(perf, ratio)]
    assert tb["perf/train_time"] == [(p["step"], f32(p["train_time"])) for p in perf]
    assert tb["perf/step_time"] == [
        (p["step"], f32(p["train_wait_time"] + p["train_time"])) for p in perf]
    # Sync mode: the trainer waits for the whole rollout, then trains.
    assert all(0 < r < 1 for r in ratio) and all(p["train_time"] > 0 for p in perf)


def test_killed_engine_actor_requests_are_readmitted(cluster, config, tmp_path):
    # Engine 0's actor is killed just before its third step message: it holds admitted
    # requests that have not finished.
    r = rp_ray.train(config, str(tmp_path / "kill"), sets=['run.mode="rolloutpipe"'],
                     kill_engine_at=(0, 3), tracking=False)
    assert r["ray"]["killed"] == [0]
    assert not os.path.exists(os.path.join(tmp_path, "kill", "tensorboard")), "tracking off"
    assert r["steps"] == 2
    accounted(r["counters"])
    assert sum(c["requests_requeued"] for c in r["counters"]) >= 1
    assert all(c["requests_failed"] == 0 for c in r["counters"])
    assert all(step == version for step, _, _, _, version in r["trained"])
    # A preempted request keeps its id and so its sampling seed: the run trains exactly what
    # the same run without the kill trains.
    whole = rp.train(config, str(tmp_path / "nokill"), sets=['run.mode="rolloutpipe"'])
    assert not os.path.exists(os.path.join(tmp_path, "nokill", "tensorboard")), "off by default"
    assert r["trained"] and sorted(r["trained"]) == sorted(whole["trained"])
    assert [c["trained"] for c in r["counters"]] == [c["trained"] for c in whole["counters"]]


def test_long_tail_migration_between_engine_actors_trains_what_the_plain_run_trains(
        cluster, config, tmp_path):
    # 16-token answers make lengths vary, so one engine is left with the tail while the other
    # idles; which requests move depends on timing, so up to 4 runs, each bit-identical.
    sets = ['run.mode="rolloutpipe"', "rl.max_new_tokens=16"]
    plain = rp.train(config, str(tmp_path / "plain"), sets=sets)
    on = sets + ["rollout.migrate=true", "rollout.migrate_min_generated=1"]
    for i in range(4):
        r = rp_ray.train(config, str(tmp_path / f"mig{i}"), sets=on, tracking=False)
        accounted(r["counters"])
        assert sorted(r["trained"]) == sorted(plain["trained"])
        assert r["weights"] == plain["weights"], "migration changed the weights"
        assert all(c["requests_failed"] == 0 for c in r["counters"])
        moved = sum(m["migrations"] for m in r["metrics"])
        if moved:
            # Each move is a re-queue in the core, never a failure.
            assert sum(c["requests_requeued"] for c in r["counters"]) >= moved
            assert sum(m["migrated_tokens"] for m in r["metrics"]) >= 2 * moved
            break
    else:
        pytest.fail("in 4 Ray runs no request migrated")


def test_killed_trainer_actor_resumes_from_the_last_checkpoint(cluster, config, tmp_path):
    out = str(tmp_path / "trainer")
    # Trainer messages of step 0: Init, micro-batch, optimizer step, export; the 6th message
    # is step 1's optimizer step, after the step-0 checkpoint was written.
    r = rp_ray.train(config, out, kill_trainer_at=6, trainer_restarts=1)
    assert r["ray"]["killed"] == ["trainer"] and r["ray"]["restarts"] == 1
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [0, 1]
    # TensorBoard has both steps: step 0 from the first attempt, step 1 from the resumed one.
    tb = scalars(os.path.join(out, "tensorboard"))
    assert tb["perf/rollout_time"] == [(m["step"], f32(m["rollout_s"])) for m in lines]
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


def test_placement_groups_hold_the_trainer_and_engines(cluster):
    from ray.util import placement_group_table

    cfg = {"rollout": {"engines": 2, "verifiers": 1}, "run": {"mode": "sync"}}
    for strategy in ["pack", "spread"]:
        w = rp_ray.RayWorkers(cfg, placement=strategy)
        try:
            table = placement_group_table(w.pg)
            assert table["strategy"] == strategy.upper() and table["state"] == "CREATED"
            assert [b for b in table["bundles"].values()] == [{"CPU": 1.0}] * 3
            where = w.placements()
            # Bundle 0 is the trainer's, bundle 1 + i engine i's.
            for b, actor in enumerate([where["trainer"]] + where["engines"]):
                assert actor["placement_group_id"] == w.pg.id.hex()
                assert actor["node_id"] == table["bundles_to_node_id"][b]
            assert all(v["placement_group_id"] is None for v in where["verifiers"])
        finally:
            w.shutdown()
        assert placement_group_table(w.pg)["state"] == "REMOVED"
    # The default places actors by their resources alone.
    w = rp_ray.RayWorkers(cfg)
    try:
        assert w.pg is None
        assert all(a["placement_group_id"] is None for a in w.placements()["engines"])
    finally:
        w.shutdown()


def test_placement_errors_are_one_line(cluster):
    cfg = {"rollout": {"engines": 1, "verifiers": 1}, "run": {"mode": "sync"}}
    with pytest.raises(ValueError, match="placement 'packed'"):
        rp_ray.RayWorkers(cfg, placement="packed")
    # A group the cluster cannot hold (no GPUs here) is refused, not waited on forever.
    with pytest.raises(RuntimeError, match="was not placed within 1s"):
        rp_ray.RayWorkers(cfg, placement="pack", engine_gpus=1, placement_timeout_s=1)


def test_wire_frames_parse_and_bad_ones_are_none():
    assert rp_ray.frame_kind(b"not a frame") is None
    assert rp_ray.frame_parts(b"RPW1" + (3).to_bytes(4, "little") + b"\0" * 8) is None
    frame = b"RPW1" + (2).to_bytes(4, "little") + struct.pack("<2Q", 9, 3) + b'"OptStep"abc'
    assert rp_ray.frame_kind(frame) == "OptStep"
    assert [bytes(p) for p in rp_ray.frame_parts(frame)] == [b'"OptStep"', b"abc"]


def test_command_line_placement_and_no_tracking(cluster, config, tmp_path, capsys):
    out = str(tmp_path / "cli")
    rc = rp_ray.main(["train", "--config", config, "--out", out, "--set", "run.steps=1",
                      "--placement", "spread", "--no-tracking"])
    assert rc == 0 and "1 steps on Ray (node 127.0.0.1)" in capsys.readouterr().out
    saved = json.load(open(os.path.join(out, "ray.json")))
    assert saved["placement"] == "spread" and saved["trainer_publishes"] == 1
    assert not os.path.exists(os.path.join(out, "tensorboard"))
    with pytest.raises(SystemExit):
        rp_ray.main(["train", "--config", config, "--out", out, "--placement", "packed"])


def test_trainer_lost_between_its_put_and_the_engines_sync_resumes(cluster, config, tmp_path):
    # The trainer actor owns the weights object of each sync: killed right after step 0's
    # export, before the engines fetch that object, the run stops and resumes from the step-0
    # checkpoint with fresh actors, and ends where an uninterrupted run does.
    out = str(tmp_path / "owner")
    r = rp_ray.train(config, out, kill_trainer_after_export=1, trainer_restarts=1,
                     tracking=False)
    assert r["ray"]["killed"] == ["trainer"] and r["ray"]["restarts"] == 1
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [0, 1]
    accounted(r["counters"])
    whole = rp.train(config, str(tmp_path / "whole"))
    assert max_abs_diff(whole["weights"], r["weights"]) <= 1e-6
