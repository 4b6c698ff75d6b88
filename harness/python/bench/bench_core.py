"""Scheduler round-trips per second from Python: one whole request lifecycle (admit, finish with
a reward) per round-trip, single polls against batch polls, over full steps of B groups x G
samples with dispatch, micro-batches and optimizer steps answered. Prints a Markdown table.

    python bench/bench_core.py [--groups 256] [--group-size 16] [--repeats 5]
"""

import argparse
import time

import rolloutpipe as rp


def one_step(s, step, b, g, batch):
    s.begin_step(0, step, step, rp.Plan(b, g, micro_batch=4, slots=4 * g, admission="frontier"))
    t = 0
    while s.poll_step_done() is None:
        t += 1
        if (n := s.poll_draw(t)) is not None:
            s.on_prompts_drawn(t, n)
        adms = s.poll_admit_batch(t, 4 * g) if batch else iter(lambda: s.poll_admit(t), None)
        for a in adms:
            r = a.request
            s.on_request_finished(t, r, a.version, 8, float((r.sample + r.group) % 2))
        while (ab := s.poll_abort(t)) is not None:
            s.on_abort_acked(t, ab)
        if batch:
            s.poll_dispatch_batch(t, 1 << 16)
        else:
            while s.poll_dispatch(t) is not None:
                pass
        while s.poll_micro_batch(t) is not None:
            s.on_micro_batch_consumed(t)
            if s.poll_optimizer_step(t) is not None:
                s.on_optimizer_step_done(t)
    return s.counters.requests_admitted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    s = rp.Scheduler(2 * a.groups, 2 * a.groups * a.group_size)
    print(f"B = {a.groups}, G = {a.group_size}, best of {a.repeats} steps\n")
    print("| polls | requests/step | best step (ms) | round-trips/s | us/round-trip |")
    print("|---|---|---|---|---|")
    step = 0
    for batch in (False, True):
        best, reqs = float("inf"), 0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            reqs = one_step(s, step, a.groups, a.group_size, batch)
            best = min(best, time.perf_counter() - t0)
            step += 1
        print(f"| {'batch' if batch else 'single'} | {reqs} | {best * 1e3:.1f} | "
              f"{reqs / best:,.0f} | {best / reqs * 1e6:.2f} |")


if __name__ == "__main__":
    main()
