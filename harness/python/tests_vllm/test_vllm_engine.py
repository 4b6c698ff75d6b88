"""The vLLM adapter on its own: requests run only when added, in admission-priority order;
an abort leaves vLLM with nothing running; stop tokens and max_new_tokens map one to one;
per-request seeds repeat; the returned log-probs are the model's (checked against the
PyTorch trainer's forward); a weight update through vLLM's RL route gives what a fresh engine
on those weights gives, tied embedding included."""

import json
import os

import numpy as np
import pytest
from safetensors.torch import load_file

from rolloutpipe.torch_trainer import TorchTrainer, save_safetensors, write_random_model
from rolloutpipe.vllm_engine import VllmEngine

PROMPTS = [[1, 5, 9, 2], [3, 3, 7], [11, 4, 6, 8, 2], [9, 1]]


# Every engine of this module lives until the module ends: engines in one process end
# together (an engine's shutdown tears down vLLM's process-wide parallel state).
@pytest.fixture(scope="module")
def engine(model_dir):
    return VllmEngine(model_dir, slots=8, seed=0, kv_cache_mib=16)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return write_random_model(str(tmp_path_factory.mktemp("other") / "m"), 99)


@pytest.fixture(scope="module")
def engines(model_dir, other_model):
    """The module's other engines: a tight token budget, a small KV cache, and a fresh engine
    on the other model."""
    return {
        "budget": VllmEngine(model_dir, slots=8, seed=0, kv_cache_mib=16,
                             max_num_batched_tokens=8, max_model_len=8),
        "kv": VllmEngine(model_dir, slots=8, seed=0, kv_cache_mib=0.25, max_model_len=256),
        "fresh": VllmEngine(other_model, slots=8, seed=0, kv_cache_mib=16),
    }


def drain(eng, limit=200):
    done = {}
    for _ in range(limit):
        if not eng.active_requests:
            break
        for f in eng.step():
            done[f.key] = f
    assert eng.active_requests == 0
    return done


def test_nothing_runs_before_admission_and_abort_leaves_nothing(engine):
    assert engine.unfinished_in_vllm() == 0
    assert engine.step() == []  # idle: no iteration
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"a{i}", p, max_new_tokens=50, seed=i)
    assert engine.unfinished_in_vllm() == 3
    engine.step()
    assert engine.active_requests == 3
    assert engine.cancel_request("a1") and not engine.cancel_request("a1")
    assert engine.unfinished_in_vllm() == 2
    engine.cancel_request("a0")
    engine.cancel_request("a2")
    assert engine.unfinished_in_vllm() == 0
    assert not engine.engine.has_unfinished_requests()
    assert engine.step() == []


def test_stop_tokens_and_max_new_tokens_map_one_to_one(engine):
    engine.add_request("len", PROMPTS[0], max_new_tokens=5, temperature=0.0, seed=1)
    out = drain(engine)["len"]
    assert len(out.tokens) == 5 and out.finish == "length" and len(out.logprobs) == 5
    # The greedy response's third token as a stop token: the response ends there, with it.
    stop = out.tokens[2]
    first = out.tokens.index(stop)
    engine.add_request("stop", PROMPTS[0], max_new_tokens=5, temperature=0.0, seed=1,
                       stop_tokens=[stop])
    got = drain(engine)["stop"]
    assert got.tokens == out.tokens[:first + 1] and got.finish == "stop"


def test_seeded_requests_repeat_and_differ_by_seed(engine):
    for k, seed in (("x", 11), ("y", 11), ("z", 12)):
        engine.add_request(k, PROMPTS[2], max_new_tokens=24, temperature=1.0, seed=seed)
    d = drain(engine)
    assert d["x"].tokens == d["y"].tokens and d["x"].logprobs == d["y"].logprobs
    assert d["x"].tokens != d["z"].tokens


def test_logprobs_are_log_softmax_of_logits_over_temperature(engine, model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    tr = TorchTrainer(cfg, load_file(os.path.join(model_dir, "model.safetensors")),
                      {"lr": 0.0, "weight_decay": 0.0, "temperature": 0.7, "beta": 0.0})
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"t{i}", p, max_new_tokens=12, temperature=0.7, seed=40 + i)
    d = drain(engine)
    for i, p in enumerate(PROMPTS):
        f = d[f"t{i}"]
        want = tr.logprobs([(p, f.tokens)], temperature=0.7)[0]
        np.testing.assert_allclose(f.logprobs, want, rtol=1e-4, atol=1e-4)


