//! Simulator speed: one (profile, setting, mode) run per benchmark, reported as simulated
//! events per second. `rolloutpipe simulate --bench` times all twelve settings in all modes.
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rolloutpipe_harness::sim::config::{Mode, SimConfig};
use rolloutpipe_harness::sim::simulate;

fn sim(c: &mut Criterion) {
    let cfg = SimConfig::defaults().expect("embedded defaults are valid");
    let mut group = c.benchmark_group("sim");
    group.sample_size(10);
    for (profile, setting) in [("gsm8k", "R1"), ("math", "R2"), ("logic", "R3")] {
        for mode in [Mode::Sync, Mode::Rolloutpipe, Mode::OneStepOff] {
            let events = simulate(&cfg, profile, setting, mode, false)
                .expect("simulation runs")
                .result
                .events;
            group.throughput(Throughput::Elements(events));
            group.bench_function(format!("sim_{profile}_{setting}_{mode}"), |b| {
                b.iter(|| simulate(&cfg, profile, setting, mode, false).expect("simulation runs"))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, sim);
criterion_main!(benches);
