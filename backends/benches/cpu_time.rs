//! Throughput per CPU-second of the CPU backend, next to wall-clock throughput.
//!
//! The development machine's two cores are shared, so wall-clock numbers (criterion's, in
//! `benches/cpu.rs`) swing with the load of other processes; CPU time consumed by this process
//! (user + system, from `/proc/self/stat`) does not, and says how efficient the code itself is.
//! Busy-waiting rayon workers count as CPU time, so parallel overhead is not hidden.
//!
//! Run: `cargo bench -p rolloutpipe-backends --no-default-features --bench cpu_time [-- FILTER]`
//! (FILTER: `matmul`, `generate` or `train` runs only those lines).

use std::time::Instant;

use rolloutpipe_backends::cpu::ops::matmul_fwd;
use rolloutpipe_backends::*;

/// CPU seconds (user + system) of this process so far; `None` off Linux.
fn cpu_secs() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let f: Vec<&str> = s.rsplit(')').next()?.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on every Linux configuration that Rust supports.
    Some(ticks / 100.0)
}

/// Runs `f` (which returns the work units it did) until at least `secs` of wall time have
/// passed; returns (units per wall second, units per CPU second).
fn measure(secs: f64, mut f: impl FnMut() -> f64) -> (f64, Option<f64>) {
    f(); // warm-up: page in buffers, spawn threads
    let (t0, c0) = (Instant::now(), cpu_secs());
    let mut units = 0.0;
    while t0.elapsed().as_secs_f64() < secs {
        units += f();
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = c0.zip(cpu_secs()).map(|(a, b)| b - a).filter(|c| *c > 0.0);
    (units / wall, cpu.map(|c| units / c))
}

fn show(name: &str, unit: &str, (wall, cpu): (f64, Option<f64>)) {
    match cpu {
        Some(c) => println!("{name:<28} {wall:>12.1} {unit}/s wall {c:>12.1} {unit}/cpu-s"),
        None => println!("{name:<28} {wall:>12.1} {unit}/s wall"),
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` probes every bench binary
    }
    // cargo passes `--bench`; the first other argument filters the groups.
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_default();
    let on = |group: &str| group.contains(filter.as_str());
    for (n, din, dout) in [
        (1usize, 128usize, 384usize),
        (64, 128, 384),
        (512, 128, 384),
        (1024, 1024, 1024),
    ] {
        let x: Vec<f32> = (0..n * din)
            .map(|i| ((i % 17) as f32 - 8.0) * 0.01)
            .collect();
        let w: Vec<f32> = (0..dout * din)
            .map(|i| ((i % 13) as f32 - 6.0) * 0.01)
            .collect();
        if !on("matmul") {
            continue;
        }
        let mut y = vec![0.0f32; n * dout];
        let r = measure(1.0, || {
            matmul_fwd(&mut y, &x, &w, n, din, dout);
            2.0 * (n * din * dout) as f64 / 1e9
        });
        show(&format!("matmul {n}x{din}x{dout}"), "GFLOP", r);
    }
    let cfg = ModelConfig::small();
    let w = Weights::random(&cfg, 0).expect("random weights");
    for threads in [1usize, 2] {
        let mut be = CpuBackend::new(&cfg, &w, threads).expect("backend");
        for conc in [1usize, 16, 64] {
            if !on("generate") {
                continue;
            }
            let mut next = 0u64;
            let r = measure(2.0, || {
                for i in 0..conc {
                    next += 1;
                    let prompt = (0..16).map(|t| ((t * 7 + i) % 64) as u32).collect();
                    let params = SamplingParams {
                        max_new_tokens: 32,
                        seed: next,
                        ..Default::default()
                    };
                    be.add_request(GenRequest {
                        id: RequestKey(next),
                        prompt,
                        params,
                    })
                    .expect("add");
                }
                let mut tokens = 0;
                while be.active_requests() > 0 {
                    tokens += be
                        .decode_step()
                        .expect("step")
                        .iter()
                        .map(|o| o.tokens.len())
                        .sum::<usize>();
                }
                tokens as f64
            });
            show(&format!("generate {conc:>2} req, {threads} thr"), "tok", r);
        }
        if !on("train") {
            continue;
        }
        let batch = TrainBatch {
            sequences: (0..8)
                .map(|s| {
                    let p = (0..16).map(|t| ((t * 5 + s) % 64) as u32).collect();
                    let r = (0..48).map(|t| ((t * 3 + 2 * s) % 64) as u32).collect();
                    TrainSequence::new(
                        p,
                        r,
                        if s % 2 == 0 { 1.0 } else { -1.0 },
                        Aggregation::TokenMean,
                    )
                })
                .collect(),
        };
        let norm = normalizer(Aggregation::TokenMean, std::slice::from_ref(&batch));
        let opt = AdamW {
            lr: 1e-4,
            ..Default::default()
        };
        let r = measure(2.0, || {
            be.zero_grad().unwrap();
            be.accumulate(&batch, &Objective::default())
                .expect("accumulate");
            be.optimizer_step(norm, &opt).expect("step");
            (8 * 64) as f64
        });
        show(&format!("train 8x64 tok, {threads} thr"), "tok", r);
    }
}
