//! Tensor cores on the wgpu backend (`matmul_fwd_coop`, `matmul_bwd_coop`,
//! `WgpuBackend::set_tensor_cores`): the product is the f32 product of f16-rounded operands
//! to within an f32 sum's rounding, for every weight format, with `accumulate`; the backward's
//! dx and dW are the products of the f16-rounded, power-of-two-scaled dy and the f16-rounded
//! operands, tiny and huge gradients included, deterministically; a row's result does not depend on its batch
//! (bit for bit), so scoring and decoding stay batch-invariant; whole-model log-probs and
//! training gradients stay within a stated bound of the f32 kernels'; and a device without
//! cooperative matrices refuses in one line naming what it lacks.
//!
//! The system lavapipe of the CI machine (Mesa 22.3) has no cooperative matrices, so there
//! the tests that need them print SKIP and only the refusal is checked;
//! `scripts/ci.d/coop.sh` runs this file again on a Mesa 26 lavapipe
//! (`scripts/coop_lavapipe.py`) with `ROLLOUTPIPE_REQUIRE_COOP=1`, which makes a skip an
//! error.
#![cfg(feature = "wgpu")]

#[path = "support/check.rs"]
#[allow(dead_code)]
mod check;
#[path = "support/device.rs"]
mod device;
#[path = "support/engine.rs"]
mod engine;

use std::sync::Arc;

use check::{Tol, assert_close, rand_vec};
use engine::generate;
use half::{bf16, f16};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use rolloutpipe_backends::wgpu::{Exec, Gpu, WgpuBackend, ops};
use rolloutpipe_backends::*;
use rolloutpipe_kernels::WeightFormat;

