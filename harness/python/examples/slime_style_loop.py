"""A Slime/verl-style RL loop on Ray whose scheduling decisions come from RolloutPipe's core.

    python harness/python/examples/slime_style_loop.py [--steps 6] [--seed 0]

The shape is Slime's ``train.py`` (verl's ``RayPPOTrainer.fit`` is the same loop)::

    for rollout_id in range(num_rollout):
        data = rollout_manager.generate(rollout_id)   # engines are Ray actors
        actor_model.train(rollout_id, data)           # the trainer is a Ray actor
        actor_model.update_weights()                  # trainer -> engines

with one change: *inside* ``generate`` and ``train``, the driver does not decide anything
itself. It reports what happened to ``rolloutpipe.Scheduler`` (prompts drawn, responses
finished with their rewards, aborts done, micro-batches and optimizer steps done) and carries
out what the core decides: which request starts on which engine's free slot (admission),
which surplus requests to abort once the batch is final, and which complete groups go to the
trainer, in FIFO order, in which micro-batch and optimizer step. Groups whose rewards have no
variance are filtered (and replaced by new draws), as Slime's dynamic-sampling filter does.

Engines and trainer are the wheel's own CPU backend (``rolloutpipe.CpuPolicy`` over a seeded
tiny model from ``rolloutpipe.write_tiny_model``); the task is a token-level one a tiny model
can learn: a prompt is two tokens ``a b``, a response earns 1 when its first token's parity
differs from ``a``'s (0 otherwise); responses end at token 0 or after 4 tokens, so they finish
at different times and the requests still running when a batch is final get aborted. Weight
sync is Slime's "update_weights" through Ray's object store: the trainer actor ``ray.put``s
its exported weights once and every engine loads that one object.
"""

import argparse
import math
import os
import random
import struct
import sys
import tempfile

import ray

import rolloutpipe as rp

VOCAB = 11  # write_tiny_model's vocabulary
MAX_NEW_TOKENS = 4
STOP = 0  # a response ends at this token or after MAX_NEW_TOKENS, so lengths vary


@ray.remote
class RolloutEngine:
    """One rollout engine (Slime: an SGLang server): a continuous batch of requests."""

    def __init__(self, model_dir, slots):
        self.policy = rp.CpuPolicy(model_dir)
        self.slots = slots

    def update_weights(self, blob):
        # ``blob`` arrives as the trainer's ObjectRef, fetched from the object store by Ray.
        self.policy.import_weights(blob)

    def generate(self, adds, cancels, decode_steps):
        """Drops ``cancels``, starts ``adds`` (``(key, prompt, seed)``), runs up to
        ``decode_steps`` decode steps of the whole batch; returns ``(key, tokens)`` of each
        response that finished."""
        for key in cancels:
            self.policy.cancel_request(key)
        for key, prompt, seed in adds:
            self.policy.add_request(key, prompt, max_new_tokens=MAX_NEW_TOKENS, seed=seed,
                                    stop_tokens=[STOP])
        for _ in range(decode_steps):
            if self.policy.active_requests == 0:
                break
            self.policy.step()
        return [(f.key, f.tokens) for f in self.policy.take_finished()]


@ray.remote
class TrainActor:
    """The trainer (Slime: the Megatron actor group): GRPO micro-batches and AdamW steps."""

    def __init__(self, model_dir, lr):
        self.policy = rp.CpuPolicy(model_dir)
        self.lr = lr

    def train_micro_batch(self, sequences):
        return self.policy.accumulate(sequences)

    def optimizer_step(self, normalizer):
        grad_norm = self.policy.optimizer_step(normalizer, lr=self.lr)
        self.policy.zero_grad()
        return grad_norm

    def publish_weights(self):
        """Puts the weights in the object store once; returns ``[ObjectRef]`` (in a list, so
        Ray hands the reference back rather than the bytes)."""
        return [ray.put(self.policy.export_weights())]

    def first_token_probs(self, prompts):
        """P(first response token = t) for every t, per prompt (for measuring learning)."""
        pairs = [(p, [t]) for p in prompts for t in range(VOCAB)]
        lps = self.policy.logprobs(pairs)
        return [[math.exp(lps[i * VOCAB + t][0]) for t in range(VOCAB)]
                for i in range(len(prompts))]


