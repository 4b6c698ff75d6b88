"""The CPU backend from Python: an HF model directory loads (or raises BackendError), the
engine adds, cancels, steps and hands back finished responses, seeded sampling is
reproducible, the trainer's GRPO step moves a rewarded response's log-prob up, and weights
round-trip through safetensors bytes with HF tensor names."""

import json
import struct
import threading
import time

import pytest

import rolloutpipe as rp


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "tiny"
    rp.write_tiny_model(str(d), seed=3)
    return d


def test_model_dir_loads_and_bad_dirs_raise(model_dir, tmp_path):
    p = rp.CpuPolicy(str(model_dir))
    assert p.vocab_size == 11
    with pytest.raises(rp.BackendError, match="config.json"):
        rp.CpuPolicy(str(tmp_path / "missing"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(rp.BackendError):
        rp.CpuPolicy(str(broken))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        rp.write_tiny_model(str(model_dir))  # nothing a user made is overwritten


def generate(p, keys, seed0=0, n=6):
    for k in keys:
        p.add_request(k, [1, 2, 3], max_new_tokens=n, seed=seed0 + k)
    out = {}
    for _ in range(100):
        if p.active_requests == 0:
            break
        p.step()
        for f in p.take_finished():
            out[f.key] = f
    return out


def test_engine_generates_seeded_cancels_and_reports_finish(model_dir):
    a, b = rp.CpuPolicy(str(model_dir)), rp.CpuPolicy(str(model_dir))
    ra, rb = generate(a, [1, 2, 3]), generate(b, [1, 2, 3])
    assert sorted(ra) == [1, 2, 3]
    for k in ra:
        assert ra[k].tokens == rb[k].tokens and ra[k].logprobs == rb[k].logprobs
        assert len(ra[k].tokens) == len(ra[k].logprobs) <= 6
        assert ra[k].finish in ("stop", "length")
        assert all(0 <= t < 11 for t in ra[k].tokens)
    # The sampling log-probs are the model's: recompute them with the trainer role.
    lp = a.logprobs([([1, 2, 3], ra[1].tokens)])[0]
    assert lp == pytest.approx(ra[1].logprobs, abs=1e-4)
    a.add_request(9, [1, 2], max_new_tokens=50, seed=1)
    a.step()
    a.cancel_request(9)
    assert a.active_requests == 0
    with pytest.raises(rp.BackendError):
        a.cancel_request(9)  # unknown now


def test_grpo_step_raises_the_rewarded_response_and_weights_round_trip(model_dir):
    p = rp.CpuPolicy(str(model_dir))
    good, bad = [4, 5, 6, 7], [8, 9, 10, 2]
    before = [sum(x) for x in p.logprobs([([1, 2], good), ([1, 2], bad)])]
    p.zero_grad()
    p.accumulate([([1, 2], good, 1.0), ([1, 2], bad, -1.0)])
    norm = p.optimizer_step(normalizer=8.0, lr=1e-2)
    assert norm > 0
    after = [sum(x) for x in p.logprobs([([1, 2], good), ([1, 2], bad)])]
    assert after[0] > before[0] and after[1] < before[1]

    blob = p.export_weights()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    assert "model.embed_tokens.weight" in header
    assert all(v["dtype"] == "F32" for k, v in header.items() if k != "__metadata__")
    fresh = rp.CpuPolicy(str(model_dir))
    assert fresh.logprobs([([1, 2], good)]) != p.logprobs([([1, 2], good)])
    fresh.import_weights(blob)
    assert fresh.logprobs([([1, 2], good)]) == p.logprobs([([1, 2], good)])
    with pytest.raises(rp.BackendError):
        fresh.import_weights(b"not safetensors")


def test_the_gil_is_released_during_model_work(model_dir):
    """Another Python thread, woken just before a long model call, runs during the call. With
    the GIL held it could only run once the call returned (CPython forces a switch only at a
    bytecode boundary, after the native call)."""
    p = rp.CpuPolicy(str(model_dir))
    batch = [([1, 2, 3], [4, 5, 6, 7] * 8)]
    while True:  # a call long enough (>= 0.2 s) that thread wake-up noise is small beside it
        t0 = time.perf_counter()
        p.logprobs(batch)
        if time.perf_counter() - t0 >= 0.2 or len(batch) >= 1 << 14:
            break
        batch = batch * 2
    go, seen = threading.Event(), []

    def other():
        go.wait()
        seen.append(time.perf_counter())

    th = threading.Thread(target=other)
    th.start()
    go.set()
    t_enter = time.perf_counter()
    p.logprobs(batch)
    t_exit = time.perf_counter()
    th.join()
    assert t_enter < seen[0] < t_enter + 0.5 * (t_exit - t_enter), (t_enter, seen, t_exit)
