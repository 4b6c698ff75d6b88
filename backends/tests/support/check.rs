//! Shared checking helpers of the conformance suite: seeded inputs, tolerances and the
//! elementwise comparison every test uses.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

/// Tolerances: `atol + rtol·|want|`. f32 throughout; the reference sums in order, the
/// kernels in tiles and trees, so every entry is a small multiple of the rounding error a
/// reordered f32 sum of that length can produce (ε = 1.2e-7).
#[allow(dead_code)]
pub mod tol {
    /// `atol`, `rtol`.
    #[derive(Debug, Clone, Copy)]
    pub struct Tol(pub f32, pub f32);

    /// Copies and gathers move values bit for bit.
    pub const EXACT: Tol = Tol(0.0, 0.0);
    /// One or two f32 operations per element (add, silu, rope's rotation): a few ulps.
    pub const ELEMENTWISE: Tol = Tol(1e-6, 1e-5);
    /// Row reductions of ≤ 300 terms in a tree instead of a loop, then a rsqrt/exp/log:
    /// ~log2(n)·ε relative, plus the transcendental's own ulps.
    pub const REDUCTION: Tol = Tol(1e-5, 1e-4);
    /// Dot products of length ≤ 256 with fma in another order; inputs in [−1, 1] keep the
    /// absolute error near K·ε·max|x·w| ≈ 3e-5.
    pub const MATMUL: Tol = Tol(5e-5, 1e-4);
    /// Attention: online softmax (rescaled running sums) against the reference's two-pass
    /// softmax, plus the score dot products; the backward recomputes P from the saved
    /// log-sum-exp (≈ 1e-6 relative), then sums over up to 70 keys and 4 heads.
    pub const ATTENTION: Tol = Tol(1e-5, 2e-4);
    /// AdamW: the same f32 formula; √ and ÷ may round differently (a few ulps of the
    /// update, which is ≤ lr).
    pub const ADAMW: Tol = Tol(1e-7, 1e-5);
    /// Whole-model logits and log-probs (4 layers of the above compounding): relative to
    /// the values' scale.
    pub const MODEL: Tol = Tol(2e-4, 1e-3);
    /// Loss sums over ~100 tokens, in a tree (kernel) vs f64 (reference).
    pub const LOSS: Tol = Tol(1e-5, 1e-4);
    /// Gradient sums: every parameter gradient is a sum over all rows of a product chain
    /// through the whole model; compared relative to the tensor's largest entry (see
    /// `assert_close_scaled`), 1e-3 of it leaves room for compounded reordering.
    pub const GRAD: Tol = Tol(0.0, 1e-3);
    /// Weights after one AdamW step from gradients that carry GRAD's error: the Adam update
    /// is lr·m/(√v+eps) ≈ ±lr on the first step, so a gradient error moves the weight by at
    /// most lr·(relative error) where the gradient is tiny relative to eps; lr = 1e-3.
    pub const STEP: Tol = Tol(2e-5, 1e-4);
}
pub use tol::Tol;

/// `n` values uniform in [−scale, scale), never all zeros.
pub fn rand_vec(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale)
        .collect()
}

pub fn rand_ids(rng: &mut ChaCha8Rng, n: usize, below: usize) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_u64() % below as u64) as u32)
        .collect()
}

/// Checks `got` against `want` elementwise; reports up to 5 mismatches, then fails.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], t: Tol) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut bad = Vec::new();
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let lim = t.0 + t.1 * w.abs();
        if err.is_nan() || err > lim {
            bad.push((i, *g, *w, err));
        }
        worst = worst.max(err);
    }
    if !bad.is_empty() {
        for (i, g, w, e) in bad.iter().take(5) {
            eprintln!(
                "{what}[{i}]: got {g} want {w} (err {e:e}, limit {:e})",
                t.0 + t.1 * w.abs()
            );
        }
        panic!(
            "{what}: {} of {} values outside atol {:e} + rtol {:e}·|want| (worst {worst:e})",
            bad.len(),
            got.len(),
            t.0,
            t.1
        );
    }
}

/// As [`assert_close`] with the absolute part scaled by the largest |want| (for gradients,
/// whose entries span orders of magnitude and sum many terms).
#[track_caller]
pub fn assert_close_scaled(what: &str, got: &[f32], want: &[f32], t: Tol) {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    assert_close(what, got, want, Tol(t.0 + t.1 * scale, t.1));
}