def rewarded(prompt, token):
    """Whether a response starting with ``token`` is right for ``prompt``: its parity must
    differ from the prompt's first token's."""
    return token % 2 != prompt[0] % 2


def reward(prompt, tokens):
    """The verifier: 1 for a right response, 0 otherwise (an empty one included)."""
    return 1.0 if tokens and rewarded(prompt, tokens[0]) else 0.0


def correct_mass(probs, prompts):
    """Mean probability the policy puts on a rewarded first token."""
    return sum(sum(p[t] for t in range(VOCAB) if rewarded(q, t))
               for p, q in zip(probs, prompts)) / len(prompts)


def run(model_dir, steps=6, batch_groups=4, group_size=4, engines=2, slots=4, seed=0,
        lr=1e-1, decode_steps=1):
    """Runs the loop; returns what happened: per-step counters (as dicts), per-step grad
    norms, the probability mass on rewarded first tokens before and after, and the weights
    before and after."""
    data = random.Random(seed)
    engine_actors = [RolloutEngine.options(num_cpus=1).remote(model_dir, slots)
                     for _ in range(engines)]
    trainer = TrainActor.options(num_cpus=1).remote(model_dir, lr)
    probe = [[1 + data.randrange(VOCAB - 1), 1 + data.randrange(VOCAB - 1)] for _ in range(16)]
    first_weights = ray.get(ray.get(trainer.publish_weights.remote())[0])
    mass_before = correct_mass(ray.get(trainer.first_token_probs.remote(probe)), probe)

    s = rp.Scheduler(groups=8 * batch_groups, requests=8 * batch_groups * group_size * 4)
    # Slime's shape: FIFO admission, the batch goes to the trainer once final (dispatch "sync"),
    # one optimizer step per rollout; zero-variance groups are filtered and replaced (up to
    # max_groups drawn per step).
    plan = rp.Plan(batch_groups, group_size, micro_batch=2, opt_steps=1,
                   slots=engines * slots, admission="fifo", dispatch="sync",
                   max_groups=8 * batch_groups)
    t, version, key = 0, 0, 0
    counters, grad_norms = [], []
    for step in range(steps):
        # update_weights: one put by the trainer, one get per engine.
        ref = ray.get(trainer.publish_weights.remote())[0]
        ray.get([e.update_weights.remote(ref) for e in engine_actors])
        s.begin_step(t, step, version, plan)
        prompts, responses = {}, {}  # group -> prompt; (group, sample) -> accepted tokens
        running = {}  # key -> (engine, RequestId, version)
        keys = {}  # RequestId -> key
        on_engine = [0] * engines
        cancels = [[] for _ in range(engines)]
        tokens_in_opt_step = 0
        while (summary := s.poll_step_done()) is None:
            t += 1
            if t > 1_000_000:
                raise RuntimeError("the loop made no progress")
            # generate(): draws, aborts and admissions as the core decides them.
            while (n := s.poll_draw(t)) is not None:
                first = s.on_prompts_drawn(t, n)
                for g in range(first, first + n):
                    prompts[g] = [1 + data.randrange(VOCAB - 1), 1 + data.randrange(VOCAB - 1)]
            aborted = []
            for rid in s.poll_abort_batch(t, 1024):
                k = keys.pop(rid)
                e, _, _ = running.pop(k)
                cancels[e].append(k)
                on_engine[e] -= 1
                aborted.append(rid)
            adds = [[] for _ in range(engines)]
            for e in range(engines):
                for adm in s.poll_admit_batch(t, slots - on_engine[e]):
                    r = adm.request
                    key += 1
                    running[key] = (e, r, adm.version)
                    keys[r] = key
                    on_engine[e] += 1
                    # A pure function of the request: a retried attempt samples anew.
                    sample_seed = hash((seed, r.step, r.group, r.sample, r.attempt)) & 0xFFFFFFFF
                    adds[e].append((key, prompts[r.group], sample_seed))
            calls = [(e, engine_actors[e].generate.remote(adds[e], cancels[e], decode_steps))
                     for e in range(engines) if adds[e] or cancels[e] or on_engine[e]]
            cancels = [[] for _ in range(engines)]
            for e, call in calls:
                for k, toks in ray.get(call):
                    _, rid, v = running.pop(k)
                    del keys[rid]
                    on_engine[e] -= 1
                    done = s.on_request_finished(t, rid, v, len(toks),
                                                 reward(prompts[rid.group], toks))
                    if done.accepted:
                        responses[(rid.group, rid.sample)] = toks
            for rid in aborted:  # the engines dropped them in this round's calls
                s.on_abort_acked(t, rid)
            # train(): complete groups in the core's FIFO order, micro-batches as it cuts them.
            s.poll_dispatch_batch(t, 1024)
            while (mb := s.poll_micro_batch(t)) is not None:
                seqs = []
                for seq in mb.seqs():
                    g = s.dispatched_group(seq)
                    rewards = s.group_rewards(g)
                    mean = sum(rewards) / len(rewards)
                    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
                    for i, r in enumerate(rewards):
                        resp = responses[(g, i)]
                        seqs.append((prompts[g], resp, (r - mean) / (std + 1e-6)))
                        tokens_in_opt_step += len(resp)
                ray.get(trainer.train_micro_batch.remote(seqs))
                s.on_micro_batch_consumed(t)
                if s.poll_optimizer_step(t) is not None:
                    grad_norms.append(ray.get(
                        trainer.optimizer_step.remote(float(max(tokens_in_opt_step, 1)))))
                    tokens_in_opt_step = 0
                    s.on_optimizer_step_done(t)
            s.audit()
        if running:
            raise RuntimeError(f"step {step} ended with {len(running)} requests on engines")
        counters.append(summary.counters.to_dict())
        version += 1
    last_weights = ray.get(ray.get(trainer.publish_weights.remote())[0])
    mass_after = correct_mass(ray.get(trainer.first_token_probs.remote(probe)), probe)
    for a in engine_actors + [trainer]:
        ray.kill(a)
    return {"counters": counters, "grad_norms": grad_norms, "mass_before": mass_before,
            "mass_after": mass_after, "weights_before": first_weights,
            "weights_after": last_weights}


def max_weight_change(a, b):
    """Largest absolute difference between two same-layout safetensors blobs (F32)."""
    n = struct.unpack("<Q", a[:8])[0]
    xa, xb = a[8 + n:], b[8 + n:]
    fa = struct.unpack(f"<{len(xa) // 4}f", xa)
    fb = struct.unpack(f"<{len(xb) // 4}f", xb)
    return max(abs(p - q) for p, q in zip(fa, fb))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from rolloutpipe import ray as rp_ray

    rp_ray.start_ray(num_cpus=max(os.cpu_count() or 1, 3))
    with tempfile.TemporaryDirectory() as d:
        rp.write_tiny_model(os.path.join(d, "model"), seed=a.seed)
        r = run(os.path.join(d, "model"), steps=a.steps, seed=a.seed)
    for i, c in enumerate(r["counters"]):
        print(f"step {i}: drawn {c['drawn']} trained {c['trained']} filtered "
              f"{c['filtered_zero_variance']} aborted {c['aborted']} "
              f"(requests aborted {c['requests_aborted']})")
    print(f"P(rewarded first token): {r['mass_before']:.3f} -> {r['mass_after']:.3f}; "
          f"largest weight change {max_weight_change(r['weights_before'], r['weights_after']):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
