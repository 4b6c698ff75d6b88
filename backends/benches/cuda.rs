//! The CUDA backend's benchmark table (one printed table, for `scripts/device/cuda.sh`).
//!
//! - per-kernel throughput at Qwen3-0.6B and 1.7B shapes: the tensor-core GEMM (bf16 in,
//!   f32 out) and the f32 GEMM against cuBLAS on the same shapes (`cublasGemmEx` bf16 with
//!   f32 compute, `cublasSgemm`; cuBLAS is the baseline only, loaded at run time like the
//!   driver), in TFLOP/s; attention in TFLOP/s; the memory-bound kernels in GB/s; each
//!   against the device's peak when the device is one this file knows (H100, H200, A100);
//! - end to end: generated tokens/s (16 requests, 16-token prompts, 64 new tokens, greedy)
//!   and GRPO-step tokens/s (8 sequences of 64 + 192 tokens: forward, backward, AdamW) of
//!   the CUDA backend on random weights at both model shapes.
//!
//! Not criterion: the device script has a budget of ~8 minutes on one GPU, so each row runs
//! a fixed warm-up and a fixed number of timed repetitions (stream synchronized before the
//! clock stops). PyTorch eager's numbers on the same shapes come from
//! `scripts/device/torch_eager.py`, run by the same script when torch is installed.
//!
//! Run: `cargo bench -p rolloutpipe-backends --features cuda --bench cuda [-- --quick]`.
//! Without a CUDA device it prints SKIP and exits 0, or 1 with `ROLLOUTPIPE_REQUIRE_CUDA=1`.

use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::{CudaBlas, result as blas, sys as bsys};
use rolloutpipe_backends::cuda::abi::Arg;
use rolloutpipe_backends::cuda::ops::{self, AttnShape};
use rolloutpipe_backends::cuda::plan::{self, AdamScalars};
use rolloutpipe_backends::cuda::{Cuda, CudaBackend, DBuf};
use rolloutpipe_backends::*;

/// A Qwen3 shape (hidden, intermediate, heads, kv heads, head dim, vocab), read off
/// `ModelConfig::qwen3_0_6b` / `qwen3_1_7b` (the shapes every bench and script shares).
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    /// The shape's constructor.
    cfg: fn() -> ModelConfig,
    d: usize,
    f: usize,
    h: usize,
    kvh: usize,
    hd: usize,
    vocab: usize,
}

impl Shape {
    fn of(name: &'static str, cfg: fn() -> ModelConfig) -> Self {
        let c = cfg();
        Shape {
            name,
            cfg,
            d: c.hidden_size,
            f: c.intermediate_size,
            h: c.num_attention_heads,
            kvh: c.num_key_value_heads,
            hd: c.head_dim,
            vocab: c.vocab_size,
        }
    }
}

fn qwen3() -> [Shape; 2] {
    [
        Shape::of("Qwen3-0.6B", ModelConfig::qwen3_0_6b),
        Shape::of("Qwen3-1.7B", ModelConfig::qwen3_1_7b),
    ]
}

/// Dense peaks `(bf16 TFLOP/s, f32 TFLOP/s, HBM GB/s)` of known devices (vendor data sheets,
/// SXM parts, no sparsity).
fn peaks(name: &str) -> Option<(f64, f64, f64)> {
    if name.contains("H200") {
        Some((989.0, 67.0, 4800.0))
    } else if name.contains("H100") {
        Some((989.0, 67.0, 3350.0))
    } else if name.contains("A100") {
        Some((312.0, 19.5, 2039.0))
    } else {
        None
    }
}

struct Table {
    rows: Vec<[String; 6]>,
}

impl Table {
    fn row(
        &mut self,
        what: String,
        shape: String,
        us: f64,
        rate: String,
        peak: String,
        vs: String,
    ) {
        println!("{what:<28} {shape:<22} {us:>10.1} {rate:>14} {peak:>9} {vs:>16}");
        self.rows
            .push([what, shape, format!("{us:.1}"), rate, peak, vs]);
    }
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 97) as f32 - 48.0) * 0.01)
        .collect()
}

