//! Criterion benchmarks of the wgpu backend, on whatever adapter wgpu picks (lavapipe on a
//! CPU-only machine; `WGPU_BACKEND` / `WGPU_ADAPTER_NAME` choose another).
//!
//! - `wgpu_<op>`: per-kernel throughput. Throughput is set in elements = floating-point
//!   operations for the matrix products and attention (criterion's `Gelem/s` reads as
//!   GFLOP/s) and in bytes moved for the memory-bound ops (GB/s). Each sample records a
//!   batch of launches into one submission and waits for the device before the clock stops.
//! - `wgpu_attention_decode/RxP_..`: generation's attention over the paged KV pool, R rows
//!   at position P - 1 (the last steps of the two generation cases below).
//! - `wgpu_generate/{wgpu,cpu}/N`: generated tokens/s of the default small model with N
//!   concurrent requests (16-token prompts, 32 new tokens, prefill included), the same
//!   workload as `cpu_generate`, with the CPU backend measured in the same run;
//!   `wgpu_generate/wgpu_bf16/N` is the same model as a bf16-storage wgpu engine,
//!   `wgpu_generate/wgpu_lookahead/N` the f32 engine with look-ahead decoding;
//!   `wgpu_generate/wgpu_group/8` is one group of 8 samples of a 64-token prompt
//!   (`add_group`: the samples share the prompt's KV pages), 32 new tokens each.
//! - `wgpu_train/{wgpu,cpu}`: tokens/s (prompt + response) of one GRPO optimizer step on
//!   8 sequences of 16 + 48 tokens (forward, backward, AdamW), as `cpu_train`.
//!
//! - `scalar_` variants of `wgpu_matmul` and `wgpu_matmul_bwd`: the same GEMMs staging one
//!   value at a time (`Exec::force_scalar_loads`), against the default vector loads.
//! - `tc` variants, where the adapter has tensor cores (cooperative matrices;
//!   `WgpuBackend::set_tensor_cores`): `wgpu_matmul/tc_<shape>`, `wgpu_matmul_bwd/tc_<shape>`,
//!   `wgpu_generate/wgpu_bf16_tc/N`, `wgpu_train/wgpu_tc/..` (forward and backward products on
//!   tensor cores), `wgpu_e2e_*/generate/bf16_tc` and `train/f32_tc`. On lavapipe
//!   the cooperative matrices are emulated in scalar code, so there they measure only that
//!   the path runs; the speed-up is a GPU's (`scripts/device/wgpu.sh`).
//! - `wgpu_e2e_{0.6b,1.7b}/{generate,train}/<dtype>` (prod shapes only, see `bench_e2e`):
//!   generate (8 × 64-token prompts, 32 new tokens; `f32_ahead`: the f32 engine with
//!   look-ahead decoding) and a GRPO train step (4 × 128 tokens)
//!   at Qwen3-0.6B and 1.7B shapes with random weights; `scripts/device/torch_e2e.py` runs
//!   the same workloads in PyTorch.
//!
//! Run: `cargo bench -p rolloutpipe-backends --features wgpu --bench wgpu`. With
//! `ROLLOUTPIPE_BENCH_SHAPES=prod` the matrix products also run at Qwen3-0.6B and 1.7B shapes,
//! and the `wgpu_e2e_*` groups run (for a real GPU: `scripts/device/wgpu.sh`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use rolloutpipe_backends::engine::{KvStore, Paged};
use rolloutpipe_backends::wgpu::kv::{self, KvPool, StepRows};
use rolloutpipe_backends::wgpu::{Exec, Gpu, WgpuBackend, ops};
use rolloutpipe_backends::*;

fn gpu() -> Option<Arc<Gpu>> {
    match Gpu::new() {
        Ok(Some(g)) => {
            let i = g.adapter_info();
            eprintln!(
                "wgpu adapter: {} ({:?}, {})",
                i.name, i.backend, i.driver_info
            );
            Some(g)
        }
        Ok(None) => {
            eprintln!("SKIP: no wgpu adapter; the wgpu benchmarks did not run");
            None
        }
        Err(e) => {
            eprintln!("SKIP: wgpu device creation failed: {e}");
            None
        }
    }
}

/// A recorder whose forward products run on tensor cores, where the adapter has them (the
/// `tc_` benchmarks); `None`, after saying why, where it has none.
fn tensor_core_exec(g: &Arc<Gpu>) -> Option<Exec> {
    let mut ex = Exec::new(Arc::clone(g));
    match ex.set_tensor_cores(true) {
        Ok(()) => Some(ex),
        Err(e) => {
            eprintln!("SKIP: the tensor-core (tc) benchmarks: {e}");
            None
        }
    }
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) * 0.01)
        .collect()
}

/// Times `iters` launches recorded by `launch`, submitted in batches of 32 (each submission
/// waits for the device, so the clock includes all the GPU work).
fn timed(ex: &mut Exec, iters: u64, mut launch: impl FnMut(&mut Exec)) -> Duration {
    let t = Instant::now();
    let mut left = iters;
    while left > 0 {
        let k = left.min(32);
        for _ in 0..k {
            launch(ex);
        }
        ex.submit().expect("submission");
        left -= k;
    }
    t.elapsed()
}

