//! The output projection fused with log-softmax and the target's log-prob, in vocabulary chunks.
//!
//! Training and scoring need, per scored row, only `logp[target]`, the entropy and the
//! log-sum-exp; the full `[rows × vocab]` logits (151,936 columns for Qwen3) and their gradient
//! never need to exist at once. The forward streams over [`VOCAB_CHUNK`] vocabulary rows at a
//! time with an online (rescaled) log-sum-exp; the backward recomputes each chunk's logits from
//! the saved log-sum-exp and adds that chunk's share of `dx` and `dW` before moving on, as flash
//! attention does along keys. Peak extra memory is `rows × VOCAB_CHUNK` values.
//!
//! The vocabulary reductions (Σ exp, Σ p·z) accumulate in f64 whatever `T` is, so a 151,936-term
//! sum loses nothing to f32 rounding. Each row is reduced by one task in chunk order, so results
//! do not depend on the number of threads or on the other rows.

use rayon::prelude::*;

use super::model::fit;
use super::ops::{Float, Mat, matmul_bwd, matmul_fwd};
use crate::model::VOCAB_CHUNK;

/// Running log-sum-exp state of one row: max, Σ e^(y−max), Σ e^(y−max)·y (f64).
#[derive(Debug, Clone, Copy)]
struct Lse {
    mx: f64,
    s: f64,
    sy: f64,
}

/// Forward: for each of the `m` rows of `x[m, d]`, with `z = x·wᵀ / temperature` over the
/// `v` rows of `w[v, d]`, writes `logp[r] = z[targets[r]] − lse[r]`, `entropy[r]` of
/// `softmax(z)` and `lse[r] = logsumexp(z)`. `scratch` is grow-only chunk storage.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_logprob_fwd<'a, T: Float>(
    logp: &mut [T],
    entropy: &mut [T],
    lse: &mut [T],
    x: &[T],
    w: impl Into<Mat<'a, T>>,
    targets: &[u32],
    m: usize,
    d: usize,
    v: usize,
    temperature: f64,
    scratch: &mut Vec<T>,
) {
    let w = w.into();
    let it = T::from_f64(1.0 / temperature);
    let mut st = vec![
        Lse {
            mx: f64::NEG_INFINITY,
            s: 0.0,
            sy: 0.0,
        };
        m
    ];
    let mut tz = vec![0.0f64; m];
    for c0 in (0..v).step_by(VOCAB_CHUNK) {
        let c = VOCAB_CHUNK.min(v - c0);
        fit(scratch, m * c);
        matmul_fwd(scratch, x, w.slice(c0 * d..(c0 + c) * d), m, d, c);
        scratch
            .par_chunks(c)
            .zip(st.par_iter_mut())
            .zip(tz.par_iter_mut())
            .enumerate()
            .for_each(|(r, ((z, st), tz))| {
                // y = z·(1/T) in T, the same scaled logit the decode path's sampler sees.
                let mut cm = f64::NEG_INFINITY;
                for zz in z {
                    cm = cm.max((*zz * it).to_f64());
                }
                let nm = st.mx.max(cm);
                // exp(−inf) = 0 on the first chunk.
                let rescale = (st.mx - nm).exp();
                let (mut a, mut b) = (0.0f64, 0.0f64);
                for zz in z {
                    let y = (*zz * it).to_f64();
                    let e = (y - nm).exp();
                    a += e;
                    b += e * y;
                }
                st.s = st.s * rescale + a;
                st.sy = st.sy * rescale + b;
                st.mx = nm;
                let t = targets[r] as usize;
                if (c0..c0 + c).contains(&t) {
                    *tz = (z[t - c0] * it).to_f64();
                }
            });
    }
    for r in 0..m {
        let l = st[r].mx + st[r].s.ln();
        lse[r] = T::from_f64(l);
        logp[r] = T::from_f64(tz[r] - l);
        entropy[r] = T::from_f64(l - st[r].sy / st[r].s);
    }
}