/// The shared device when it has tensor cores; `None` (after a SKIP line) when it has none,
/// a panic instead under `ROLLOUTPIPE_REQUIRE_COOP=1`.
fn coop_gpu() -> Option<Arc<Gpu>> {
    let g = device::gpu()?;
    if let Some(why) = g.coop_refusal() {
        if std::env::var("ROLLOUTPIPE_REQUIRE_COOP").is_ok_and(|v| v == "1") {
            panic!("ROLLOUTPIPE_REQUIRE_COOP=1 but {why}");
        }
        eprintln!("SKIP: {why} (scripts/ci.d/coop.sh runs these on a lavapipe that has them)");
        return None;
    }
    eprintln!("tensor cores: {:?}", g.coop());
    Some(g)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// f32 → f16 → f32 as the kernel stages an operand: saturating at ±65504.
fn as_half(v: f32) -> f64 {
    f16::from_f32(v.clamp(-65504.0, 65504.0)).to_f64()
}

/// `w` stored in `f` (the buffer and the values the kernel widens).
fn stored(g: &Gpu, w: &[f32], f: WeightFormat) -> (::wgpu::Buffer, Vec<f32>) {
    match f {
        WeightFormat::F32 => (g.upload("w", w), w.to_vec()),
        WeightFormat::Bf16 => {
            let b: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let bits: Vec<u16> = b.iter().map(|v| v.to_bits()).collect();
            (
                g.upload("w", &ops::pack_half(&bits)),
                b.iter().map(|v| v.to_f32()).collect(),
            )
        }
        WeightFormat::F16 => {
            let h: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let bits: Vec<u16> = h.iter().map(|v| v.to_bits()).collect();
            (
                g.upload("w", &ops::pack_half(&bits)),
                h.iter().map(|v| v.to_f32()).collect(),
            )
        }
    }
}

/// `y0 + x·wᵀ` (`y0` zeros unless accumulating) on tensor cores.
#[allow(clippy::too_many_arguments)]
fn coop_product(
    g: &Arc<Gpu>,
    x: &[f32],
    w: &::wgpu::Buffer,
    f: WeightFormat,
    y0: &[f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) -> Vec<f32> {
    let mut ex = Exec::new(Arc::clone(g));
    ex.set_tensor_cores(true).expect("tensor cores");
    let (xb, yb) = (g.upload("x", x), g.upload("y", y0));
    ops::matmul_fwd_as(&mut ex, &yb, &xb, w, f, m, k, n, accumulate);
    ex.submit().expect("submit");
    g.read::<f32>(&yb, m * n).expect("read")
}

/// Shapes with every edge: a single row (decode), rows and columns short of a tile, K short
/// of a step and not a multiple of 8, several tiles each way.
const SHAPES: [(usize, usize, usize); 5] = [
    (1, 37, 45),
    (7, 64, 300),
    (33, 100, 65),
    (70, 257, 129),
    (130, 24, 8),
];

#[test]
fn coop_product_is_the_product_of_half_rounded_operands() {
    let Some(g) = coop_gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (m, k, n) in SHAPES {
        // Activations up to ±3 with a few past f16's range, which must saturate, not overflow.
        let mut x = rand_vec(&mut rng, m * k, 3.0);
        x[0] = 1.0e5;
        x[m * k - 1] = -7.0e4;
        let w = rand_vec(&mut rng, n * k, 0.5);
        let y0 = rand_vec(&mut rng, m * n, 1.0);
        for f in WeightFormat::ALL {
            let (wb, wv) = stored(&g, &w, f);
            for accumulate in [false, true] {
                let got = coop_product(&g, &x, &wb, f, &y0, m, k, n, accumulate);
                for r in 0..m {
                    for c in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for i in 0..k {
                            let t = as_half(x[r * k + i]) * as_half(wv[c * k + i]);
                            want += t;
                            mag += t.abs();
                        }
                        let base = if accumulate {
                            y0[r * n + c] as f64
                        } else {
                            0.0
                        };
                        // f16 products are exact in f32; the sum of k of them rounds at most
                        // k times (ε = 2^-24 each), plus the final add into y.
                        let bound = (k as f64 + 2.0) * 2f64.powi(-24) * (mag + base.abs()) + 1e-30;
                        let e = (got[r * n + c] as f64 - (want + base)).abs();
                        assert!(
                            e <= bound,
                            "{m}x{k}x{n} {f:?} acc={accumulate} y[{r},{c}] = {} vs {} (err {e:.3e} > {bound:.3e})",
                            got[r * n + c],
                            want + base
                        );
                    }
                }
            }
        }
    }
}

/// The f16 rounding is real: against the f32 product of the unrounded operands the error is
/// far above an f32 sum's, so the test above could tell the kernels apart.
#[test]
fn coop_product_differs_from_the_f32_product_by_the_rounding() {
    let Some(g) = coop_gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (m, k, n) = (16, 96, 40);
    let x = rand_vec(&mut rng, m * k, 1.0);
    let w = rand_vec(&mut rng, n * k, 1.0);
    let (wb, _) = stored(&g, &w, WeightFormat::F32);
    let got = coop_product(
        &g,
        &x,
        &wb,
        WeightFormat::F32,
        &vec![0.0; m * n],
        m,
        k,
        n,
        false,
    );
    let mut worst = 0f64;
    for r in 0..m {
        for c in 0..n {
            let want: f64 = (0..k)
                .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                .sum();
            worst = worst.max((got[r * n + c] as f64 - want).abs());
        }
    }
    // f16 keeps 11 bits: per-term errors ~2^-11 of ~0.3, over 96 terms ~ 1e-3; an f32 sum
    // would be ~1e-6.
    assert!(worst > 1e-4 && worst < 2e-2, "worst {worst:.3e}");
}

/// A row comes out bit for bit the same whatever rows share its launch (1, 8, 40 or 130
/// rows: one tile or many), so decode steps and scoring batches agree.
#[test]
fn coop_rows_do_not_depend_on_the_batch() {
    let Some(g) = coop_gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (k, n) = (200, 77);
    let x = rand_vec(&mut rng, 130 * k, 1.0);
    let w = rand_vec(&mut rng, n * k, 1.0);
    for f in [WeightFormat::F32, WeightFormat::Bf16] {
        let (wb, _) = stored(&g, &w, f);
        let all = coop_product(&g, &x, &wb, f, &vec![0.0; 130 * n], 130, k, n, false);
        for (first, rows) in [(0, 1), (5, 1), (129, 1), (3, 8), (60, 40)] {
            let part = &x[first * k..(first + rows) * k];
            let got = coop_product(&g, part, &wb, f, &vec![0.0; rows * n], rows, k, n, false);
            assert_eq!(
                bits(&got),
                bits(&all[first * n..(first + rows) * n]),
                "{f:?} rows {first}..{}",
                first + rows
            );
        }
    }
}

/// The power of two `matmul_bwd_coop` scales a launch's dy by: the largest |dy|·s lies in
/// [2^14, 2^15) (1 for an all-zero or non-finite dy).
fn grad_scale(dy: &[f32]) -> f64 {
    let bits = dy.iter().map(|v| v.abs().to_bits()).max().unwrap_or(0);
    let e = ((bits >> 23) & 0xff) as i32;
    if bits == 0 || e == 255 {
        return 1.0;
    }
    2f64.powi((141 - e).clamp(-126, 126))
}

/// dx (accumulated into `dx0` or written) and dW (always accumulated into `dw0`) of
/// `y = x·Wᵀ` on tensor cores, with storage bindings capped at `cap` bytes (the lm_head's
/// vocabulary chunks: W's rows in launches of 256) where given.
#[allow(clippy::too_many_arguments)]
fn coop_backward(
    g: &Arc<Gpu>,
    tc: bool,
    cap: Option<usize>,
    (dy, x, w): (&[f32], &[f32], &[f32]),
    (dx0, dw0): (&[f32], &[f32]),
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) -> (Vec<f32>, Vec<f32>) {
    let mut ex = Exec::new(Arc::clone(g));
    ex.set_tensor_cores(tc).expect("tensor cores");
    if let Some(c) = cap {
        ex.cap_binding(c);
    }
    let up = |name: &str, v: &[f32]| g.upload(name, v);
    let (dyb, xb, wb, dxb, dwb) = (
        up("dy", dy),
        up("x", x),
        up("w", w),
        up("dx", dx0),
        up("dw", dw0),
    );
    ops::matmul_bwd(
        &mut ex,
        Some((&dxb, accumulate)),
        &dwb,
        &dyb,
        &xb,
        &wb,
        m,
        k,
        n,
    );
    ex.submit().expect("submit");
    (
        g.read::<f32>(&dxb, m * k).expect("read dx"),
        g.read::<f32>(&dwb, n * k).expect("read dw"),
    )
}

/// The backward on tensor cores is the product of the f16-rounded scaled dy (one scale per
/// launch: per 256-row chunk of W where the binding is capped) and the f16-rounded W or x, to
/// within an f32 sum's rounding: dx with and without `accumulate`, dW accumulated, at shapes
/// with every edge, gradients of every size from 1e-9 to 1e6 (past f16's range both ways).
#[test]
fn coop_backward_is_the_product_of_scaled_half_operands() {
    let Some(g) = coop_gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    // (rows m, in k, out n, binding cap): the last splits W's 300 rows into 256 + 44.
    let cases = [
        (1, 37, 45, None),
        (7, 64, 300, None),
        (33, 100, 65, None),
        (70, 257, 129, None),
        (130, 24, 8, None),
        (21, 64, 300, Some(256 * 64 * 4)),
    ];
    for (ci, (m, k, n, cap)) in cases.into_iter().enumerate() {
        let scale = [1e-9f32, 3e-6, 1.0, 1e6][ci % 4];
        let dy = rand_vec(&mut rng, m * n, scale);
        let x = rand_vec(&mut rng, m * k, 2.0);
        let w = rand_vec(&mut rng, n * k, 0.5);
        let dx0 = rand_vec(&mut rng, m * k, 1.0);
        let dw0 = rand_vec(&mut rng, n * k, 1.0);
        // W's rows per launch, and each launch's scale from its own columns of dy.
        let chunk = if cap.is_some() { 256 } else { n };
        let scales: Vec<f64> = (0..n.div_ceil(chunk))
            .map(|c| {
                let cols = c * chunk..((c + 1) * chunk).min(n);
                let dy = &dy;
                let part: Vec<f32> = (0..m)
                    .flat_map(|r| cols.clone().map(move |j| dy[r * n + j]))
                    .collect();
                grad_scale(&part)
            })
            .collect();
        let dyh = |r: usize, j: usize| {
            let s = scales[j / chunk];
            (f16::from_f32((dy[r * n + j] as f64 * s) as f32).to_f64(), s)
        };
        for accumulate in [false, true] {
            let (dx, dw) = coop_backward(
                &g,
                true,
                cap,
                (&dy, &x, &w),
                (&dx0, &dw0),
                (m, k, n),
                accumulate,
            );
            let check = |what: &str, got: f32, want: f64, mag: f64| {
                // Exact f16 products; ≤ inner + 2 f32 roundings of the partial sums (one
                // chain per launch, launches added in turn), plus the add into the base.
                let inner = if what == "dx" { n } else { m };
                let bound = (inner as f64 + 3.0) * 2f64.powi(-24) * mag + 1e-38;
                let e = (got as f64 - want).abs();
                assert!(
                    e <= bound,
                    "{m}x{k}x{n} cap={cap:?} acc={accumulate} {what} = {got} vs {want} (err {e:.3e} > {bound:.3e})"
                );
            };
            for r in 0..m {
                for c in 0..k {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for j in 0..n {
                        let (a, s) = dyh(r, j);
                        let t = a * as_half(w[j * k + c]) / s;
                        want += t;
                        mag += t.abs();
                    }
                    let base = if accumulate {
                        dx0[r * k + c] as f64
                    } else {
                        0.0
                    };
                    check("dx", dx[r * k + c], want + base, mag + base.abs());
                }
            }
            for j in 0..n {
                for c in 0..k {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for r in 0..m {
                        let (a, s) = dyh(r, j);
                        let t = a * as_half(x[r * k + c]) / s;
                        want += t;
                        mag += t.abs();
                    }
                    let base = dw0[j * k + c] as f64;
                    check("dW", dw[j * k + c], want + base, mag + base.abs());
                }
            }
        }
    }
}

/// Scaling keeps gradients far below f16's smallest normal (6.1e-5) and above its largest
/// (65504) at f16's relative precision: against the f32 kernels, dx and dW differ by at most
/// 2e-3 of their norms at dy magnitudes from 1e-10 to 1e8 (unscaled, 1e-10 would flush to
/// zero and 1e8 saturate). The launch is deterministic: twice, the same bits.
#[test]
fn coop_backward_keeps_tiny_and_huge_gradients() {
    let Some(g) = coop_gpu() else { return };
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let (m, k, n) = (48, 72, 100);
    let x = rand_vec(&mut rng, m * k, 1.0);
    let w = rand_vec(&mut rng, n * k, 0.3);
    let zeros = (vec![0.0; m * k], vec![0.0; n * k]);
    let rel = |a: &[f32], b: &[f32]| {
        let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let nb: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (d / nb).sqrt()
    };
    for scale in [1e-10f32, 1e-7, 1.0, 1e8] {
        let dy = rand_vec(&mut rng, m * n, scale);
        let ops = (&dy[..], &x[..], &w[..]);
        let run = |tc| coop_backward(&g, tc, None, ops, (&zeros.0, &zeros.1), (m, k, n), false);
        let (dx, dw) = run(true);
        let (fx, fw) = run(false);
        let (ex, ew) = (rel(&dx, &fx), rel(&dw, &fw));
        eprintln!("dy ~ {scale:e}: dx {ex:.2e}, dW {ew:.2e} relative to the f32 kernels");
        assert!(
            ex > 0.0 && ex < 2e-3 && ew > 0.0 && ew < 2e-3,
            "dy ~ {scale:e}: dx {ex:.2e} dW {ew:.2e}"
        );
        let (dx2, dw2) = run(true);
        assert_eq!(
            (bits(&dx2), bits(&dw2)),
            (bits(&dx), bits(&dw)),
            "dy ~ {scale:e}: not deterministic"
        );
    }
}

/// The default-shaped test model at odd sizes (vocabulary 203, hidden 72, MLP 100).
fn model() -> ModelConfig {
    ModelConfig {
        vocab_size: 203,
        hidden_size: 72,
        intermediate_size: 100,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        max_position_embeddings: 64,
        ..ModelConfig::tiny()
    }
}

fn seqs() -> Vec<Sequence> {
    (0..5u32)
        .map(|i| Sequence {
            prompt: (0..3 + i).map(|t| (t * 11 + i * 7) % 203).collect(),
            response: (0..4 + 2 * i).map(|t| (t * 13 + i * 3 + 1) % 203).collect(),
        })
        .collect()
}

/// Whole-model log-probs against the CPU's f32 reference: f16 operands cost ~2^-11 relative
/// per product, compounded through 2 layers and the lm_head. Tol(3e-3, 3e-3) per element;
/// scoring a sequence alone gives the bits it gets among others; a lm_head split into
/// vocabulary chunks (a smaller binding limit) gives the same bits too.
#[test]
fn coop_scoring_is_close_to_the_cpu_and_batch_invariant() {
    let Some(g) = coop_gpu() else { return };
    let cfg = model();
    let w = Weights::random(&cfg, 21).unwrap();
    let mut be = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &w).unwrap();
    be.set_tensor_cores(true).unwrap();
    assert!(be.tensor_cores());
    let mut cpu = CpuBackend::new(&cfg, &w, 1).unwrap();
    let s = seqs();
    let got = be.logprobs(&s, 0.8).unwrap();
    let want = cpu.logprobs(&s, 0.8).unwrap();
    let mut worst = 0f32;
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_close(&format!("sequence {i}"), a, b, Tol(3e-3, 3e-3));
        worst = a
            .iter()
            .zip(b)
            .fold(worst, |m, (x, y)| m.max((x - y).abs()));
    }
    eprintln!("tensor-core log-probs vs cpu: worst |Δ| {worst:.2e}");
    // Not the f32 kernels' result: the tensor cores really ran.
    be.set_tensor_cores(false).unwrap();
    let plain = be.logprobs(&s, 0.8).unwrap();
    assert_ne!(bits(&plain.concat()), bits(&got.concat()));
    be.set_tensor_cores(true).unwrap();
    for (i, one) in s.iter().enumerate() {
        let alone = be.logprobs(std::slice::from_ref(one), 0.8).unwrap();
        assert_eq!(bits(&alone[0]), bits(&got[i]), "sequence {i} alone");
    }
    // 256 columns of 72 f32 per binding: the 203-row lm_head in one chunk of 256 rows at
    // most; 64 KiB caps nothing here, so cap at 256 * 72 * 4 / 2 rounded to 256: two chunks.
    be.cap_storage_binding(256 * 36 * 4).unwrap();
    let chunked = be.logprobs(&s, 0.8).unwrap();
    assert_eq!(
        bits(&chunked.concat()),
        bits(&got.concat()),
        "chunked lm_head"
    );
}

