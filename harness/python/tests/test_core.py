"""The core through Python: plans, every error class with its message, batch polls, the
allocation policies, and the same one-step scenario the C test (harness/capi/tests/step.c)
checks, with the same expected counters."""

import pytest

import rolloutpipe as rp


def active(b=2, g=2, groups=8, requests=32, **plan):
    s = rp.Scheduler(groups, requests)
    s.begin_step(0, 0, 2, rp.Plan(b, g, **plan))
    return s


def test_plan_defaults_and_fields_round_trip():
    p = rp.Plan(8, 4, micro_batch=2, opt_steps=2, admission="frontier", frontier_width=1)
    assert (p.max_groups, p.draw_batch, p.slots) == (16, 8, 1024)  # core defaults
    assert p.groups_per_opt_step() == 4
    p.validate()
    s = rp.Scheduler(16, 64)
    s.begin_step(0, 3, 1, p)
    got = s.plan
    assert (got.admission, got.frontier_width, got.micro_batch) == ("frontier", 1, 2)
    assert s.step == (3, 1) and s.phase == "active" and s.capacity == (16, 64)


def test_plan_errors_are_plan_errors_and_value_errors():
    p = rp.Plan(8, 4, micro_batch=3)
    with pytest.raises(rp.PlanError, match="micro-batch|micro_batch|3") as e:
        p.validate()
    assert e.value.kind == "MicroBatchNotDivisor"
    s = rp.Scheduler(4, 16)
    with pytest.raises(rp.BeginError) as e:  # PlanError is a BeginError
        s.begin_step(0, 0, 0, p)
    assert isinstance(e.value, rp.PlanError) and str(e.value).startswith("invalid plan")
    # Storage too small for max_groups = 2B: refused by the core with the capacity named.
    with pytest.raises(rp.PlanError, match="max_groups 16 exceeds the 4 group slots"):
        s.begin_step(0, 0, 0, rp.Plan(8, 2))
    with pytest.raises(ValueError, match='Plan.admission: unknown value "fifoo"'):
        rp.Plan(2, 2, admission="fifoo").validate()
    with pytest.raises(ValueError, match='Plan has no field "slotz"'):
        rp.Plan(2, 2, slotz=3)
    with pytest.raises(OverflowError):
        s.poll_draw(-1)
    with pytest.raises(ValueError, match="exceeds"):
        rp.Scheduler(1 << 25, 1)


def test_each_core_error_is_its_own_class_with_the_core_message():
    s = rp.Scheduler(8, 32)
    with pytest.raises(rp.DrawError, match="^no step is running$") as e:
        s.on_prompts_drawn(0, 1)
    assert e.value.kind == "NoActiveStep"
    with pytest.raises(rp.TrainError, match="no step is running"):
        s.on_optimizer_step_done(0)
    s.begin_step(0, 0, 2, rp.Plan(2, 2))
    with pytest.raises(rp.BeginError, match="step 0 is still in progress") as e:
        s.begin_step(0, 1, 2, rp.Plan(2, 2))
    assert not isinstance(e.value, rp.PlanError)
    s.on_prompts_drawn(1, s.poll_draw(1))
    a = s.poll_admit(1)
    with pytest.raises(rp.RequestError, match="completion from v1, step runs v2") as e:
        s.on_request_finished(2, a.request, 1, 5, 1.0)
    assert e.value.kind == "WrongVersion"
    s.on_request_finished(2, a.request, 2, 5, 1.0)
    with pytest.raises(rp.RequestError, match="request is rewarded") as e:
        s.on_request_finished(2, a.request, 2, 5, 1.0)  # duplicate
    assert e.value.kind == "BadRequestState"
    with pytest.raises(rp.RequestError, match="g9 was not drawn"):
        s.on_request_failed(2, rp.RequestId(0, 9, 0), 2)
    with pytest.raises(rp.RequestError, match="request of step 5, scheduler is in step 0"):
        s.on_abort_acked(2, rp.RequestId(5, 0, 0))
    with pytest.raises(rp.TrainError, match="no released micro-batch"):
        s.on_micro_batch_consumed(2)
    with pytest.raises(rp.SlotsError, match="zero rollout slots"):
        s.set_slots(2, 0)
    with pytest.raises(rp.ExtendError, match="zero extra samples"):
        s.extend_group(2, 0, 0)
    with pytest.raises(rp.AllocParamError):
        rp.Vigor(1, 2, 4, 64, 8)  # n0 below 2
    with pytest.raises(rp.AllocParamError):
        rp.PilotCommit(4, 12, 1.5, 0.25)
    assert all(issubclass(c, rp.RolloutPipeError) for c in (
        rp.BeginError, rp.DrawError, rp.RequestError, rp.TrainError, rp.ExtendError,
        rp.SlotsError, rp.AuditError, rp.AllocParamError))
    # Every refused event above changed nothing.
    c = s.counters
    assert (c.drawn, c.requests_admitted, c.requests_rewarded) == (2, 1, 1)
    s.audit()