/// Whether `ROLLOUTPIPE_BENCH_SHAPES=prod` is set: production shapes on top of the small ones.
fn prod() -> bool {
    std::env::var("ROLLOUTPIPE_BENCH_SHAPES").as_deref() == Ok("prod")
}

/// With `ROLLOUTPIPE_BENCH_SHAPES=prod` (set by `scripts/device/wgpu.sh`): the projections of
/// Qwen3-0.6B (hidden 1024, MLP 3072) and Qwen3-1.7B (hidden 2048, MLP 6144) as
/// `(rows, in, out)`, for a decode step of 8 rows and a 512-token prefill or training chunk.
fn prod_matmuls() -> Vec<(usize, usize, usize)> {
    if !prod() {
        return Vec::new();
    }
    let mut v = Vec::new();
    for (d, f) in [(1024, 3072), (2048, 6144)] {
        for n in [8, 512] {
            v.push((n, d, f));
            v.push((n, f, d));
        }
    }
    v
}

fn bench_ops(c: &mut Criterion, g: &Arc<Gpu>) {
    let mut ex = Exec::new(Arc::clone(g));
    // The same GEMMs with one-value-at-a-time staging (`scalar_*`): the path before vector
    // loads, kept for shapes whose K is not a multiple of 4, side by side with the default.
    let mut scalar = Exec::new(Arc::clone(g));
    scalar.force_scalar_loads(true);
    let mut tc = tensor_core_exec(g);
    let mut grp = c.benchmark_group("wgpu_matmul");
    grp.sample_size(10);
    let mut shapes = vec![
        (8, 128, 384),
        (64, 128, 384),
        (512, 128, 384),
        (512, 384, 128),
        (1024, 1024, 1024),
    ];
    shapes.extend(prod_matmuls());
    for (n, din, dout) in shapes {
        let (x, w, y) = (
            g.upload("x", &data(n * din, 1)),
            g.upload("w", &data(dout * din, 2)),
            g.buffer("y", n * dout),
        );
        grp.throughput(Throughput::Elements((2 * n * din * dout) as u64));
        grp.bench_function(format!("{n}x{din}x{dout}"), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    ops::matmul_fwd(ex, &y, &x, &w, n, din, dout, false)
                })
            })
        });
        grp.bench_function(format!("scalar_{n}x{din}x{dout}"), |b| {
            b.iter_custom(|it| {
                timed(&mut scalar, it, |ex| {
                    ops::matmul_fwd(ex, &y, &x, &w, n, din, dout, false)
                })
            })
        });
        // The same product on tensor cores (matmul_fwd_coop), where the adapter has them.
        if let Some(tc) = tc.as_mut() {
            grp.bench_function(format!("tc_{n}x{din}x{dout}"), |b| {
                b.iter_custom(|it| {
                    timed(tc, it, |ex| {
                        ops::matmul_fwd(ex, &y, &x, &w, n, din, dout, false)
                    })
                })
            });
        }
    }
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_matmul_bwd");
    grp.sample_size(10);
    let mut shapes = vec![(512, 128, 384), (1024, 1024, 1024)];
    shapes.extend(prod_matmuls().into_iter().filter(|s| s.0 > 8));
    for (n, din, dout) in shapes {
        let (x, w, dy) = (
            g.upload("x", &data(n * din, 1)),
            g.upload("w", &data(dout * din, 2)),
            g.upload("dy", &data(n * dout, 3)),
        );
        let (dx, dw) = (g.buffer("dx", n * din), g.buffer("dw", dout * din));
        // dx and dw: two products of the forward's size.
        grp.throughput(Throughput::Elements((4 * n * din * dout) as u64));
        grp.bench_function(format!("{n}x{din}x{dout}"), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    ops::matmul_bwd(ex, Some((&dx, false)), &dw, &dy, &x, &w, n, din, dout)
                })
            })
        });
        grp.bench_function(format!("scalar_{n}x{din}x{dout}"), |b| {
            b.iter_custom(|it| {
                timed(&mut scalar, it, |ex| {
                    ops::matmul_bwd(ex, Some((&dx, false)), &dw, &dy, &x, &w, n, din, dout)
                })
            })
        });
        // The same products on tensor cores (matmul_bwd_coop: the |dy| maxima, dx, dW).
        if let Some(tc) = tc.as_mut() {
            grp.bench_function(format!("tc_{n}x{din}x{dout}"), |b| {
                b.iter_custom(|it| {
                    timed(tc, it, |ex| {
                        ops::matmul_bwd(ex, Some((&dx, false)), &dw, &dy, &x, &w, n, din, dout)
                    })
                })
            });
        }
    }
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_rmsnorm_fwd");
    grp.sample_size(10);
    let (rows, d) = (4096, 128);
    let (x, w, out, rstd) = (
        g.upload("x", &data(rows * d, 4)),
        g.upload("w", &data(d, 5)),
        g.buffer("out", rows * d),
        g.buffer("rstd", rows),
    );
    // Reads x and writes out: 8 bytes per element.
    grp.throughput(Throughput::Bytes((8 * rows * d) as u64));
    grp.bench_function(format!("{rows}x{d}"), |b| {
        b.iter_custom(|it| {
            timed(&mut ex, it, |ex| {
                ops::rmsnorm_fwd(ex, &out, &rstd, &x, &w, rows, d, 1e-6)
            })
        })
    });
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_rmsnorm_bwd");
    grp.sample_size(10);
    // The small model's 512-token training chunk (hidden 128), its per-head q_norm
    // (512 tokens x 4 heads of 32) and a Qwen3-0.6B-wide row (hidden 1024).
    for (rows, d) in [(512usize, 128usize), (2048, 32), (512, 1024)] {
        let (x, w, rstd, dout) = (
            g.upload("x", &data(rows * d, 4)),
            g.upload("w", &data(d, 5)),
            g.upload("rstd", &vec![1.5f32; rows]),
            g.upload("dout", &data(rows * d, 6)),
        );
        let (dx, dw) = (g.buffer("dx", rows * d), g.buffer("dw", d));
        let part = g.buffer("dw partials", ops::rmsnorm_dw_scratch(rows, d));
        // Reads x and dout twice (dx, then dw), writes dx: 20 bytes per element.
        grp.throughput(Throughput::Bytes((20 * rows * d) as u64));
        grp.bench_function(format!("{rows}x{d}"), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    ops::rmsnorm_bwd(ex, &dx, &dw, &part, &dout, &x, &w, &rstd, rows, d, false)
                })
            })
        });
    }
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_embedding_bwd");
    grp.sample_size(10);
    // 512 training tokens of the small model (vocabulary 64: every row repeats ~8 times),
    // and of a 1024-wide model over 4096 vocabulary rows (each touched row once).
    for (n, d, vocab) in [(512usize, 128usize, 64usize), (512, 1024, 4096)] {
        let ids: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let (dout, dtable) = (
            g.upload("dout", &data(n * d, 7)),
            g.buffer("dtable", vocab * d),
        );
        let (grb, orb) = (
            g.buffer("starts", ops::ScatterIndex::starts_len(n)),
            g.buffer("pairs", ops::ScatterIndex::pairs_len(n)),
        );
        // Reads dout, reads and writes the touched table rows: ≤ 12 bytes per element.
        grp.throughput(Throughput::Bytes((12 * n * d) as u64));
        grp.bench_function(format!("{n}x{d}_v{vocab}"), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    // The host-side grouping and its upload count: the backend does both
                    // on every backward.
                    let ix = ops::ScatterIndex::new(&ids, vocab);
                    g.write(&grb, &ix.starts);
                    g.write(&orb, &ix.pairs);
                    ops::embedding_bwd(ex, &dtable, &dout, &grb, &orb, ix.touched(), d, vocab)
                })
            })
        });
    }
    grp.finish();

    // Training/scoring attention over packed sequences: the small model's 8 sequences of
    // 64 tokens (4 heads, 2 kv heads, head_dim 32) and the 0.6B shape on 2 sequences of 256
    // (16 heads, 8 kv heads, head_dim 128).
    let shapes = [
        (8usize, 64usize, 4usize, 2usize, 32usize),
        (2, 256, 16, 8, 128),
    ];
    for bwd in [false, true] {
        let name = if bwd {
            "wgpu_attention_bwd"
        } else {
            "wgpu_attention_fwd"
        };
        let mut grp = c.benchmark_group(name);
        grp.sample_size(10);
        for (seqs, t, h, kvh, hd) in shapes {
            let n = seqs * t;
            let (q, k, v, dout) = (
                g.upload("q", &data(n * h * hd, 6)),
                g.upload("k", &data(n * kvh * hd, 7)),
                g.upload("v", &data(n * kvh * hd, 8)),
                g.upload("dout", &data(n * h * hd, 9)),
            );
            let meta: Vec<u32> = (0..n)
                .flat_map(|r| [(r / t * t) as u32, (r % t) as u32])
                .collect();
            let rows: Vec<u32> = (0..n)
                .flat_map(|r| [(r / t * t) as u32, t as u32])
                .collect();
            let (qm, rm, out, st) = (
                g.upload("qmeta", &meta),
                g.upload("rowmeta", &rows),
                g.buffer("out", n * h * hd),
                g.buffer("stats", 2 * n * h),
            );
            let (dq, dkv) = (
                g.buffer("dq", n * h * hd),
                g.buffer("dkv", 2 * n * kvh * hd),
            );
            ops::attention_fwd(&mut ex, &out, &st, &q, &k, &v, &qm, n, n, h, kvh, hd);
            // Causal: t(t+1)/2 query-key pairs per sequence and head, 4·hd flops each
            // forward (q·k and p·v), 8·hd backward (q·k, dout·v, dq, dk, dv counted once).
            let per = if bwd { 8 } else { 4 };
            grp.throughput(Throughput::Elements(
                (seqs * h * t * (t + 1) / 2 * per * hd) as u64,
            ));
            grp.bench_function(format!("{seqs}x{t}_h{h}_kv{kvh}_hd{hd}"), |b| {
                b.iter_custom(|it| {
                    timed(&mut ex, it, |ex| {
                        if bwd {
                            let (o, s) = (&out, &st);
                            ops::attention_bwd(
                                ex, &dq, &dkv, s, &dout, &q, &k, &v, o, &rm, n, h, kvh, hd,
                            )
                        } else {
                            ops::attention_fwd(ex, &out, &st, &q, &k, &v, &qm, n, n, h, kvh, hd)
                        }
                    })
                })
            });
        }
        grp.finish();
    }

    // Generation's attention over the paged KV pool at the last step of
    // `wgpu_generate/wgpu/16` (16 rows at position 47) and of `wgpu_generate/wgpu_group/8`
    // (8 rows at position 95), each row on its own pages (the small model's shape).
    let mut grp = c.benchmark_group("wgpu_attention_decode");
    grp.sample_size(10);
    let cfg = ModelConfig::small();
    let (h, hd) = (cfg.num_attention_heads, cfg.head_dim);
    for (rows_n, pos) in [(16usize, 47usize), (8, 95)] {
        let per = kv::pages_for(pos + 1);
        let mut store = Paged::new(kv::device_pages(g, &cfg));
        store.alloc(rows_n * per).expect("pages");
        let mut pool = KvPool::default();
        pool.ensure_built(g, &mut ex, &cfg, store.pages_used(), store.max_pages());
        let pages: Vec<u32> = (0..(rows_n * per) as u32).collect();
        let meta: Vec<u32> = (0..rows_n)
            .flat_map(|r| [(r * per) as u32, pos as u32])
            .collect();
        let (q, k, v) = (
            g.upload("q", &data(rows_n * cfg.q_dim(), 9)),
            g.upload("k", &data(rows_n * cfg.kv_dim(), 10)),
            g.upload("v", &data(rows_n * cfg.kv_dim(), 11)),
        );
        let (mb, pb, out) = (
            g.upload("meta", &meta),
            g.upload("pages", &pages),
            g.buffer("out", rows_n * cfg.q_dim()),
        );
        let state = g.buffer("state", 2 * rows_n * h);
        let rows = StepRows {
            q: &q,
            out: &out,
            state: &state,
            k: &k,
            v: &v,
            meta: &mb,
            pages: &pb,
            n: rows_n,
            pages_len: pages.len(),
            max_pos: pos,
        };
        // 4·hd flops per (row, head, key): q·k and p·v.
        grp.throughput(Throughput::Elements(
            (rows_n * h * (pos + 1) * 4 * hd) as u64,
        ));
        grp.bench_function(format!("{rows_n}x{}_h{h}_hd{hd}", pos + 1), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    rows.attention_decode(ex, &pool, 0, &cfg).expect("decode")
                })
            })
        });
    }
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_logprob_fwd");
    grp.sample_size(10);
    for (rows, vocab) in [(512usize, 64usize), (64, 151_936)] {
        let (z, tg) = (
            g.upload("logits", &data(rows * vocab, 9)),
            g.upload("targets", &vec![1u32; rows]),
        );
        let (lp, en, lse) = (
            g.buffer("logp", rows),
            g.buffer("entropy", rows),
            g.buffer("lse", rows),
        );
        let st = g.buffer("state", 4 * rows);
        let out = ops::LogprobBufs {
            state: &st,
            logp: &lp,
            entropy: &en,
            lse: &lse,
        };
        // One vocabulary chunk of the fused lm_head (all of it here), folded and finished:
        // two passes over the logits.
        let c = ops::VocabChunk {
            row0: 0,
            rows,
            v0: 0,
            cols: vocab,
        };
        grp.throughput(Throughput::Bytes((8 * rows * vocab) as u64));
        grp.bench_function(format!("{rows}x{vocab}"), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    ops::logprob_fwd(ex, out, &z, &tg, c, true, 1.0);
                    ops::logprob_fwd_finish(ex, out, 0, rows);
                })
            })
        });
    }
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_sample");
    grp.sample_size(10);
    for (rows, vocab, top_k, top_p) in [
        (64usize, 64usize, 0usize, 1.0f32),
        (64, 64, 8, 1.0),
        (16, 151_936, 0, 1.0),
        (16, 151_936, 50, 1.0),
        (16, 151_936, 50, 0.9),
    ] {
        let z = g.upload("logits", &data(rows * vocab, 10));
        let rowp: Vec<f32> = (0..rows)
            .flat_map(|r| {
                rolloutpipe_backends::model::sampling::sample_row(
                    1.0,
                    top_k,
                    top_p,
                    (r as f64 + 0.5) / rows as f64,
                )
            })
            .collect();
        let (rp, tk, lp) = (
            g.upload("rowp", &rowp),
            g.buffer("tokens", rows),
            g.buffer("logp", rows),
        );
        // Rows sampled per second (reported as elements).
        grp.throughput(Throughput::Elements(rows as u64));
        grp.bench_function(format!("{rows}x{vocab}_topk{top_k}_topp{top_p}"), |b| {
            b.iter_custom(|it| {
                timed(&mut ex, it, |ex| {
                    ops::sample(ex, &tk, &lp, &z, &rp, rows, vocab)
                })
            })
        });
    }
    grp.finish();

    let mut grp = c.benchmark_group("wgpu_adamw_step");
    grp.sample_size(10);
    let nparam = 1 << 20;
    let (p, gr, m, v) = (
        g.upload("p", &data(nparam, 11)),
        g.upload("g", &data(nparam, 12)),
        g.buffer("m", nparam),
        g.buffer("v", nparam),
    );
    let s = ops::AdamScalars::new(1.0, 1e-4, 0.9, 0.999, 1e-8, 0.01, 1);
    // Reads p, g, m, v; writes p, m, v: 28 bytes per parameter.
    grp.throughput(Throughput::Bytes((28 * nparam) as u64));
    grp.bench_function("1M", |b| {
        b.iter_custom(|it| {
            timed(&mut ex, it, |ex| {
                ops::adamw_step(ex, &p, &gr, &m, &v, nparam, s)
            })
        })
    });
    grp.finish();
}

