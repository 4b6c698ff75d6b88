//! Cost per request lifecycle (admit, finish with reward, dispatch, micro-batch, with a fifth of
//! the groups filtered and replaced, surplus aborted) over whole steps of B groups x 16 samples:
//! FIFO and frontier admission (pipelined dispatch), frontier admission under Sync dispatch (the
//! frontier is then the whole batch), and a variable-G row (frontier, every scored group held and
//! the varying ones extended 16 -> 24 by an allocation policy). Throughput is in requests, so criterion prints requests/s; the
//! time per request is 1 / that. Time is this thread's CPU time (`/proc/thread-self/schedstat`,
//! wall time where unreadable), so other load on a shared machine does not inflate it. Run:
//! `cargo bench -p rolloutpipe-core --bench core -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rolloutpipe_core::{
    AdmissionPolicy, DispatchPolicy, GroupSlot, RequestSlot, Scheduler, SubmitOrder,
};

#[allow(dead_code)]
#[path = "../tests/support/step.rs"]
mod step;

/// Nanoseconds this thread has run on a CPU, if the kernel exposes it.
fn thread_cpu_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// Times `iters` runs of `f` in thread CPU time (wall time as the fallback).
fn cpu_time(iters: u64, mut f: impl FnMut()) -> Duration {
    let (cpu0, wall0) = (thread_cpu_ns(), Instant::now());
    for _ in 0..iters {
        f();
    }
    match (cpu0, thread_cpu_ns()) {
        // schedstat advances at scheduler ticks on some kernels: a short sample can read zero,
        // which criterion rejects; wall time is the honest fallback for those.
        (Some(a), Some(b)) if b > a => Duration::from_nanos(b - a),
        _ => wall0.elapsed(),
    }
}

fn core_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("core_step");
    group.sample_size(10);
    for b in [64u32, 1024, 16_384, 65_536] {
        let mut groups = vec![GroupSlot::EMPTY; 2 * b as usize];
        // Room for the variable-G row's extensions beyond max_groups x 16.
        let mut requests = vec![RequestSlot::EMPTY; 3 * b as usize * 16];
        let mut s = Scheduler::new(&mut groups, &mut requests);
        let mut id = 0u64;
        let frontier = AdmissionPolicy::Frontier {
            width: 4,
            expected_filter_ppm: 200_000,
            fallback: SubmitOrder::Interleaved,
        };
        let fifo = AdmissionPolicy::Fifo {
            order: SubmitOrder::Interleaved,
        };
        use DispatchPolicy::{Pipelined, Sync};
        for (name, admission, dispatch, hold) in [
            ("fifo", fifo, Pipelined, false),
            ("frontier", frontier, Pipelined, false),
            ("sync_frontier", frontier, Sync, false),
            ("frontier_var_g", frontier, Pipelined, true),
        ] {
            let mut plan = step::plan(b);
            plan.admission = admission;
            plan.dispatch = dispatch;
            plan.hold_scored = hold;
            // Steps are deterministic for a seed: measure the request count once.
            id += 1;
            let requests = step::run_step(&mut s, id, plan, 7).requests;
            group.throughput(Throughput::Elements(requests));
            group.bench_with_input(BenchmarkId::new(name, b), &b, |bench, _| {
                bench.iter_custom(|iters| {
                    cpu_time(iters, || {
                        id += 1;
                        black_box(step::run_step(&mut s, id, plan, 7));
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, core_step);
criterion_main!(benches);
