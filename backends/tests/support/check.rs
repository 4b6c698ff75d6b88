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
    first_mismatch_by(got, want, |_, w| t.0 + t.1 * w.abs())
}

/// As [`first_mismatch`] with element `i`'s limit `lim(i, want[i])`.
fn first_mismatch_by(
    got: &[f32],
    want: &[f32],
    lim: impl Fn(usize, f32) -> f32,
) -> Option<(usize, f32, f32, f32, usize)> {
    let mut first = None;
    let mut count = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let lim = lim(i, w);
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
    let rule = format!("atol {:e} + rtol {:e}·|want|", t.0, t.1);
    assert_close_by(what, got, want, |_, w| t.0 + t.1 * w.abs(), &rule);
}

/// Checks a product element by element where each output is a sum of `k` exact products
/// (bf16 operands multiply exactly in f32) added in an order the test does not know: a
/// tensor-core accumulator, against the reference's ascending chain. Element i may differ by
/// `c_k·abs[i]`, with `abs[i]` the same sum over the products' absolute values, so each
/// element's limit comes from its own terms alone, never from the tensor's largest entry.
///
/// `c_k = min(2·γ_k, 4·√k·u)` with `u = 2⁻²³` (f32's epsilon, not the unit roundoff 2⁻²⁴, so
/// that an accumulator which truncates is covered too) and `γ_k = k·u / (1 − k·u)`:
/// - `2·γ_k·abs[i]` is the forward-error bound of a summation in any order (Higham, Accuracy
///   and Stability of Numerical Algorithms, §4.2), once for each side; it holds for any data
///   but grows with k (0.06 at k = 1,024 for terms in [−1, 1]: it would pass a dropped term);
/// - `4·√k·u·abs[i]` is the scale of the error when the terms have random signs, as in the
///   tests that use this: the partial sums then grow as √i, and even a truncating
///   accumulator's bias, about `u·k^1.5·σ/3` for terms of deviation σ, stays 9x below it. For
///   terms of one sign (partial sums growing as i) it would not hold.
#[track_caller]
#[allow(dead_code)]
pub fn assert_close_dot(what: &str, got: &[f32], want: &[f32], abs: &[f32], k: usize) {
    assert_eq!(abs.len(), want.len(), "{what}: length of abs");
    let (kf, u) = (k as f64, f64::from(f32::EPSILON));
    assert!(kf * u < 0.5, "{what}: k = {k} is too long for the bound");
    let c = dot_factor(k);
    let rule = format!("{c:e}·Σ|terms| (k = {k})");
    assert_close_by(what, got, want, |i, _| c * abs[i], &rule);
}

/// [`assert_close_dot`]'s `c_k`, with 1% on top for `abs` itself (summed in f32, its own
/// relative error is below γ_k, far under 1%).
fn dot_factor(k: usize) -> f32 {
    let (kf, u) = (k as f64, f64::from(f32::EPSILON));
    let gamma = kf * u / (1.0 - kf * u);
    ((2.0 * gamma).min(4.0 * kf.sqrt() * u) * 1.01) as f32
}

#[track_caller]
fn assert_close_by(
    what: &str,
    got: &[f32],
    want: &[f32],
    lim: impl Fn(usize, f32) -> f32,
    rule: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let Some((i, g, w, l, count)) = first_mismatch_by(got, want, &lim) else {
        return;
    };
    let mut shown = 0;
    for (j, (gj, wj)) in got.iter().zip(want).enumerate() {
        let limj = lim(j, *wj);
        let errj = (gj - wj).abs();
        if (errj.is_nan() || errj > limj) && shown < 5 {
            eprintln!("{what}[{j}]: got {gj} want {wj} (err {errj:e}, limit {limj:e})");
            shown += 1;
        }
    }
    panic!(
        "{what}[{i}]: got {g} want {w}: |err| {:e} > {l:e} = {rule} ({count} of {} values outside)",
        (g - w).abs(),
        got.len()
    );
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

    /// The dot-product bound holds for a sum in another order (here reversed, of products of
    /// bf16-exact operands), and an element moved just past its own limit fails, also where
    /// the element is small (row 3: one large product among tiny ones that nearly cancel).
    #[test]
    fn dot_bound_accepts_a_reordered_sum_and_rejects_past_its_limit() {
        let mut rng = <ChaCha8Rng as rand_chacha::rand_core::SeedableRng>::seed_from_u64(5);
        let k = 3000;
        let bf = |x: f32| f32::from_bits(x.to_bits() & 0xffff_0000);
        let a: Vec<f32> = rand_vec(&mut rng, 4 * k, 1.0).into_iter().map(bf).collect();
        let b: Vec<f32> = rand_vec(&mut rng, 4 * k, 1.0).into_iter().map(bf).collect();
        let term = |r: usize, i: usize| {
            let scale = if r == 3 && i > 0 { 1.0 / 1024.0 } else { 1.0 };
            a[r * k + i] * b[r * k + i] * scale
        };
        let (mut want, mut got, mut abs) = (vec![], vec![], vec![]);
        for r in 0..4 {
            want.push((0..k).fold(0.0f32, |s, i| s + term(r, i)));
            got.push((0..k).rev().fold(0.0f32, |s, i| s + term(r, i)));
            abs.push((0..k).fold(0.0f32, |s, i| s + term(r, i).abs()));
        }
        assert_ne!(got, want, "the reversed order rounds differently");
        assert_close_dot("reordered", &got, &want, &abs, k);
        // At k = 3,000 the random-sign scale is the smaller one: 4·√k·u·1.01 ≈ 2.638e-5.
        assert!((dot_factor(k) - 2.638e-5).abs() < 1e-8, "{}", dot_factor(k));
        assert_eq!(
            dot_factor(1),
            (2.0 * f64::from(f32::EPSILON) / (1.0 - f64::from(f32::EPSILON)) * 1.01) as f32
        );
        for i in 0..4 {
            let lim = dot_factor(k) * abs[i];
            let mut bad = want.clone();
            bad[i] = want[i] + 1.5 * lim;
            let (w, a2) = (want.clone(), abs.clone());
            let msg = panic_message(move || assert_close_dot("p", &bad, &w, &a2, k)).unwrap();
            assert!(msg.starts_with(&format!("p[{i}]:")), "{msg}");
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