fn requests(cfg: &ModelConfig, n: u64) -> Vec<GenRequest> {
    (0..n)
        .map(|i| GenRequest {
            id: RequestKey(i),
            prompt: (0..2 + (i as usize * 3) % 7)
                .map(|t| ((t as u64 * 7 + i * 5) % cfg.vocab_size as u64) as u32)
                .collect(),
            params: SamplingParams {
                temperature: if i % 3 == 0 { 0.0 } else { 0.9 },
                top_k: if i % 3 == 2 { 6 } else { 0 },
                max_new_tokens: 4 + (i % 3) as usize,
                seed: 900 + i,
                ..Default::default()
            },
        })
        .collect()
}

/// Each request decodes to the same tokens and log-prob bits alone (one row per step) as
/// among eight others, on tensor cores, in f32 and bf16 weights.
#[test]
fn coop_decoding_is_batch_invariant() {
    let Some(g) = coop_gpu() else { return };
    let cfg = model();
    let w = Weights::random(&cfg, 22).unwrap();
    for dtype in [DType::F32, DType::Bf16] {
        let mut be = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &w, dtype).unwrap();
        be.set_tensor_cores(true).unwrap();
        let reqs = requests(&cfg, 9);
        let together = generate(&mut be, &reqs);
        assert_eq!(together.len(), reqs.len());
        for t in &together {
            let alone = generate(&mut be, std::slice::from_ref(&reqs[t.id.0 as usize]));
            assert_eq!(alone[0].tokens, t.tokens, "{dtype} request {}", t.id);
            assert_eq!(
                bits(&alone[0].logprobs),
                bits(&t.logprobs),
                "{dtype} request {}",
                t.id
            );
        }
    }
}

