"""A short end-to-end RL loop written in Python around the real core (no mocks of it).

The task is real and small: prompts are ``a + b`` with seeded digits, an engine answers with
text, a verifier parses the text and compares it with the sum. The policy is a softmax over
five answer offsets (-2..2; offset 0 is the right answer), trained with GRPO (group-normalised
advantages, the exact softmax log-prob gradient, micro-batches and optimizer steps exactly as
the core announces them). Engines have 4 slots each and seeded latencies, so requests finish
out of order, surplus requests get aborted, zero-variance groups get filtered and replaced.
"""

import math
import random

import rolloutpipe as rp

OFFSETS = [-2, -1, 0, 1, 2]


class Policy:
    def __init__(self):
        self.theta = [0.0] * len(OFFSETS)
        self.version = 0

    def probs(self, theta=None):
        theta = self.theta if theta is None else theta
        m = max(theta)
        e = [math.exp(t - m) for t in theta]
        z = sum(e)
        return [x / z for x in e]


class Engine:
    """Continuous batching with `slots` slots; each request takes a seeded 1..4 ticks."""

    def __init__(self, slots, seed):
        self.slots = slots
        self.rng = random.Random(seed)
        self.running = {}  # RequestId -> (done_at, version, prompt, offset index)
        self.weights = None

    def load(self, theta, version):
        self.weights = (list(theta), version)

    def add(self, now, adm, prompt, probs):
        assert adm.version == self.weights[1], "engine serves the step's version"
        k = self.rng.choices(range(len(OFFSETS)), probs)[0]
        self.running[adm.request] = (now + self.rng.randint(1, 4), adm.version, prompt, k)

    def finished(self, now):
        done = [r for r, v in self.running.items() if v[0] <= now]
        for r in sorted(done):
            _, version, (a, b), k = self.running.pop(r)
            yield r, version, f"{a} + {b} = {a + b + OFFSETS[k]}", k


def verify(prompt, text):
    a, b = prompt
    return 1.0 if int(text.rsplit("=", 1)[1]) == a + b else 0.0


def run(steps=8, b=4, g=4, seed=0):
    data = random.Random(seed)
    policy = Policy()
    engines = [Engine(4, seed * 10 + i) for i in range(2)]
    s = rp.Scheduler(groups=64, requests=1024)
    plan = rp.Plan(b, g, micro_batch=2, opt_steps=2, slots=8, admission="frontier",
                   frontier_filter_ppm=500_000, max_groups=8 * b)
    accuracy = [policy.probs()[OFFSETS.index(0)]]
    t = 0
    totals = {"aborted_requests": 0, "filtered": 0, "trained": 0}
    trained_per_step = []
    for step in range(steps):
        for e in engines:
            e.load(policy.theta, policy.version)
        s.begin_step(t, step, policy.version, plan)
        prompts, chosen, where = {}, {}, {}
        grad, n_samples = [0.0] * len(OFFSETS), 0
        while (summary := s.poll_step_done()) is None:
            t += 1
            assert t < 100_000
            if (n := s.poll_draw(t)) is not None:
                first = s.on_prompts_drawn(t, n)
                for gi in range(first, first + n):
                    prompts[gi] = (data.randint(0, 9), data.randint(0, 9))
            for i, e in enumerate(engines):
                for r, version, text, k in list(e.finished(t)):
                    chosen[(r.group, r.sample)] = k
                    s.on_request_finished(t, r, version, len(text), verify(prompts[r.group], text))
                    del where[r]
            while (r := s.poll_abort(t)) is not None:
                engines[where.pop(r)].running.pop(r)  # the engine drops it, then acks
                s.on_abort_acked(t, r)
                totals["aborted_requests"] += 1
            for i, e in enumerate(engines):
                free = e.slots - len(e.running)
                for adm in s.poll_admit_batch(t, free):
                    e.add(t, adm, prompts[adm.request.group], policy.probs(e.weights[0]))
                    where[adm.request] = i
            s.poll_dispatch_batch(t, 64)  # advantages are read when the micro-batch trains
            while (mb := s.poll_micro_batch(t)) is not None:
                p = policy.probs()
                for seq in mb.seqs():
                    gi = s.dispatched_group(seq)
                    rewards = s.group_rewards(gi)
                    mean = sum(rewards) / len(rewards)
                    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
                    assert std > 1e-6, "the core only dispatches groups with reward variance"
                    for sample, r in enumerate(rewards):
                        adv = (r - mean) / (std + 1e-6)
                        k = chosen[(gi, sample)]
                        for j in range(len(OFFSETS)):
                            grad[j] += adv * ((j == k) - p[j])
                        n_samples += 1
                s.on_micro_batch_consumed(t)
                if s.poll_optimizer_step(t) is not None:
                    policy.theta = [th + 0.5 * gr / n_samples for th, gr in zip(policy.theta, grad)]
                    grad, n_samples = [0.0] * len(OFFSETS), 0
                    s.on_optimizer_step_done(t)
            s.audit()
            assert s.counters.is_conserved()
        c = summary.counters
        trained_per_step.append((c.trained, summary.short))
        assert c.drawn == c.trained + c.filtered + c.aborted, "every drawn prompt is counted"
        assert c.in_flight == 0 and all(not e.running for e in engines) and not where
        totals["filtered"] += c.filtered
        totals["trained"] += c.trained
        policy.version += 1
        accuracy.append(policy.probs()[OFFSETS.index(0)])
    return accuracy, totals, trained_per_step


def test_python_step_loop_trains_and_counts_every_prompt():
    accuracy, totals, trained_per_step = run()
    # Every step trains a full batch (a policy near 1.0 would make most groups zero-variance
    # and end batches short at max_groups; 8 steps stop before that).
    assert trained_per_step == [(4, False)] * 8
    assert totals["trained"] == 8 * 4
    assert totals["filtered"] > 0, "all-wrong groups at p=0.2 are filtered and replaced"
    assert totals["aborted_requests"] > 0, "surplus in-flight requests are aborted"
    # GRPO on the real verifier raises the right answer's probability from 1/5.
    assert accuracy[0] == 0.2
    assert all(b > a for a, b in zip(accuracy, accuracy[1:])), accuracy
    assert accuracy[-1] > 0.9, accuracy


def test_python_step_loop_is_deterministic_under_a_seed():
    assert run(steps=3, seed=5) == run(steps=3, seed=5)