/// Mean microseconds per call of `f` over `reps` calls after `warm` calls (synchronized).
fn time(c: &Cuda, warm: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    c.sync().expect("sync");
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    c.sync().expect("sync");
    t.elapsed().as_secs_f64() * 1e6 / reps as f64
}

fn ptr<T: rolloutpipe_backends::cuda::device::Elem>(b: &DBuf<T>) -> u64 {
    match b.arg(b.len(), "bench") {
        Ok(Arg::Ptr(p)) => p,
        _ => panic!("buffer address"),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let require = std::env::var("ROLLOUTPIPE_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    let c = match Cuda::open(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SKIP: {e}; the CUDA benchmarks did not run");
            std::process::exit(if require { 1 } else { 0 });
        }
    };
    let name = c.name();
    let pk = peaks(&name);
    println!(
        "device: {name}{}",
        if pk.is_none() { " (peak unknown)" } else { "" }
    );
    println!(
        "{:<28} {:<22} {:>10} {:>14} {:>9} {:>16}",
        "benchmark", "shape", "us/call", "rate", "% peak", "vs baseline"
    );
    let mut t = Table { rows: Vec::new() };
    let blas = CudaBlas::new(Arc::clone(c.stream())).expect("cuBLAS");
    let reps = if quick { 5 } else { 20 };
    let tokens = 4096;
    for s in qwen3() {
        for &(what, dout, din) in &[
            ("q_proj", s.h * s.hd, s.d),
            ("gate_proj", s.f, s.d),
            ("down_proj", s.d, s.f),
        ] {
            gemm_rows(&c, &blas, &mut t, s, what, tokens, din, dout, reps, pk);
        }
        attention_row(&c, &mut t, s, 2048, reps, pk);
    }
    memory_rows(&c, &mut t, 1 << 26, reps, pk);
    for s in qwen3() {
        e2e_rows(&c, &mut t, s, quick);
    }
    println!("({} rows)", t.rows.len());
}