fn small(g: &Arc<Gpu>) -> (Box<dyn Policy>, Box<dyn Policy>) {
    let cfg = ModelConfig::small();
    let w = Weights::random(&cfg, 0).expect("random weights");
    let gpu = WgpuBackend::with_gpu(Arc::clone(g), &cfg, &w).expect("wgpu backend");
    let cpu = CpuBackend::new(&cfg, &w, 0).expect("cpu backend");
    (Box::new(gpu), Box::new(cpu))
}

fn generate(be: &mut dyn Policy, conc: usize, next: &mut u64) {
    generate_n(be, conc, 16, 32, 64, next)
}

/// `conc` requests of `prompt_len`-token prompts (ids below `vocab`), `new` tokens each,
/// decoded to the end.
fn generate_n(
    be: &mut dyn Policy,
    conc: usize,
    prompt_len: usize,
    new: usize,
    vocab: usize,
    next: &mut u64,
) {
    for i in 0..conc {
        *next += 1;
        let prompt = (0..prompt_len)
            .map(|t| ((t * 7 + i) % vocab) as u32)
            .collect();
        let params = SamplingParams {
            max_new_tokens: new,
            seed: *next,
            ..Default::default()
        };
        be.add_request(GenRequest {
            id: RequestKey(*next),
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
}

/// One group of `samples` samples of a 64-token prompt, 32 new tokens each.
fn generate_group(be: &mut dyn Policy, samples: usize, next: &mut u64) {
    let prompt = (0..64).map(|t| ((t * 5 + 3) % 64) as u32).collect();
    let samples = (0..samples)
        .map(|_| {
            *next += 1;
            let params = SamplingParams {
                max_new_tokens: 32,
                seed: *next,
                ..Default::default()
            };
            (RequestKey(*next), params)
        })
        .collect::<Vec<_>>();
    let want = samples.len() * 32;
    be.add_group(GroupRequest { prompt, samples })
        .expect("add_group");
    let mut tokens = 0;
    while be.active_requests() > 0 {
        for o in be.decode_step().expect("step") {
            tokens += o.tokens.len();
        }
    }
    assert_eq!(tokens, want);
}

fn bench_generate(c: &mut Criterion, g: &Arc<Gpu>) {
    let (mut gpu, mut cpu) = small(g);
    // The same model as a bf16-storage engine (`WgpuBackend::with_dtype`).
    let cfg = ModelConfig::small();
    let w = Weights::random(&cfg, 0).expect("random weights");
    let mut bf16 =
        WgpuBackend::with_gpu_dtype(Arc::clone(g), &cfg, &w, DType::Bf16).expect("bf16 engine");
    // And as a bf16 engine on tensor cores, where the adapter has them.
    let mut bf16_tc = g.coop().map(|_| {
        let mut be =
            WgpuBackend::with_gpu_dtype(Arc::clone(g), &cfg, &w, DType::Bf16).expect("bf16 engine");
        be.set_tensor_cores(true).expect("tensor cores");
        be
    });
    // The f32 engine with look-ahead decoding (`WgpuBackend::set_lookahead`).
    let mut ahead = WgpuBackend::with_gpu(Arc::clone(g), &cfg, &w).expect("wgpu backend");
    ahead.set_lookahead(true);
    let mut grp = c.benchmark_group("wgpu_generate");
    grp.sample_size(10);
    grp.throughput(Throughput::Elements(8 * 32));
    let mut next = 1 << 40;
    grp.bench_function(BenchmarkId::new("wgpu_group", 8), |b| {
        b.iter(|| generate_group(gpu.as_mut(), 8, &mut next))
    });
    for conc in [1usize, 16, 64] {
        grp.throughput(Throughput::Elements((conc * 32) as u64));
        let mut next = 0;
        grp.bench_function(BenchmarkId::new("wgpu", conc), |b| {
            b.iter(|| generate(gpu.as_mut(), conc, &mut next))
        });
        grp.bench_function(BenchmarkId::new("wgpu_lookahead", conc), |b| {
            b.iter(|| generate(&mut ahead, conc, &mut next))
        });
        grp.bench_function(BenchmarkId::new("cpu", conc), |b| {
            b.iter(|| generate(cpu.as_mut(), conc, &mut next))
        });
        grp.bench_function(BenchmarkId::new("wgpu_bf16", conc), |b| {
            b.iter(|| generate(&mut bf16, conc, &mut next))
        });
        if let Some(be) = bf16_tc.as_mut() {
            grp.bench_function(BenchmarkId::new("wgpu_bf16_tc", conc), |b| {
                b.iter(|| generate(be, conc, &mut next))
            });
        }
    }
    grp.finish();
}

/// A GRPO batch of `seqs` sequences of `prompt_len` + `resp_len` tokens (ids below `vocab`),
/// advantages ±1, token-mean aggregation; its normalizer and the optimizer settings.
fn grpo_batch(
    seqs: usize,
    prompt_len: usize,
    resp_len: usize,
    vocab: usize,
) -> (TrainBatch, f64, AdamW) {
    let batch = TrainBatch {
        sequences: (0..seqs)
            .map(|s| {
                let p = (0..prompt_len)
                    .map(|t| ((t * 5 + s) % vocab) as u32)
                    .collect();
                let r = (0..resp_len)
                    .map(|t| ((t * 3 + 2 * s) % vocab) as u32)
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
    (batch, norm, opt)
}

fn bench_train(c: &mut Criterion, g: &Arc<Gpu>) {
    let (mut gpu, mut cpu) = small(g);
    let (seqs, prompt_len, resp_len) = (8usize, 16usize, 48usize);
    let (batch, norm, opt) = grpo_batch(seqs, prompt_len, resp_len, 64);
    let mut grp = c.benchmark_group("wgpu_train");
    grp.sample_size(10);
    grp.throughput(Throughput::Elements(
        (seqs * (prompt_len + resp_len)) as u64,
    ));
    // The f32 trainer with tensor-core forward products, where the adapter has them.
    let mut tc: Option<Box<dyn Policy>> = g.coop().map(|_| {
        let cfg = ModelConfig::small();
        let w = Weights::random(&cfg, 0).expect("random weights");
        let mut be = WgpuBackend::with_gpu(Arc::clone(g), &cfg, &w).expect("wgpu backend");
        be.set_tensor_cores(true).expect("tensor cores");
        Box::new(be) as Box<dyn Policy>
    });
    let mut runs = vec![("wgpu", &mut gpu), ("cpu", &mut cpu)];
    if let Some(be) = tc.as_mut() {
        runs.push(("wgpu_tc", be));
    }
    for (name, be) in runs {
        grp.bench_function(BenchmarkId::new(name, "grpo_step_8x64"), |b| {
            b.iter(|| grpo_step(be.as_mut(), &batch, norm, &opt))
        });
    }
    grp.finish();
}

/// The end-to-end workloads at production shapes (`scripts/device/torch_e2e.py` runs the same).
const E2E_REQUESTS: usize = 8;
const E2E_PROMPT: usize = 64;
const E2E_NEW: usize = 32;
const E2E_SEQS: usize = 4;
const E2E_TRAIN_PROMPT: usize = 64;
const E2E_TRAIN_RESPONSE: usize = 64;
/// The end-to-end generate cases: the engine's weight dtype, the case's name, and whether its
/// forward products run on tensor cores (`_tc`, where the adapter has them).
const E2E_GENERATE: [(DType, &str, bool, bool); 4] = [
    (DType::F32, "f32", false, false),
    (DType::Bf16, "bf16", false, false),
    (DType::Bf16, "bf16_tc", true, false),
    (DType::F32, "f32_ahead", false, true),
];
/// The end-to-end train cases of the f32 trainer: the case's name and tensor cores.
const E2E_TRAIN: [(&str, bool); 2] = [("f32", false), ("f32_tc", true)];

/// One GRPO optimizer step: zero_grad, accumulate, optimizer_step (forward, backward, AdamW).
fn grpo_step(be: &mut dyn Policy, batch: &TrainBatch, norm: f64, opt: &AdamW) {
    be.zero_grad().unwrap();
    be.accumulate(batch, &Objective::default())
        .expect("accumulate");
    be.optimizer_step(norm, opt).expect("step");
}

/// One shape's backends, built on first use: criterion calls a benchmark's closure only when
/// its name passes the filter, so a run of other benchmarks allocates none of this (a 1.7B
/// f32 trainer holds weights, gradients and two moments: 16 bytes a parameter, ~32 GB).
struct Lazy {
    name: &'static str,
    cfg: ModelConfig,
    g: Arc<Gpu>,
    weights: Option<Weights>,
    f32: Option<WgpuBackend>,
    bf16: Option<WgpuBackend>,
}

impl Lazy {
    /// The f32 backend (generates and trains) or the bf16-storage engine.
    fn backend(&mut self, dtype: DType) -> &mut WgpuBackend {
        let slot = match dtype {
            DType::F32 => &mut self.f32,
            _ => &mut self.bf16,
        };
        if slot.is_none() {
            let t = Instant::now();
            let w = self
                .weights
                .get_or_insert_with(|| Weights::random(&self.cfg, 0).expect("random weights"));
            let be = WgpuBackend::with_gpu_dtype(Arc::clone(&self.g), &self.cfg, w, dtype)
                .unwrap_or_else(|e| panic!("{}: the {dtype:?} backend failed: {e}", self.name));
            eprintln!(
                "{}: {dtype:?} backend built in {:.1} s ({} weight bytes)",
                self.name,
                t.elapsed().as_secs_f64(),
                be.weight_bytes()
            );
            *slot = Some(be);
        }
        slot.as_mut().expect("built above")
    }
}

/// Why `cfg` cannot run on this adapter, if it cannot: its largest buffer (the embedding,
/// `vocab × hidden` in `dtype`) above `max_buffer_size`. Every other tensor is smaller, and
/// the ops bind the large ones in chunks, so the binding size is no limit.
fn too_large(g: &Gpu, cfg: &ModelConfig, dtype: DType) -> Option<String> {
    let elem = if dtype == DType::F32 { 4 } else { 2 };
    let need = (cfg.vocab_size * cfg.hidden_size * elem) as u64;
    let have = g.device().limits().max_buffer_size;
    (need > have).then(|| {
        format!(
            "its {dtype:?} embedding is {need} bytes, above this adapter's max_buffer_size {have}"
        )
    })
}

/// Times `f` under criterion and prints its first call's wall time (the warm-up's, with the
/// kernels' compilation and the KV pool's growth), which on a slow adapter is the one number
/// a short run gives.
fn first_timed(what: &str, first: &mut bool, f: impl FnOnce()) {
    let t = Instant::now();
    f();
    if std::mem::take(first) {
        eprintln!("{what}: first iteration {:.2} s", t.elapsed().as_secs_f64());
    }
}

/// `wgpu_e2e_<shape>/{generate,train}/<dtype>` at Qwen3-0.6B and 1.7B shapes (random
/// weights), with `ROLLOUTPIPE_BENCH_SHAPES=prod` only:
/// - `generate/{f32,bf16}`: 8 requests of 64-token prompts, 32 new tokens each, prefill
///   included; throughput in generated tokens (256 an iteration). `f32` is the trainer's
///   own model generating, `bf16` the 16-bit-storage engine a trainer syncs to, `f32_ahead`
///   the f32 one decoding a step ahead (`WgpuBackend::set_lookahead`).
/// - `train/f32`: one GRPO optimizer step (zero_grad, accumulate, optimizer_step: forward,
///   backward, AdamW) on 4 sequences of 64 + 64 tokens; throughput in tokens (512).
///
/// `ROLLOUTPIPE_BENCH_E2E` (comma-separated: `0.6b`, `1.7b`) limits the shapes;
/// `ROLLOUTPIPE_BENCH_ONCE=1` times one iteration of each case instead ([`e2e_once`]).
///
/// Flat sampling with 10 samples: at least 10 timed iterations plus one warm-up, the fewest
/// criterion allows, so that the whole group stays short on a GPU.
fn bench_e2e(c: &mut Criterion, g: &Arc<Gpu>) {
    if !prod() {
        return;
    }
    // `ROLLOUTPIPE_BENCH_E2E=0.6b` (`wgpu.sh --quick`) keeps one shape; default both.
    let only = std::env::var("ROLLOUTPIPE_BENCH_E2E").unwrap_or_default();
    for (short, name, cfg) in [
        ("0.6b", "Qwen3-0.6B", ModelConfig::qwen3_0_6b()),
        ("1.7b", "Qwen3-1.7B", ModelConfig::qwen3_1_7b()),
    ] {
        if !only.is_empty() && !only.split(',').any(|s| s == short) {
            continue;
        }
        let group = format!("wgpu_e2e_{short}");
        let mut lazy = Lazy {
            name,
            cfg,
            g: Arc::clone(g),
            weights: None,
            f32: None,
            bf16: None,
        };
        if std::env::var("ROLLOUTPIPE_BENCH_ONCE").as_deref() == Ok("1") {
            e2e_once(&group, &mut lazy);
            continue;
        }
        let mut grp = c.benchmark_group(&group);
        grp.sample_size(10)
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_millis(100))
            .measurement_time(Duration::from_secs(1));
        let vocab = lazy.cfg.vocab_size;
        // `_tc`: the same backend with its forward products on tensor cores (turned on for
        // the benchmark and off after it), where the adapter has them.
        let tc = g.coop().is_some();
        for (dtype, id, on, ahead) in E2E_GENERATE {
            if on && !tc {
                continue;
            }
            if let Some(why) = too_large(g, &lazy.cfg, dtype) {
                eprintln!("SKIP: {group}/generate/{id}: {why}");
                continue;
            }
            grp.throughput(Throughput::Elements((E2E_REQUESTS * E2E_NEW) as u64));
            let (mut next, mut first) = (0u64, true);
            grp.bench_function(BenchmarkId::new("generate", id), |b| {
                let be = lazy.backend(dtype);
                be.set_tensor_cores(on).expect("tensor cores");
                be.set_lookahead(ahead);
                b.iter(|| {
                    first_timed(&format!("{group}/generate/{id}"), &mut first, || {
                        generate_n(be, E2E_REQUESTS, E2E_PROMPT, E2E_NEW, vocab, &mut next)
                    })
                });
                be.set_tensor_cores(false).expect("f32 kernels");
                be.set_lookahead(false);
            });
        }
        if let Some(why) = too_large(g, &lazy.cfg, DType::F32) {
            eprintln!("SKIP: {group}/train/f32: {why}");
        } else {
            let (batch, norm, opt) =
                grpo_batch(E2E_SEQS, E2E_TRAIN_PROMPT, E2E_TRAIN_RESPONSE, vocab);
            grp.throughput(Throughput::Elements(
                (E2E_SEQS * (E2E_TRAIN_PROMPT + E2E_TRAIN_RESPONSE)) as u64,
            ));
            for (id, on) in E2E_TRAIN {
                if on && !tc {
                    continue;
                }
                let mut first = true;
                grp.bench_function(BenchmarkId::new("train", id), |b| {
                    let be = lazy.backend(DType::F32);
                    be.set_tensor_cores(on).expect("tensor cores");
                    b.iter(|| {
                        first_timed(&format!("{group}/train/{id}"), &mut first, || {
                            grpo_step(be, &batch, norm, &opt)
                        })
                    });
                    be.set_tensor_cores(false).expect("f32 kernels");
                });
            }
        }
        grp.finish();
        // The next shape's backends must not share the device with this one's.
        drop(lazy);
    }
}

/// `ROLLOUTPIPE_BENCH_ONCE=1`: each end-to-end case of `bench_e2e` timed for one iteration
/// after one untimed warm-up iteration (compilation, the KV pool's and the activations'
/// growth), outside criterion, which needs 11 iterations at least: on a CPU adapter one 0.6B
/// generate iteration takes minutes. Prints `<group>/<case>: <s> s, <tokens/s>` per case;
/// `ROLLOUTPIPE_BENCH_ONCE_CASES` (comma-separated, e.g. `generate/bf16,train/f32`) limits
/// the cases.
fn e2e_once(group: &str, lazy: &mut Lazy) {
    let vocab = lazy.cfg.vocab_size;
    let tc = lazy.g.coop().is_some();
    // `ROLLOUTPIPE_BENCH_ONCE_CASES=generate/bf16,train/f32` keeps only those cases.
    let only = std::env::var("ROLLOUTPIPE_BENCH_ONCE_CASES").unwrap_or_default();
    let wanted = |case: &str| only.is_empty() || only.split(',').any(|c| c == case);
    let report = |case: &str, tokens: usize, run: &mut dyn FnMut()| {
        run();
        let t = Instant::now();
        run();
        let s = t.elapsed().as_secs_f64();
        eprintln!(
            "{group}/{case}: {s:.1} s, {:.3} tokens/s (one iteration after a warm-up)",
            tokens as f64 / s
        );
    };
    let mut next = 0u64;
    for (dtype, id, on, ahead) in E2E_GENERATE {
        if (on && !tc)
            || too_large(&lazy.g, &lazy.cfg, dtype).is_some()
            || !wanted(&format!("generate/{id}"))
        {
            continue;
        }
        let be = lazy.backend(dtype);
        be.set_tensor_cores(on).expect("tensor cores");
        be.set_lookahead(ahead);
        report(
            &format!("generate/{id}"),
            E2E_REQUESTS * E2E_NEW,
            &mut || generate_n(be, E2E_REQUESTS, E2E_PROMPT, E2E_NEW, vocab, &mut next),
        );
        be.set_tensor_cores(false).expect("f32 kernels");
        be.set_lookahead(false);
    }
    if too_large(&lazy.g, &lazy.cfg, DType::F32).is_some() {
        return;
    }
    let (batch, norm, opt) = grpo_batch(E2E_SEQS, E2E_TRAIN_PROMPT, E2E_TRAIN_RESPONSE, vocab);
    for (id, on) in E2E_TRAIN {
        if (on && !tc) || !wanted(&format!("train/{id}")) {
            continue;
        }
        let be = lazy.backend(DType::F32);
        be.set_tensor_cores(on).expect("tensor cores");
        report(
            &format!("train/{id}"),
            E2E_SEQS * (E2E_TRAIN_PROMPT + E2E_TRAIN_RESPONSE),
            &mut || grpo_step(be, &batch, norm, &opt),
        );
        be.set_tensor_cores(false).expect("f32 kernels");
    }
}

fn benches(c: &mut Criterion) {
    let Some(g) = gpu() else { return };
    bench_ops(c, &g);
    bench_generate(c, &g);
    bench_train(c, &g);
    bench_e2e(c, &g);
}

/// 0.3 s of warm-up and 2 s of measurement per benchmark unless the command line says
/// otherwise (`--warm-up-time`, `--measurement-time`: `scripts/device/wgpu.sh --quick`). The
/// groups set only their sample size, since a group's own times would override the command
/// line's; the `wgpu_e2e_*` groups alone set theirs (the fewest iterations, any adapter).
fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = wgpu_benches;
    config = config();
    targets = benches
}
criterion_main!(wgpu_benches);