/// Training on tensor cores (forward and backward products): the gradient of every tensor is
/// within 2e-3 of the f32 kernels' gradient, relative to that tensor's norm (the forward's
/// f16 operands move the activations; the backward's move each product by ~2^-11).
#[test]
fn coop_training_gradients_are_close_to_the_f32_ones() {
    let Some(g) = coop_gpu() else { return };
    let cfg = model();
    let w = Weights::random(&cfg, 23).unwrap();
    let batch = TrainBatch {
        sequences: seqs()
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                TrainSequence::new(
                    s.prompt,
                    s.response,
                    0.5 - 0.3 * i as f64,
                    Aggregation::TokenMean,
                )
            })
            .collect(),
    };
    let obj = Objective::default();
    let grads = |tc: bool| {
        let mut be = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &w).unwrap();
        be.set_tensor_cores(tc).unwrap();
        be.zero_grad().unwrap();
        be.accumulate(&batch, &obj).unwrap();
        be.gradients().unwrap()
    };
    let (tc, f32g) = (grads(true), grads(false));
    let mut worst = 0f64;
    for (name, t) in &f32g.tensors {
        let a = &tc.tensors[name].data;
        let norm = t
            .data
            .iter()
            .map(|v| (*v as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let diff = a
            .iter()
            .zip(&t.data)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let rel = diff / norm.max(1e-30);
        worst = worst.max(rel);
        assert!(rel < 2e-3, "{name}: relative gradient difference {rel:.2e}");
    }
    assert!(
        worst > 0.0,
        "tensor cores changed no gradient: did they run?"
    );
    eprintln!("tensor-core gradients vs f32: worst relative difference {worst:.2e}");
}

/// Where the device has no cooperative matrices, turning tensor cores on is refused in one
/// line that names what is missing, and the backend keeps working on the f32 kernels.
#[test]
fn tensor_cores_are_refused_in_one_line_without_cooperative_matrices() {
    let Some(g) = device::gpu() else { return };
    let cfg = model();
    let w = Weights::random(&cfg, 24).unwrap();
    let mut be = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &w).unwrap();
    match g.coop_refusal() {
        Some(why) => {
            let e = be.set_tensor_cores(true).expect_err("refused").to_string();
            assert!(e.contains(why) && !e.contains('\n'), "{e}");
            assert!(
                e.contains("shader-f16") || e.contains("cooperative"),
                "names the feature: {e}"
            );
            assert!(!be.tensor_cores());
            be.logprobs(&seqs(), 1.0).expect("still scores on f32");
        }
        None => {
            be.set_tensor_cores(true).expect("has tensor cores");
            assert!(be.tensor_cores());
            be.set_tensor_cores(false).unwrap();
            assert!(!be.tensor_cores());
        }
    }
}
