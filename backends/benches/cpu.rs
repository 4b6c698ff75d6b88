//! Criterion benchmarks of the CPU reference backend.
//!
//! - `cpu_matmul`: `matmul_fwd` GFLOP/s (throughput in elements = floating-point operations, so
//!   criterion's `Melem/s` reads as MFLOP/s) at model-shaped sizes, against this machine's peak
//!   estimate printed at start (cores × 32 f32 flop/cycle for AVX2 FMA × clock from /proc/cpuinfo);
//! - `cpu_generate`: generated tokens/s of the default small model with 1, 16 and 64 concurrent
//!   requests (16-token prompts, 32 new tokens each, prefill included);
//! - `cpu_train`: tokens/s (prompt + response) of one GRPO optimizer step of the small model on
//!   8 sequences of 16 + 48 tokens (forward, backward, AdamW).
//!
//! Run: `cargo bench -p rolloutpipe-backends --no-default-features --bench cpu`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use rolloutpipe_backends::cpu::ops::matmul_fwd;
use rolloutpipe_backends::*;

/// Peak f32 GFLOP/s estimate: cores × 2 FMA units × 8 lanes × 2 flop × clock.
fn peak_gflops() -> (usize, f64, f64) {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mhz = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .unwrap_or(0.0);
    (cores, mhz, cores as f64 * 32.0 * mhz / 1000.0)
}

fn bench_matmul(c: &mut Criterion) {
    let (cores, mhz, peak) = peak_gflops();
    eprintln!(
        "cpu_matmul: peak estimate {peak:.0} GFLOP/s ({cores} cores x 32 flop/cycle x {mhz:.0} MHz)"
    );
    let mut g = c.benchmark_group("cpu_matmul");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    // (rows, in, out): a decode step of 64 requests through the MLP, a training micro-batch
    // through q/gate projections of the small model, and a large square product.
    for (n, din, dout) in [
        (64, 128, 384),
        (512, 128, 384),
        (512, 384, 128),
        (1024, 1024, 1024),
    ] {
        let x: Vec<f32> = (0..n * din)
            .map(|i| ((i % 17) as f32 - 8.0) * 0.01)
            .collect();
        let w: Vec<f32> = (0..dout * din)
            .map(|i| ((i % 13) as f32 - 6.0) * 0.01)
            .collect();
        let mut y = vec![0.0f32; n * dout];
        g.throughput(Throughput::Elements((2 * n * din * dout) as u64));
        g.bench_function(format!("{n}x{din}x{dout}"), |b| {
            b.iter(|| {
                matmul_fwd(
                    black_box(&mut y),
                    black_box(&x),
                    black_box(&w),
                    n,
                    din,
                    dout,
                )
            })
        });
    }
    g.finish();
}

fn small_backend() -> CpuBackend {
    let cfg = ModelConfig::small();
    CpuBackend::new(&cfg, &Weights::random(&cfg, 0).expect("random weights"), 0).expect("backend")
}

fn bench_generate(c: &mut Criterion) {
    let mut be = small_backend();
    let mut g = c.benchmark_group("cpu_generate");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let (prompt_len, new) = (16usize, 32usize);
    for conc in [1usize, 16, 64] {
        g.throughput(Throughput::Elements((conc * new) as u64));
        g.bench_function(format!("{conc}_requests"), |b| {
            let mut next = 0u64;
            b.iter(|| {
                for i in 0..conc {
                    next += 1;
                    let prompt = (0..prompt_len).map(|t| ((t * 7 + i) % 64) as u32).collect();
                    let params = SamplingParams {
                        max_new_tokens: new,
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
                    for o in be.decode_step().expect("step") {
                        tokens += o.tokens.len();
                    }
                }
                assert_eq!(tokens, conc * new);
            })
        });
    }
    g.finish();
}

fn bench_train(c: &mut Criterion) {
    let mut be = small_backend();
    let (seqs, prompt_len, resp_len) = (8usize, 16usize, 48usize);
    let batch = TrainBatch {
        sequences: (0..seqs)
            .map(|s| {
                let p = (0..prompt_len).map(|t| ((t * 5 + s) % 64) as u32).collect();
                let r = (0..resp_len)
                    .map(|t| ((t * 3 + 2 * s) % 64) as u32)
                    .collect();
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
    let mut g = c.benchmark_group("cpu_train");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Elements(
        (seqs * (prompt_len + resp_len)) as u64,
    ));
    g.bench_function("grpo_step_8x64", |b| {
        b.iter(|| {
            be.zero_grad().unwrap();
            be.accumulate(&batch, &Objective::default())
                .expect("accumulate");
            be.optimizer_step(norm, &opt).expect("step")
        })
    });
    g.finish();
}

criterion_group!(benches, bench_matmul, bench_generate, bench_train);
criterion_main!(benches);
