"""The train job with vLLM engines and the PyTorch trainer, in this process: a short sync run
and a short rolloutpipe run account for every group (drawn = trained + filtered + aborted,
nothing in flight, full batches); the run directory is train's (metrics.jsonl fields, sft/,
final/, checkpoints, TensorBoard under Slime's names); and the trainer fed the pipelined run's
groups ends with the weights it gets when fed the same groups in sync order."""

import json
import os

import numpy as np
import pytest
import torch

import rolloutpipe as rp
from rolloutpipe import vllm as rp_vllm
from rolloutpipe import wire
from rolloutpipe.torch_trainer import load_safetensors
from rolloutpipe.vllm_hosts import TorchTrainerHost


def accounted(result, batch_groups):
    for c in result["counters"]:
        filtered = (c["filtered_zero_variance"] + c["filtered_non_finite"]
                    + c["filtered_attempts"] + c["filtered_skipped"])
        assert c["drawn"] == c["trained"] + filtered + c["aborted"], c
        assert c["in_flight"] == 0 and c["trained"] == batch_groups, c
    for m in result["metrics"]:
        assert m["requests_failed"] == 0 and m["trained"] == batch_groups, m


@pytest.mark.parametrize("mode", ["sync", "rolloutpipe"])
def test_short_runs_account_for_every_group(tmp_path, tiny_config, mode):
    out = tmp_path / mode
    r = rp_vllm.train(tiny_config, str(out), sets=[f'run.mode="{mode}"'], tracking=True)
    assert r["steps"] == 2
    accounted(r, 4)
    fields = set(json.loads(open(out / "metrics.jsonl").readline()))
    assert {"rollout_s", "rollout_to_train_end_s", "sync_s", "trainer_wait_ratio", "reward",
            "grad_norm", "drawn", "trained", "aborted"} <= fields
    for d in ("sft", "final", "checkpoints", "tensorboard"):
        assert (out / d).exists(), d
    v = json.load(open(out / "vllm.json"))
    assert v["layout"] == "in-process" and len(v["engines"]) == 2
    for e in v["engines"]:
        # Every admitted request started (or was cancelled first); one load per sync.
        assert e["order"]["admitted"] >= e["order"]["started"] > 0
        assert len(e["sync_s"]) == r["steps"] + 1  # v0 before step 0, then one per step
    assert all(m["sync_s"] > 0 for m in r["metrics"])


def test_pipelined_groups_in_sync_order_give_the_same_weights(tmp_path, tiny_config):
    cfg = json.loads(rp.resolve_config(tiny_config, str(tmp_path / "pipe"),
                                       ['run.mode="rolloutpipe"', "rl.micro_batch=2"], False))
    workers = rp_vllm.LocalWorkers(cfg)
    sent = []

    def send(route, msg):
        if route == "trainer":
            sent.append(bytes(msg))
        return workers.send(route, msg)

    try:
        r = rp.train(tiny_config, str(tmp_path / "pipe"), send=send,
                     sets=['run.mode="rolloutpipe"', "rl.micro_batch=2"])
    finally:
        workers.close()
    # Replay: the same Init, then per step the step's groups in id order, two per micro-batch.
    host = TorchTrainerHost()
    host.handle(sent[0])
    steps, orders = {}, []
    for msg in sent[1:]:
        name, body = wire.variant(wire.decode(msg)[0])
        if name == "MicroBatch":
            for g in body:
                steps.setdefault(g["step"], []).append(g)
            orders.append([g["group"] for g in body])
    assert any(o != sorted(o) for o in orders) or len({tuple(o) for o in orders}) > 1
    for step in sorted(steps):
        groups = sorted(steps[step], key=lambda g: g["group"])
        for i in range(0, len(groups), 2):
            host.handle(wire.encode({"MicroBatch": groups[i:i + 2]}))
        host.handle(wire.encode("OptStep"))
    reply = host.handle(wire.encode({"Export": {"optimizer": False}}))
    replayed = load_safetensors(wire.decode(reply)[1][0])
    final = load_safetensors(r["weights"])
    a = torch.cat([replayed[k].ravel() for k in sorted(final)]).double()
    b = torch.cat([final[k].ravel() for k in sorted(final)]).double()
    assert float((a - b).norm() / b.norm()) < 1e-6
    sft = load_safetensors(open(tmp_path / "pipe" / "sft" / "model.safetensors", "rb").read())
    c = torch.cat([sft[k].ravel() for k in sorted(final)]).double()
    assert float((b - c).norm() / c.norm()) > 1e-5, "the run trained"


def test_bad_messages_are_wire_errors_and_unsupported_features_fatal(tmp_path):
    from rolloutpipe.vllm_hosts import VllmEngineHost

    with pytest.raises(wire.WireFormatError, match="no RPW1 magic"):
        TorchTrainerHost().handle(b"junk")
    reply = TorchTrainerHost().handle(wire.encode("OptStep"))
    assert "Fatal" in wire.decode(reply)[0] and "Init first" in wire.decode(reply)[0]["Fatal"]
    host = VllmEngineHost(4)
    init = {"Init": {"engine": 0, "backend": "cpu", "threads": 1, "dtype": "bf16", "model": {},
                     "fail_at_request": None}}
    fatal = wire.decode(host.handle(wire.encode(init), b"x"))[0]["Fatal"]
    assert "rollout.dtype 'bf16'" in fatal
