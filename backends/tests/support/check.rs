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
    /// Whole-model logits and log-probs (4 layers of the above compounding), per element:
    /// the worst logit needed 4e-6 beyond 1e-3·|z| (|z| ≤ 4.1, small model on lavapipe).
    pub const MODEL: Tol = Tol(2e-4, 1e-3);
    /// Loss sums over ~100 tokens, in a tree (kernel) vs f64 (reference).
    pub const LOSS: Tol = Tol(1e-5, 1e-4);
    /// Gradient sums, per element: every parameter gradient is a sum over all rows of a
    /// product chain through the whole model, so both the relative error (compounded
    /// reordering, ≤ 1.2e-3 measured) and, where terms cancel, an absolute one remain. At the
    /// conformance sizes (gradients up to |24|) the worst element needed 8e-6 beyond
    /// 1e-3·|g| (layer 0's v_proj, wgpu on lavapipe); atol 5e-5 leaves 6x. (Was 1e-3 of the
    /// tensor's largest entry: up to 0.024 of slack on any element.)
    pub const GRAD: Tol = Tol(5e-5, 1e-3);
    /// AdamW's first moment after one step, m = (1−β1)·c·g with the clip scale c ≤ 1:
    /// GRAD scaled by 1−β1 = 0.1.
    pub const ADAM_M: Tol = Tol(5e-6, 1e-3);
    /// The second moment, v = (1−β2)·(c·g)²: |δv| ≤ 2(1−β2)·|cg|·|δg|, which with GRAD's
    /// bound on δg and |cg| ≤ 1 (the clipped gradient's norm is ≤ 1) is at most
    /// 2(1−β2)·5e-5 + 2e-3·v.
    pub const ADAM_V: Tol = Tol(1e-7, 2e-3);
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

/// The first element of `got` outside `atol + rtol·|want|` of `want` (NaN counts as
/// outside), with how many are outside: `(index, got, want, limit, count)`.
pub fn first_mismatch(got: &[f32], want: &[f32], t: Tol) -> Option<(usize, f32, f32, f32, usize)> {
    let mut first = None;
    let mut count = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let lim = t.0 + t.1 * w.abs();
        let err = (g - w).abs();
        // A NaN difference (NaN or opposite infinities) fails too.
        if err.is_nan() || err > lim {
            count += 1;
            first.get_or_insert((i, g, w, lim));
        }
    }
    first.map(|(i, g, w, lim)| (i, g, w, lim, count))
}

/// Checks `got` against `want` element by element: each `|got[i] − want[i]|` must be at
/// most `atol + rtol·|want[i]|`, with the tolerance of that element alone (never scaled
/// by the tensor's largest entry). Reports up to 5 mismatches, then fails naming the first
/// one's index and values.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], t: Tol) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let Some((i, g, w, lim, count)) = first_mismatch(got, want, t) else {
        return;
    };
    let mut shown = 0;
    for (j, (gj, wj)) in got.iter().zip(want).enumerate() {
        let limj = t.0 + t.1 * wj.abs();
        let errj = (gj - wj).abs();
        if (errj.is_nan() || errj > limj) && shown < 5 {
            eprintln!("{what}[{j}]: got {gj} want {wj} (err {errj:e}, limit {limj:e})");
            shown += 1;
        }
    }
    panic!(
        "{what}[{i}]: got {g} want {w}: |err| {:e} > {lim:e} = atol {:e} + rtol {:e}·|want| \
         ({count} of {} values outside)",
        (g - w).abs(),
        t.0,
        t.1,
        got.len()
    );
}

/// As [`assert_close`] with the absolute part scaled by the largest |want|. Only the CUDA
/// tensor-core test still uses it (sums of up to 1,024 bf16 products, not run here).
#[cfg(feature = "cuda")]
#[track_caller]
pub fn assert_close_scaled(what: &str, got: &[f32], want: &[f32], t: Tol) {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    assert_close(what, got, want, Tol(t.0 + t.1 * scale, t.1));
}