def test_batch_polls_match_single_polls():
    plan = dict(slots=16, admission="fifo", order="shuffled", order_seed=7)
    a, b = active(4, 4, 8, 64, **plan), active(4, 4, 8, 64, **plan)
    for s in (a, b):
        s.on_prompts_drawn(1, s.poll_draw(1))
    batch = a.poll_admit_batch(1, 5)
    singles = [b.poll_admit(1) for _ in range(5)]
    assert batch == singles and len(batch) == 5
    assert len({x.request for x in batch}) == 5
    assert a.poll_admit_batch(1, 100) == [b.poll_admit(1) for _ in range(11)]
    assert a.poll_admit_batch(1, 100) == [] and b.poll_admit(1) is None


def test_pilot_commit_extends_in_band_and_skips_solved():
    pc = rp.PilotCommit(2, 2, 0.125, 0.25)
    plan = rp.Plan(1, 2, slots=8, max_groups=2)
    pc.configure(plan)
    assert plan.hold_scored and plan.group_size == 2 and plan.commit_reserve == 2
    s = rp.Scheduler(4, 16)
    s.begin_step(0, 0, 0, plan)
    s.on_prompts_drawn(0, 2)
    for adm in s.poll_admit_batch(0, 8):
        r = 1.0 if adm.request.group == 0 else float(adm.request.sample)  # g0 solved, g1 p=.5
        s.on_request_finished(0, adm.request, 0, 3, r)
    got = {}
    while (d := s.poll_allocation(0, pc)) is not None:
        got[d.group] = d
    assert got[0].applied == "skip" and got[0].skip_reason == "solved"
    assert got[1].applied == "extend" and got[1].extra == 2
    assert s.group(1).target == 4
    assert s.group(0).state == "filtered(skipped-solved)"
    s.audit()


def c_scenario():
    """The scenario of harness/capi/tests/step.c, step for step."""
    s = rp.Scheduler(16, 64)
    s.begin_step(0, 0, 7, rp.Plan(4, 4, micro_batch=2, opt_steps=2, slots=8, draw_batch=1,
                                  admission="frontier"))
    failed_once, mbs, opts, dispatched = False, 0, 0, []
    t = 0
    while (summary := s.poll_step_done()) is None:
        t += 1
        assert t < 1000
        n = s.poll_draw(t)
        if n is not None:
            s.on_prompts_drawn(t, n)
        for a in s.poll_admit_batch(t, 8):
            r = a.request
            if (r.group, r.sample) == (1, 2) and not failed_once:
                f = s.on_request_failed(t, r, a.version)
                assert (f.kind, f.attempt) == ("retried", 1)
                failed_once = True
                continue
            reward = 1.0 if r.group == 0 else float(r.sample % 2)
            assert s.on_request_finished(t, r, a.version, 10 + r.sample, reward).accepted
        while (ab := s.poll_abort(t)) is not None:
            s.on_abort_acked(t, ab)
        for d in s.poll_dispatch_batch(t, 16):
            assert s.group_rewards(d.group) == [0.0, 1.0, 0.0, 1.0]
            dispatched.append(d.seq)
        while (mb := s.poll_micro_batch(t)) is not None:
            assert (mb.index, mb.len) == (mbs, 2)
            s.on_micro_batch_consumed(t)
            mbs += 1
            idx = s.poll_optimizer_step(t)
            if idx is not None:
                assert idx == opts
                s.on_optimizer_step_done(t)
                opts += 1
        s.audit()
    return s, summary, mbs, opts, dispatched


def test_the_c_scenario_gives_the_same_counters_in_python():
    s, summary, mbs, opts, dispatched = c_scenario()
    c = s.counters
    assert (c.drawn, c.trained, c.filtered_zero_variance, c.aborted) == (5, 4, 1, 0)
    assert (c.requests_admitted, c.requests_failed, c.requests_rewarded) == (21, 1, 20)
    assert c.is_conserved() and c.in_flight == 0
    assert (summary.step, summary.version, summary.short) == (0, 7, False)
    assert summary.counters == c
    assert (mbs, opts, dispatched) == (2, 2, [0, 1, 2, 3])
    assert s.phase == "done"