#[allow(clippy::too_many_arguments)]
fn gemm_rows(
    c: &Arc<Cuda>,
    blas: &CudaBlas,
    t: &mut Table,
    s: Shape,
    what: &str,
    m: usize,
    k: usize,
    n: usize,
    reps: usize,
    pk: Option<(f64, f64, f64)>,
) {
    let flops = 2.0 * (m * n * k) as f64;
    let x = c.upload(&data(m * k, 1)).expect("x");
    let w = c.upload(&data(n * k, 2)).expect("w");
    let y = c.alloc::<f32>(m * n).expect("y");
    let (xh, wh) = (
        c.alloc::<u16>(m * k).expect("xh"),
        c.alloc::<u16>(n * k).expect("wh"),
    );
    ops::cast_bf16(c, &xh, &x, m * k).expect("cast");
    ops::cast_bf16(c, &wh, &w, n * k).expect("cast");
    let shape = format!("{m}x{k}->{n}");
    // cuBLAS bf16: row-major Y[m, n] = X . W^T is column-major Y^T = W . X^T (see below).
    let (one, zero) = (1.0f32, 0.0f32);
    let cublas_bf16 = time(c, 2, reps, || {
        // SAFETY: X, W are bf16 [m, k], [n, k] and Y f32 [m, n], allocated above in this
        // context; column-major: op(A) = W^T... i.e. A = W (k x n col-major, lda k,
        // transposed), B = X (k x m col-major, ldb k), C = Y (n x m col-major, ldc n).
        unsafe {
            blas::gemm_ex(
                *blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                (&one as *const f32).cast(),
                ptr(&wh) as *const _,
                bsys::cudaDataType::CUDA_R_16BF,
                k as i32,
                ptr(&xh) as *const _,
                bsys::cudaDataType::CUDA_R_16BF,
                k as i32,
                (&zero as *const f32).cast(),
                ptr(&y) as *mut _,
                bsys::cudaDataType::CUDA_R_32F,
                n as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .expect("cublasGemmEx");
    });
    let ours = time(c, 2, reps, || {
        ops::matmul_fwd_tc(c, &y, &xh, &wh, m, k, n).expect("matmul_fwd");
    });
    let tf = flops / ours / 1e6;
    t.row(
        format!("{} {what} bf16 mma", s.name),
        shape.clone(),
        ours,
        format!("{tf:.1} TFLOP/s"),
        pk.map_or("-".into(), |p| format!("{:.0}%", 100.0 * tf / p.0)),
        format!("{:.0}% of cuBLAS", 100.0 * cublas_bf16 / ours),
    );
    let cublas_f32 = time(c, 2, reps, || {
        // SAFETY: as above with f32 operands X [m, k], W [n, k], Y [m, n].
        unsafe {
            blas::sgemm(
                *blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &one,
                ptr(&w) as *const f32,
                k as i32,
                ptr(&x) as *const f32,
                k as i32,
                &zero,
                ptr(&y) as *mut f32,
                n as i32,
            )
        }
        .expect("cublasSgemm");
    });
    let ours = time(c, 1, reps.min(5), || {
        ops::matmul_fwd(c, &y, &x, &w, m, k, n).expect("matmul_fwd_f32");
    });
    let tf = flops / ours / 1e6;
    t.row(
        format!("{} {what} f32", s.name),
        shape,
        ours,
        format!("{tf:.1} TFLOP/s"),
        pk.map_or("-".into(), |p| format!("{:.0}%", 100.0 * tf / p.1)),
        format!("{:.0}% of sgemm", 100.0 * cublas_f32 / ours),
    );
}

fn attention_row(
    c: &Arc<Cuda>,
    t: &mut Table,
    s: Shape,
    len: usize,
    reps: usize,
    pk: Option<(f64, f64, f64)>,
) {
    let (qd, kd) = (s.h * s.hd, s.kvh * s.hd);
    let q = c.upload(&data(len * qd, 3)).expect("q");
    let k = c.upload(&data(len * kd, 4)).expect("k");
    let v = c.upload(&data(len * kd, 5)).expect("v");
    let qmeta: Vec<u32> = (0..len as u32).flat_map(|i| [0, i]).collect();
    let qm = c.upload(&qmeta).expect("qmeta");
    let (out, st) = (
        c.alloc::<f32>(len * qd).expect("out"),
        c.alloc::<f32>(2 * len * s.h).expect("stats"),
    );
    let shape = AttnShape {
        n_q: len,
        n_k: len,
        heads: s.h,
        kv_heads: s.kvh,
        hd: s.hd,
        scale: plan::attention_scale(s.hd),
    };
    let us = time(c, 1, reps.min(5), || {
        ops::attention_fwd(c, &out, &st, &q, &k, &v, &qm, shape).expect("attention_fwd");
    });
    // Causal: ~len^2/2 score and value products of 2*hd flops each, per head.
    let flops = 2.0 * 2.0 * (s.h * s.hd) as f64 * (len * len) as f64 / 2.0;
    let tf = flops / us / 1e6;
    t.row(
        format!("{} attention_fwd", s.name),
        format!("causal {len}"),
        us,
        format!("{tf:.2} TFLOP/s"),
        pk.map_or("-".into(), |p| format!("{:.1}%", 100.0 * tf / p.1)),
        "-".into(),
    );
}

fn memory_rows(c: &Arc<Cuda>, t: &mut Table, n: usize, reps: usize, pk: Option<(f64, f64, f64)>) {
    let a = c.upload(&data(n, 6)).expect("a");
    let b = c.upload(&data(n, 7)).expect("b");
    let o = c.alloc::<f32>(n).expect("o");
    let m = c.alloc::<f32>(n).expect("m");
    let gbs = |bytes: f64, us: f64| bytes / us / 1e3;
    let row = |t: &mut Table, what: &str, bytes: f64, us: f64| {
        let g = gbs(bytes, us);
        t.row(
            what.into(),
            format!("{n} f32"),
            us,
            format!("{g:.0} GB/s"),
            pk.map_or("-".into(), |p| format!("{:.0}%", 100.0 * g / p.2)),
            "-".into(),
        );
    };
    let us = time(c, 2, reps, || {
        ops::residual_fwd(c, &o, &a, &b, n).expect("residual")
    });
    row(t, "residual_fwd", 12.0 * n as f64, us);
    let us = time(c, 2, reps, || {
        ops::swiglu_fwd(c, &o, &a, &b, n).expect("swiglu")
    });
    row(t, "swiglu_fwd", 12.0 * n as f64, us);
    let (rows, d) = (n / 2048, 2048);
    let w = c.upload(&data(d, 8)).expect("w");
    let rs = c.alloc::<f32>(rows).expect("rstd");
    let us = time(c, 2, reps, || {
        ops::rmsnorm_fwd(c, &o, &rs, &a, &w, rows, d, 1e-6).expect("rmsnorm")
    });
    row(t, "rmsnorm_fwd", 8.0 * n as f64, us);
    let s = AdamScalars::new(1.0, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
    let us = time(c, 2, reps, || {
        ops::adamw_step(c, &o, &a, &m, &b, n, s).expect("adamw")
    });
    row(t, "adamw_step", 28.0 * n as f64, us);
}

/// The model of shape `s` (as its `ModelConfig` constructor; 4,096 positions are plenty for
/// the benchmark's sequences and keep the RoPE tables small).
fn config(s: Shape) -> ModelConfig {
    ModelConfig {
        max_position_embeddings: 4096,
        ..(s.cfg)()
    }
}

fn e2e_rows(c: &Arc<Cuda>, t: &mut Table, s: Shape, quick: bool) {
    let cfg = config(s);
    let t0 = Instant::now();
    let w = match Weights::random(&cfg, 1) {
        Ok(w) => w,
        Err(e) => return eprintln!("{}: weights: {e}", s.name),
    };
    let mut be = match CudaBackend::with_cuda(Arc::clone(c), &cfg, &w) {
        Ok(b) => b,
        Err(e) => return eprintln!("{}: backend: {e}", s.name),
    };
    drop(w);
    eprintln!(
        "{}: model ready in {:.1} s",
        s.name,
        t0.elapsed().as_secs_f64()
    );
    let (reqs, prompt, new) = (16usize, 16usize, if quick { 16 } else { 64 });
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: new,
        ..Default::default()
    };
    let t1 = Instant::now();
    for i in 0..reqs {
        let p: Vec<u32> = (0..prompt)
            .map(|j| ((i * 7919 + j * 104_729) % s.vocab) as u32)
            .collect();
        be.add_request(GenRequest {
            id: RequestKey(i as u64),
            prompt: p,
            params: params.clone(),
        })
        .expect("add");
    }
    let mut done = 0;
    while be.active_requests() > 0 {
        done += be.decode_step().expect("decode").len();
    }
    let secs = t1.elapsed().as_secs_f64();
    let tps = (reqs * new) as f64 / secs;
    t.row(
        format!("{} generate", s.name),
        format!("{reqs} req x {new} new"),
        secs * 1e6 / new as f64,
        format!("{tps:.0} tok/s"),
        "-".into(),
        format!("{done} finished"),
    );
    let (seqs, pl, rl) = (8usize, 64usize, if quick { 64 } else { 192 });
    let sequences: Vec<TrainSequence> = (0..seqs)
        .map(|i| {
            let p = (0..pl)
                .map(|j| ((i * 31 + j * 17) % s.vocab) as u32)
                .collect();
            let r = (0..rl)
                .map(|j| ((i * 13 + j * 7 + 5) % s.vocab) as u32)
                .collect();
            TrainSequence::new(
                p,
                r,
                if i % 2 == 0 { 1.0 } else { -1.0 },
                Aggregation::TokenMean,
            )
        })
        .collect();
    let batch = TrainBatch { sequences };
    let step = |be: &mut CudaBackend| {
        be.zero_grad().expect("zero_grad");
        let st = be
            .accumulate(&batch, &Objective::default())
            .expect("accumulate");
        be.optimizer_step(st.tokens as f64, &AdamW::default())
            .expect("step");
    };
    step(&mut be); // warm-up: allocates the activations
    let t2 = Instant::now();
    let n = if quick { 1 } else { 3 };
    for _ in 0..n {
        step(&mut be);
    }
    let secs = t2.elapsed().as_secs_f64() / n as f64;
    let toks = (seqs * (pl + rl)) as f64;
    t.row(
        format!("{} GRPO step", s.name),
        format!("{seqs} x ({pl}+{rl})"),
        secs * 1e6,
        format!("{:.0} tok/s", toks / secs),
        "-".into(),
        "-".into(),
    );
}