def test_first_tokens_follow_admission_order_under_a_tight_token_budget(engines):
    # A token budget of 8 per iteration: only some of the admitted prefills fit each
    # iteration, so requests wait, and vLLM's priority queue serves them in admission order.
    eng = engines["budget"]
    for i in range(6):
        eng.add_request(f"r{i}", PROMPTS[i % 3], max_new_tokens=3, temperature=1.0, seed=i)
    drain(eng)
    o = eng.order_report()
    assert o["admitted"] == o["started"] == 6
    assert o["waited"] > 0 and o["overtaken"] == 0, o


def test_kv_pressure_preempts_the_latest_admitted_first(engines):
    # Four KV blocks of 128 positions for six requests of 4 + 140 tokens: vLLM must wait and
    # preempt. Its victims are the largest priority values (the latest admitted), so the
    # requests still finish in admission order and none is overtaken.
    eng = engines["kv"]
    for i in range(6):
        eng.add_request(f"k{i}", PROMPTS[0], max_new_tokens=140, seed=i)
    order = []
    while eng.active_requests:
        order += [f.key for f in eng.step()]
    assert order == [f"k{i}" for i in range(6)]
    o = eng.order_report()
    assert o["waited"] > 0 and o["stalls"] > 0 and o["overtaken"] == 0, o


def test_weight_update_route_equals_a_fresh_engine(engine, engines, other_model, model_dir):
    blob = save_safetensors(load_file(os.path.join(other_model, "model.safetensors")))
    secs = engine.load_weights(blob, version=1)
    assert secs > 0
    fresh = engines["fresh"]
    outs = []
    for eng in (engine, fresh):
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"w{i}", p, max_new_tokens=10, temperature=1.0, seed=70 + i)
        outs.append(drain(eng))
    for i in range(len(PROMPTS)):
        a, b = outs[0][f"w{i}"], outs[1][f"w{i}"]
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)
    # The update changed the model: the original weights generate something else.
    engine.load_weights(save_safetensors(load_file(os.path.join(model_dir, "model.safetensors"))))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"v{i}", p, max_new_tokens=10, temperature=1.0, seed=70 + i)
    back = drain(engine)
    assert any(back[f"v{i}"].tokens != outs[1][f"w{i}"].tokens for i in range(len(PROMPTS)))
    with pytest.raises(RuntimeError, match="while 1 requests run"):
        engine.add_request("busy", PROMPTS[0], max_new_tokens=4)
        engine.load_weights(blob)
    engine.cancel_request("busy")


def test_one_step_under_rp_scheduler_with_frontier_admission(engine):
    """A Python loop (Slime's shape) with the core deciding and the vLLM adapter executing:
    frontier admission into 6 slots, aborts of the surplus, every group accounted for; vLLM
    holds only what the core admitted and starts it in the core's order."""
    import rolloutpipe as rp

    s = rp.Scheduler(groups=32, requests=256)
    plan = rp.Plan(4, 4, micro_batch=1, slots=6, admission="frontier", dispatch="pipelined",
                   max_groups=12)
    s.begin_step(0, 0, 0, plan)
    before = engine.order_report()
    prompts, running, t = {}, {}, 0
    while (summary := s.poll_step_done()) is None:
        t += 1
        assert t < 10_000
        while (n := s.poll_draw(t)) is not None:
            first = s.on_prompts_drawn(t, n)
            for g in range(first, first + n):
                prompts[g] = PROMPTS[g % len(PROMPTS)]
        for rid in s.poll_abort_batch(t, 64):
            assert engine.cancel_request(running.pop(rid))
            s.on_abort_acked(t, rid)
        for adm in s.poll_admit_batch(t, 6 - len(running)):
            r = adm.request
            key = f"s{r.group}/{r.sample}/{r.attempt}"
            engine.add_request(key, prompts[r.group], max_new_tokens=1 + (r.sample * 5) % 9,
                               seed=1000 * r.group + r.sample)
            running[r] = key
        assert engine.unfinished_in_vllm() == len(running) <= 6
        by_key = {k: r for r, k in running.items()}
        for f in engine.step():
            rid = by_key[f.key]
            del running[rid]
            # Reward: the response's first token is even (a mixed-variance group).
            s.on_request_finished(t, rid, 0, len(f.tokens), float(f.tokens[0] % 2 == 0))
        s.poll_dispatch_batch(t, 64)
        while s.poll_micro_batch(t) is not None:
            s.on_micro_batch_consumed(t)
            if s.poll_optimizer_step(t) is not None:
                s.on_optimizer_step_done(t)
    c = summary.counters.to_dict()
    filtered = (c["filtered_zero_variance"] + c["filtered_non_finite"] + c["filtered_attempts"]
                + c["filtered_skipped"])
    assert c["trained"] == 4 and c["drawn"] == c["trained"] + filtered + c["aborted"]
    assert not running and engine.unfinished_in_vllm() == 0
    after = engine.order_report()
    assert after["started"] > before["started"] and after["overtaken"] == before["overtaken"]