/// `want` with its largest-magnitude element moved just past its limit under `t` (at least
/// one ulp): what a check with `t` must reject. `None` for an empty slice.
pub fn perturbed(want: &[f32], t: Tol) -> Option<(usize, Vec<f32>)> {
    let (i, &w) = want
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))?;
    let lim = t.0 + t.1 * w.abs();
    let mut delta = (1.5 * lim).max(f32::MIN_POSITIVE);
    let mut got = want.to_vec();
    // Double until the rounded value is really outside (a limit below half an ulp of w
    // would otherwise round back onto w).
    while ((w + delta) - w).abs() <= lim {
        delta *= 2.0;
    }
    got[i] = w + delta;
    Some((i, got))
}

/// Fails unless a check with `t` rejects `want` perturbed at one element ([`perturbed`]):
/// a tolerance this loose would pass anything, so the comparison it guards proves nothing.
#[track_caller]
pub fn assert_can_fail(what: &str, want: &[f32], t: Tol) {
    let Some((i, got)) = perturbed(want, t) else {
        return;
    };
    let caught = first_mismatch(&got, want, t);
    assert_eq!(
        caught.map(|m| m.0),
        Some(i),
        "{what}: a value moved past its limit at [{i}] was not caught"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> Option<String> {
        let r = std::panic::catch_unwind(f).err()?;
        r.downcast_ref::<String>()
            .cloned()
            .or_else(|| r.downcast_ref::<&str>().map(|s| s.to_string()))
    }

    /// Each tolerance of the table rejects a value moved just past its own element's limit
    /// and accepts one just inside it, and the failure names the element and its values.
    #[test]
    fn every_tolerance_rejects_a_perturbed_element() {
        let want = [0.0f32, -3.5, 1e-4, 250.0, -0.02];
        let all = [
            tol::EXACT,
            tol::ELEMENTWISE,
            tol::REDUCTION,
            tol::MATMUL,
            tol::ATTENTION,
            tol::ADAMW,
            tol::MODEL,
            tol::LOSS,
            tol::GRAD,
            tol::ADAM_M,
            tol::ADAM_V,
            tol::STEP,
        ];
        for t in all {
            for i in 0..want.len() {
                let lim = t.0 + t.1 * want[i].abs();
                // Just inside: passes.
                let mut inside = want;
                inside[i] = want[i] + 0.5 * lim;
                assert!(first_mismatch(&inside, &want, t).is_none(), "{t:?} [{i}]");
                // Just outside this element's own limit: fails, at that element, even
                // where another element (250.0) is far larger.
                let mut got = want;
                let mut d = (1.5 * lim).max(f32::MIN_POSITIVE);
                while ((want[i] + d) - want[i]).abs() <= lim {
                    d *= 2.0;
                }
                got[i] = want[i] + d;
                let m = first_mismatch(&got, &want, t).expect("caught");
                assert_eq!((m.0, m.1, m.2, m.4), (i, got[i], want[i], 1), "{t:?}");
                let msg = panic_message(move || assert_close("x", &got, &want, t)).unwrap();
                assert!(
                    msg.starts_with(&format!("x[{i}]: got {} want {}", got[i], want[i])),
                    "{msg}"
                );
            }
            assert_can_fail("table", &want, t);
        }
    }

    #[test]
    fn nan_and_infinity_fail() {
        for bad in [f32::NAN, f32::INFINITY] {
            let msg =
                panic_message(move || assert_close("y", &[1.0, bad], &[1.0, 1.0], Tol(1e9, 1.0)))
                    .expect("fails");
            assert!(msg.starts_with("y[1]: got"), "{msg}");
        }
    }

    /// The old check scaled atol by the largest |want|, so a small entry beside a large one
    /// could be wrong by 100 %; the per-element check rejects it.
    #[test]
    fn a_small_entry_is_not_excused_by_a_large_one() {
        let want = [1000.0f32, 0.01];
        let got = [1000.0f32, 0.02];
        assert_eq!(first_mismatch(&got, &want, tol::GRAD).map(|m| m.0), Some(1));
    }
}