/// Backward of [`lm_head_logprob_fwd`] given `dlogp[m]`: adds
/// `dz[r, j] = dlogp[r]/T · (1[j = target] − p_j)` through the projection, i.e.
/// `dx[m, d] += dz·w` and `dw[v, d] += dzᵀ·x`, one vocabulary chunk at a time.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_logprob_bwd<T: Float>(
    dx: &mut [T],
    dw: &mut [T],
    dlogp: &[T],
    x: &[T],
    w: &[T],
    targets: &[u32],
    lse: &[T],
    m: usize,
    d: usize,
    v: usize,
    temperature: f64,
    scratch: &mut Vec<T>,
) {
    let it = T::from_f64(1.0 / temperature);
    for c0 in (0..v).step_by(VOCAB_CHUNK) {
        let c = VOCAB_CHUNK.min(v - c0);
        let wc = &w[c0 * d..(c0 + c) * d];
        fit(scratch, m * c);
        T::matmul_nt(scratch, x, wc, m, d, c);
        scratch.par_chunks_mut(c).enumerate().for_each(|(r, z)| {
            let g = dlogp[r] * it;
            let l = lse[r];
            for zz in z.iter_mut() {
                *zz = -g * (*zz * it - l).exp();
            }
            let t = targets[r] as usize;
            if (c0..c0 + c).contains(&t) {
                z[t - c0] += g;
            }
        });
        matmul_bwd(
            Some(&mut *dx),
            &mut dw[c0 * d..(c0 + c) * d],
            scratch,
            x,
            wc,
            m,
            d,
            c,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::{logprob_bwd, logprob_fwd, matmul_fwd};

    fn val(i: usize, seed: usize) -> f64 {
        (((i * 2654435761 + seed * 97) % 10007) as f64 / 10007.0 - 0.5) * 0.8
    }

    /// The fused, chunked op equals the unfused reference (full logits, then log-softmax) in f64,
    /// with a vocabulary spanning several chunks and a ragged last chunk.
    #[test]
    fn fused_equals_unfused_reference_f64() {
        let (m, d, v) = (5, 7, 2 * VOCAB_CHUNK + 123);
        let x: Vec<f64> = (0..m * d).map(|i| val(i, 1) * 4.0).collect();
        let w: Vec<f64> = (0..v * d).map(|i| val(i, 2)).collect();
        let targets: Vec<u32> = (0..m).map(|r| ((r * 7919 + 3) % v) as u32).collect();
        let dlogp: Vec<f64> = (0..m).map(|r| val(r, 3) * 3.0).collect();
        for temp in [1.0, 0.7] {
            let (mut lp, mut ent, mut lse) = (vec![0.0; m], vec![0.0; m], vec![0.0; m]);
            let mut scratch = Vec::new();
            lm_head_logprob_fwd(
                &mut lp,
                &mut ent,
                &mut lse,
                &x,
                &w,
                &targets,
                m,
                d,
                v,
                temp,
                &mut scratch,
            );
            let mut z = vec![0.0; m * v];
            matmul_fwd(&mut z, &x, &w, m, d, v);
            let (mut lp2, mut ent2, mut lse2) = (vec![0.0; m], vec![0.0; m], vec![0.0; m]);
            logprob_fwd(&mut lp2, &mut ent2, &mut lse2, &z, &targets, v, temp);
            for r in 0..m {
                // f64 throughout: only summation order differs.
                assert!((lp[r] - lp2[r]).abs() < 1e-12, "logp {r}");
                assert!((ent[r] - ent2[r]).abs() < 1e-12, "entropy {r}");
                assert!((lse[r] - lse2[r]).abs() < 1e-12, "lse {r}");
            }
            let (mut dx, mut dw) = (vec![0.0; m * d], vec![0.0; v * d]);
            lm_head_logprob_bwd(
                &mut dx,
                &mut dw,
                &dlogp,
                &x,
                &w,
                &targets,
                &lse,
                m,
                d,
                v,
                temp,
                &mut scratch,
            );
            let mut dz = vec![0.0; m * v];
            logprob_bwd(&mut dz, &dlogp, &z, &targets, &lse2, v, temp);
            let (mut dx2, mut dw2) = (vec![0.0; m * d], vec![0.0; v * d]);
            matmul_bwd(Some(&mut dx2), &mut dw2, &dz, &x, &w, m, d, v);
            for (a, b) in dx.iter().zip(&dx2) {
                assert!((a - b).abs() < 1e-12, "dx {a} vs {b}");
            }
            for (a, b) in dw.iter().zip(&dw2) {
                assert!((a - b).abs() < 1e-12, "dw {a} vs {b}");
            }
        }
    }

    /// In f32 the f64 accumulation keeps a 150k-entry log-sum-exp within a few f32 ulps of the
    /// exact value (an f32 serial sum drifts by ~1e-4 relative here), and each row's result is
    /// the same alone as inside a batch.
    #[test]
    fn f32_vocab_reduction_is_accurate_and_row_invariant() {
        let (m, d, v) = (3, 16, 150_001);
        let x: Vec<f32> = (0..m * d).map(|i| val(i, 4) as f32).collect();
        let w: Vec<f32> = (0..v * d).map(|i| val(i, 5) as f32).collect();
        let targets = vec![0u32, 77_777, 150_000];
        let (mut lp, mut ent, mut lse) = (vec![0.0f32; m], vec![0.0; m], vec![0.0; m]);
        let mut scratch = Vec::new();
        lm_head_logprob_fwd(
            &mut lp,
            &mut ent,
            &mut lse,
            &x,
            &w,
            &targets,
            m,
            d,
            v,
            1.0,
            &mut scratch,
        );
        let mut z = vec![0.0f32; m * v];
        matmul_fwd(&mut z, &x, &w, m, d, v);
        for r in 0..m {
            let zr = &z[r * v..(r + 1) * v];
            let mx = zr.iter().fold(f64::NEG_INFINITY, |a, b| a.max(*b as f64));
            let exact = mx + zr.iter().map(|y| (*y as f64 - mx).exp()).sum::<f64>().ln();
            // |lse| ≈ 12: a few ulps of f32 (1 ulp ≈ 1e-6) from rounding the f64 result.
            assert!(
                (lse[r] as f64 - exact).abs() < 4e-6,
                "row {r}: {} vs {exact}",
                lse[r]
            );
            let (mut a, mut b, mut c) = ([0.0f32], [0.0f32], [0.0f32]);
            lm_head_logprob_fwd(
                &mut a,
                &mut b,
                &mut c,
                &x[r * d..(r + 1) * d],
                &w,
                &targets[r..r + 1],
                1,
                d,
                v,
                1.0,
                &mut scratch,
            );
            assert_eq!((a[0], b[0], c[0]), (lp[r], ent[r], lse[r]), "row {r}");
        }
    }
}
