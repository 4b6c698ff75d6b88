"""The tasks' generators and verifiers from Python: seeded sampling, each verdict kind, the
reward's format penalty, and clean errors for unknown tasks, bad options and bad metadata."""

import json

import pytest

import rolloutpipe as rp


def test_add_task_samples_seeded_and_verifies_its_own_answers():
    t = rp.Task("add", digits=2)
    assert t.name == "add"
    a, b = t.sample(seed=4, n=5), t.sample(seed=4, n=5)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert len({p.prompt for p in t.sample(seed=4, n=50)}) > 10
    for p in a:
        assert t.verify(p, p.answer) == ("correct", None)
        assert t.reward(p, p.answer) == 1.0
        wrong = str(int(p.answer) + 1)
        kind, why = t.verify(p, wrong)
        assert kind == "incorrect" and why
        assert t.reward(p, wrong) == 0.0


def test_format_penalty_applies_to_malformed_responses_only():
    t = rp.Task("mul", format_penalty=0.5)
    p = t.sample(seed=1, n=1)[0]
    kind, _ = t.verify(p, "no number here")
    assert kind == "malformed"
    assert t.reward(p, "no number here") == -0.5


def test_countdown_uses_its_metadata():
    t = rp.Task("countdown", numbers=3)
    p = t.sample(seed=2, n=1)[0]
    meta = json.loads(p.meta)
    assert meta  # numbers and target travel in the metadata
    assert t.verify(p, p.answer)[0] == "correct"
    assert t.verify(p, "1 +")[0] in ("malformed", "incorrect")


def test_task_errors_are_clean():
    with pytest.raises(rp.TaskError, match='unknown task "sub"'):
        rp.Task("sub")
    with pytest.raises(rp.TaskError, match="bad task option"):
        rp.Task("add", digits=0)
    t = rp.Task("add")
    with pytest.raises(rp.TaskError, match="not JSON"):
        t.verify(rp.Problem("1+1", "2", meta="{"), "2")
    assert issubclass(rp.TaskError, rp.RolloutPipeError)
