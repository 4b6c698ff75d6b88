//! The op-level conformance tests, written once against [`OpRunner`] and instantiated per
//! backend by [`op_suite!`](crate::op_suite): every op on fresh seeded random inputs (never
//! zeros) at several sizes, including sizes that are not multiples of the tiles and
//! workgroups and the multi-chunk paths (attention over more than 64 keys), each compared with
//! the CPU reference (`cpu::ops`, called directly) under the [`tol`] entry that says why the
//! two may differ.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rolloutpipe_backends::SamplingParams;
use rolloutpipe_backends::cpu::ops as cpu;

use super::check::{assert_close, rand_ids, rand_vec, tol};
pub use super::op_shapes::production_shapes;
use super::ops::{Adam, LossInputs, LossKind, OpRunner};

/// One `#[test]` per op test for the backend built by `$make` (an `Option<impl OpRunner>`;
/// `None` means the machine lacks the device, and the constructor has already said so).
/// A new backend adds one line to `conformance.rs`: `op_suite!(cuda_ops, CudaOps::new());`.
#[macro_export]
macro_rules! op_suite {
    ($name:ident, $make:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            $crate::op_suite!(@tests $make;
                embedding_fwd_bwd, rmsnorm_fwd_bwd, matmul_fwd_bwd, rope_fwd_bwd,
                attention_fwd_bwd_packed, attention_rows_are_packing_invariant,
                attention_rows_are_tile_invariant,
                attention_fwd_decode_chunk_against_cache,
                swiglu_and_residual, logprob_fwd_bwd, grpo_loss_fwd_bwd, adamw_three_steps,
                grad_norm_sum_of_squares, sample_matches_cpu_draws,
                sample_selection_edge_cases, production_shapes);
        }
    };
    (@tests $make:expr; $($t:ident),*) => {
        $(
            #[test]
            fn $t() {
                if let Some(mut b) = $make {
                    $crate::support::op_tests::$t(&mut b);
                }
            }
        )*
    };
}

pub fn embedding_fwd_bwd(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for &(v, dim, n) in &[(50, 8, 1), (50, 130, 37), (7, 33, 300)] {
        let table = rand_vec(&mut rng, v * dim, 1.0);
        let ids = rand_ids(&mut rng, n, v);
        let dout = rand_vec(&mut rng, n * dim, 1.0);
        let dtable0 = rand_vec(&mut rng, v * dim, 1.0);
        let mut out = vec![0.0; n * dim];
        cpu::embedding_fwd(&mut out, &ids, &table, dim);
        let mut dtable = dtable0.clone();
        cpu::embedding_bwd(&mut dtable, &dout, &ids, dim);
        let got = b.embedding_fwd(&table, &ids, v, dim);
        assert_close("embedding_fwd", &got, &out, tol::EXACT);
        let mut gd = dtable0;
        b.embedding_bwd(&mut gd, &dout, &ids, dim);
        // Same additions in the same (token) order per element.
        assert_close("embedding_bwd", &gd, &dtable, tol::EXACT);
    }
}

pub fn rmsnorm_fwd_bwd(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for &(rows, dim) in &[(1, 4), (5, 32), (67, 130), (300, 8)] {
        // Column sums of ≤ 300 rows in chunks (wgpu: two stages) instead of one loop.
        check_rmsnorm(b, &mut rng, rows, dim, "");
    }
}

/// RMSNorm forward and backward of `rows` × `dim` random rows against the CPU reference;
/// `tag` prefixes the assertion names.
pub fn check_rmsnorm(
    b: &mut impl OpRunner,
    rng: &mut ChaCha8Rng,
    rows: usize,
    dim: usize,
    tag: &str,
) {
    let x = rand_vec(rng, rows * dim, 2.0);
    let w = rand_vec(rng, dim, 1.5);
    let dout = rand_vec(rng, rows * dim, 1.0);
    let (dx0, dw0) = (rand_vec(rng, rows * dim, 1.0), rand_vec(rng, dim, 1.0));
    let (mut out, mut rstd) = (vec![0.0; rows * dim], vec![0.0; rows]);
    cpu::rmsnorm_fwd(&mut out, &mut rstd, &x, &w, dim, 1e-6);
    let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
    cpu::rmsnorm_bwd(&mut dx, &mut dw, &dout, &x, &w, &rstd, dim);
    let (gout, grstd) = b.rmsnorm_fwd(&x, &w, dim, 1e-6);
    assert_close(
        &format!("{tag}rmsnorm_fwd out"),
        &gout,
        &out,
        tol::REDUCTION,
    );
    assert_close(
        &format!("{tag}rmsnorm_fwd rstd"),
        &grstd,
        &rstd,
        tol::REDUCTION,
    );
    // The backward reads the backend's own saved rstd, as in the model.
    let (mut gdx, mut gdw) = (dx0, dw0);
    b.rmsnorm_bwd(&mut gdx, &mut gdw, &dout, &x, &w, &grstd, dim);
    assert_close(&format!("{tag}rmsnorm_bwd dx"), &gdx, &dx, tol::REDUCTION);
    assert_close(&format!("{tag}rmsnorm_bwd dw"), &gdw, &dw, tol::REDUCTION);
}

pub fn matmul_fwd_bwd(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    // n <= 8 runs wgpu's row-strip entry point (8 and 9 sit on both sides of the switch;
    // din = 300 spans two 256-wide K stages there; 68 x 132 -> 76 takes wgpu's vector loads
    // forward and backward with no dimension a whole tile).
    for &(n, din, dout) in &[
        (1, 8, 5),
        (3, 17, 70),
        (8, 300, 300),
        (9, 64, 33),
        (65, 130, 67),
        (68, 132, 76),
        (128, 64, 200),
    ] {
        check_matmul(b, &mut rng, n, din, dout, "");
    }
}

/// The projection `y = x Wᵀ` and its backward (dx, dW accumulated onto random starts) of an
/// `n` × `din` → `dout` product against the CPU reference; `tag` prefixes the assertion names.
pub fn check_matmul(
    b: &mut impl OpRunner,
    rng: &mut ChaCha8Rng,
    n: usize,
    din: usize,
    dout: usize,
    tag: &str,
) {
    let x = rand_vec(rng, n * din, 1.0);
    let w = rand_vec(rng, dout * din, 1.0);
    let dy = rand_vec(rng, n * dout, 1.0);
    let (dx0, dw0) = (rand_vec(rng, n * din, 1.0), rand_vec(rng, dout * din, 1.0));
    let mut y = vec![0.0; n * dout];
    cpu::matmul_fwd(&mut y, &x, &w, n, din, dout);
    let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
    cpu::matmul_bwd(Some(&mut dx), &mut dw, &dy, &x, &w, n, din, dout);
    let gy = b.matmul_fwd(&x, &w, n, din, dout);
    let (mut gdx, mut gdw) = (dx0, dw0);
    b.matmul_bwd(&mut gdx, &mut gdw, &dy, &x, &w, n, din, dout);
    let what = format!("{tag}matmul {n}x{din}->{dout}");
    assert_close(&format!("{what} y"), &gy, &y, tol::MATMUL);
    assert_close(&format!("{what} dx"), &gdx, &dx, tol::MATMUL);
    assert_close(&format!("{what} dw"), &gdw, &dw, tol::MATMUL);
}

pub fn rope_fwd_bwd(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    for &(rows, heads, hd, maxp) in &[(7, 1, 4, 16), (33, 4, 32, 512), (5, 2, 128, 4096)] {
        let table = cpu::RopeTable::<f32>::new(hd, 10_000.0, maxp);
        let x = rand_vec(&mut rng, rows * heads * hd, 1.0);
        let pos = rand_ids(&mut rng, rows, maxp);
        let mut y = x.clone();
        cpu::rope_fwd(&mut y, &pos, heads, &table);
        let mut g = x.clone();
        cpu::rope_bwd(&mut g, &pos, heads, &table);
        let (mut gy, mut gg) = (x.clone(), x);
        b.rope_fwd(&mut gy, &pos, heads, &table);
        b.rope_bwd(&mut gg, &pos, heads, &table);
        assert_close("rope_fwd", &gy, &y, tol::ELEMENTWISE);
        assert_close("rope_bwd", &gg, &g, tol::ELEMENTWISE);
    }
}

pub fn attention_fwd_bwd_packed(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    // Sequence lengths cover one key, a partial chunk and more than one 64-key chunk;
    // (16, 1, 128) has more query heads than the wgpu backward's workgroup has slots.
    for &(h, kvh, hd) in &[(4, 2, 4), (2, 2, 32), (4, 1, 96), (16, 1, 128)] {
        let lens = [1usize, 5, 70];
        let n: usize = lens.iter().sum();
        let (qd, kd) = (h * hd, kvh * hd);
        let q = rand_vec(&mut rng, n * qd, 1.0);
        let k = rand_vec(&mut rng, n * kd, 1.0);
        let v = rand_vec(&mut rng, n * kd, 1.0);
        let dout = rand_vec(&mut rng, n * qd, 1.0);
        // The reference: one causal attention per sequence.
        let (mut out, mut dq, mut dk, mut dv) = (
            vec![0.0; n * qd],
            vec![0.0; n * qd],
            vec![0.0; n * kd],
            vec![0.0; n * kd],
        );
        let mut s = 0;
        for &m in &lens {
            let mut att = vec![0.0; h * m * m];
            let (qs, ks) = (s * qd..(s + m) * qd, s * kd..(s + m) * kd);
            cpu::attention_fwd(
                &mut out[qs.clone()],
                &mut att,
                &q[qs.clone()],
                &k[ks.clone()],
                &v[ks.clone()],
                m,
                m,
                h,
                kvh,
                hd,
            );
            let mut scratch = vec![0.0; m];
            cpu::attention_bwd(
                &mut dq[qs.clone()],
                &mut dk[ks.clone()],
                &mut dv[ks.clone()],
                &mut scratch,
                &dout[qs.clone()],
                &att,
                &q[qs],
                &k[ks.clone()],
                &v[ks],
                m,
                m,
                h,
                kvh,
                hd,
            );
            s += m;
        }
        let [gout, gdq, gdk, gdv] = b.attention_packed(&q, &k, &v, &dout, &lens, h, kvh, hd);
        let what = format!("attention h{h} kvh{kvh} hd{hd}");
        assert_close(&format!("{what} out"), &gout, &out, tol::ATTENTION);
        assert_close(&format!("{what} dq"), &gdq, &dq, tol::ATTENTION);
        assert_close(&format!("{what} dk"), &gdk, &dk, tol::ATTENTION);
        assert_close(&format!("{what} dv"), &gdv, &dv, tol::ATTENTION);
    }
}

/// The (heads, kv heads, head_dim) of the attention invariance tests: G = 1, 2, 4 and 16
/// (more query heads than the wgpu kernel's workgroup holds at head_dim 128, so a group's
/// heads are split), head_dim 16, 32, 128 and 256 (one to four output dims a thread,
/// tiles of 1 to 32 rows).
const ATTENTION_INVARIANCE_SHAPES: [(usize, usize, usize); 6] = [
    (4, 2, 32),
    (8, 2, 16),
    (2, 2, 128),
    (8, 2, 128),
    (16, 1, 128),
    (4, 2, 256),
];

/// A sequence's attention outputs and gradients are bit-identical whether it is packed
/// alone or after sequences of odd lengths and before another one (which shift where the
/// wgpu kernel's query tiles fall in the launch and which other rows share it): each row
/// must run the same arithmetic whatever its neighbours. Sequences of 75 rows (more than
/// one tile and one key chunk, a multiple of neither) and of 3 (shorter than a tile).
pub fn attention_rows_are_packing_invariant(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for &(h, kvh, hd) in &ATTENTION_INVARIANCE_SHAPES {
        let (qd, kd) = (h * hd, kvh * hd);
        for m in [75usize, 3] {
            let (q, k, v, dout) = (
                rand_vec(&mut rng, m * qd, 1.0),
                rand_vec(&mut rng, m * kd, 1.0),
                rand_vec(&mut rng, m * kd, 1.0),
                rand_vec(&mut rng, m * qd, 1.0),
            );
            let alone = b.attention_packed(&q, &k, &v, &dout, &[m], h, kvh, hd);
            let after = 6;
            for before in [1usize, 13, 37] {
                let pad = |x: &[f32], w: usize| {
                    let mut r = ChaCha8Rng::seed_from_u64(before as u64);
                    let mut y = rand_vec(&mut r, before * w, 1.0);
                    y.extend_from_slice(x);
                    y.extend(rand_vec(&mut r, after * w, 1.0));
                    y
                };
                let got = b.attention_packed(
                    &pad(&q, qd),
                    &pad(&k, kd),
                    &pad(&v, kd),
                    &pad(&dout, qd),
                    &[before, m, after],
                    h,
                    kvh,
                    hd,
                );
                let widths = [qd, qd, kd, kd];
                for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
                    let mid = &got[i][before * widths[i]..(before + m) * widths[i]];
                    let same = mid
                        .iter()
                        .zip(&alone[i])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "attention {name} h{h} kvh{kvh} hd{hd} m{m}: rows differ after {before}"
                    );
                }
            }
        }
    }
}

/// A row's attention output is bit-identical whether all of its sequence's rows are
/// queried (packed training/scoring) or only the last few (a prefill chunk against the KV
/// cache, whose first query is not at the start of a wgpu query tile): the tiles that rows
/// share then differ, so this catches arithmetic that depends on the tile's first row.
pub fn attention_rows_are_tile_invariant(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    for &(h, kvh, hd) in &ATTENTION_INVARIANCE_SHAPES {
        let (qd, kd) = (h * hd, kvh * hd);
        let m = 75;
        let (q, k, v, dout) = (
            rand_vec(&mut rng, m * qd, 1.0),
            rand_vec(&mut rng, m * kd, 1.0),
            rand_vec(&mut rng, m * kd, 1.0),
            rand_vec(&mut rng, m * qd, 1.0),
        );
        let [all, ..] = b.attention_packed(&q, &k, &v, &dout, &[m], h, kvh, hd);
        for nq in [1usize, 5, 62] {
            let got = b.attention_chunk_fwd(&q[(m - nq) * qd..], &k, &v, nq, m, h, kvh, hd);
            let same = got
                .iter()
                .zip(&all[(m - nq) * qd..])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "attention out h{h} kvh{kvh} hd{hd}: the last {nq} rows queried alone differ"
            );
        }
    }
}

pub fn attention_fwd_decode_chunk_against_cache(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    // Two new queries at positions 5 and 6 of a request with 7 keys, the CPU reference's
    // nq < nk form (the wgpu runner places the keys inside a larger cache, as a slot would).
    let (h, kvh, hd, nq, nk) = (4, 2, 32, 2, 7);
    let (qd, kd) = (h * hd, kvh * hd);
    let q = rand_vec(&mut rng, nq * qd, 1.0);
    let k = rand_vec(&mut rng, nk * kd, 1.0);
    let v = rand_vec(&mut rng, nk * kd, 1.0);
    let mut out = vec![0.0; nq * qd];
    let mut att = vec![0.0; h * nq * nk];
    cpu::attention_fwd(&mut out, &mut att, &q, &k, &v, nq, nk, h, kvh, hd);
    let got = b.attention_chunk_fwd(&q, &k, &v, nq, nk, h, kvh, hd);
    assert_close("attention decode chunk", &got, &out, tol::ATTENTION);
}

pub fn swiglu_and_residual(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for &n in &[7usize, 1000, 70_000] {
        let (g, u, dout) = (
            rand_vec(&mut rng, n, 4.0),
            rand_vec(&mut rng, n, 2.0),
            rand_vec(&mut rng, n, 1.0),
        );
        let (mut out, mut dg, mut du, mut sum) =
            (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        cpu::swiglu_fwd(&mut out, &g, &u);
        cpu::swiglu_bwd(&mut dg, &mut du, &dout, &g, &u);
        cpu::residual_fwd(&mut sum, &g, &u);
        let (gdg, gdu) = b.swiglu_bwd(&dout, &g, &u);
        assert_close("swiglu_fwd", &b.swiglu_fwd(&g, &u), &out, tol::ELEMENTWISE);
        assert_close("swiglu_bwd dgate", &gdg, &dg, tol::ELEMENTWISE);
        assert_close("swiglu_bwd dup", &gdu, &du, tol::ELEMENTWISE);
        // One f32 addition, same operands: bit-identical.
        assert_close("residual_fwd", &b.residual_fwd(&g, &u), &sum, tol::EXACT);
    }
}

pub fn logprob_fwd_bwd(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    for &(rows, v, temp) in &[(1, 11, 1.0), (9, 300, 0.7), (4, 5000, 1.3)] {
        let z = rand_vec(&mut rng, rows * v, 5.0);
        let t = rand_ids(&mut rng, rows, v);
        let dlp = rand_vec(&mut rng, rows, 1.0);
        let (mut lp, mut ent, mut lse) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        cpu::logprob_fwd(&mut lp, &mut ent, &mut lse, &z, &t, v, temp);
        let mut dz = vec![0.0; rows * v];
        cpu::logprob_bwd(&mut dz, &dlp, &z, &t, &lse, v, temp);
        let (glp, gent) = b.logprob_fwd(&z, &t, v, temp);
        assert_close("logprob_fwd logp", &glp, &lp, tol::REDUCTION);
        assert_close("logprob_fwd entropy", &gent, &ent, tol::REDUCTION);
        let gdz = b.logprob_bwd(&dlp, &z, &t, v, temp);
        assert_close("logprob_bwd", &gdz, &dz, tol::REDUCTION);
    }
}

pub fn grpo_loss_fwd_bwd(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    let n = 97;
    let logp: Vec<f32> = rand_vec(&mut rng, n, 1.5).iter().map(|x| x - 1.6).collect();
    let noise = rand_vec(&mut rng, n, 0.4);
    let noise2 = rand_vec(&mut rng, n, 0.3);
    let adv = rand_vec(&mut rng, n, 2.0);
    let w: Vec<f32> = rand_vec(&mut rng, n, 0.45)
        .iter()
        .map(|x| x + 0.55)
        .collect();
    let ent: Vec<f32> = rand_vec(&mut rng, n, 1.0).iter().map(|x| x + 1.0).collect();
    // Bit 0: the token has a stored old log-prob, bit 1: a reference one.
    let bits = rand_ids(&mut rng, n, 4);
    let has_old: Vec<bool> = bits.iter().map(|b| b & 1 != 0).collect();
    let has_ref: Vec<bool> = bits.iter().map(|b| b & 2 != 0).collect();
    // Tokens without stored values use the current log-probs, as the CPU model does.
    let old: Vec<f32> = (0..n)
        .map(|i| {
            if has_old[i] {
                logp[i] + noise[i]
            } else {
                logp[i]
            }
        })
        .collect();
    let refp: Vec<f32> = (0..n)
        .map(|i| {
            if has_ref[i] {
                logp[i] + noise2[i]
            } else {
                logp[i]
            }
        })
        .collect();
    let c = cpu::GrpoCoefs {
        eps_low: 0.2,
        eps_high: 0.28,
        beta: 0.05,
    };
    let (mut loss, mut kl, mut clipped) = (vec![0.0f32; n], vec![0.0f32; n], vec![false; n]);
    cpu::grpo_loss_fwd(
        &mut loss,
        &mut kl,
        &mut clipped,
        &logp,
        &old,
        &refp,
        &adv,
        &w,
        c,
    );
    let mut dlp = vec![0.0f32; n];
    cpu::grpo_loss_bwd(&mut dlp, &logp, &old, &refp, &adv, &w, c);
    let want = [
        loss.iter().map(|x| *x as f64).sum::<f64>() as f32,
        kl.iter().map(|x| *x as f64).sum::<f64>() as f32,
        clipped.iter().filter(|c| **c).count() as f32,
        ent.iter().map(|x| *x as f64).sum::<f64>() as f32,
    ];
    assert!(
        want[2] > 0.0 && want[2] < n as f32,
        "the inputs exercise both branches"
    );
    let x = LossInputs {
        logp: &logp,
        old: &old,
        refp: &refp,
        has_old: &has_old,
        has_ref: &has_ref,
        adv: &adv,
        w: &w,
        ent: &ent,
    };
    let (sums, gdlp) = b.loss(&x, LossKind::Grpo(c));
    assert_close("grpo_loss_fwd sums", &sums, &want, tol::LOSS);
    assert_close("grpo_loss_bwd", &gdlp, &dlp, tol::ELEMENTWISE);
    // SFT: loss −w·logp, gradient −w.
    let (sums, gdlp) = b.loss(&x, LossKind::Sft);
    let sft_loss = -(0..n).map(|i| (w[i] * logp[i]) as f64).sum::<f64>() as f32;
    assert_close("sft loss", &sums, &[sft_loss, 0.0, 0.0, want[3]], tol::LOSS);
    let neg_w: Vec<f32> = w.iter().map(|x| -x).collect();
    assert_close("sft dlogp", &gdlp, &neg_w, tol::EXACT);
}

pub fn adamw_three_steps(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(20);
    let n = 1000;
    let p0 = rand_vec(&mut rng, n, 1.0);
    let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
    let (mut gp, mut gm, mut gv) = (p0, vec![0.0; n], vec![0.0; n]);
    let a = Adam {
        grad_scale: 0.37,
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    for t in 1..=3u64 {
        let g = rand_vec(&mut rng, n, 3.0);
        cpu::adamw_step(
            &mut p,
            &g,
            &mut m,
            &mut v,
            a.grad_scale,
            a.lr,
            a.beta1,
            a.beta2,
            a.eps,
            a.weight_decay,
            t,
        );
        b.adamw_step(&mut gp, &g, &mut gm, &mut gv, a, t);
    }
    assert_close("adamw p", &gp, &p, tol::ADAMW);
    assert_close("adamw m", &gm, &m, tol::ADAMW);
    assert_close("adamw v", &gv, &v, tol::ADAMW);
}

pub fn grad_norm_sum_of_squares(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let parts: Vec<Vec<f32>> = [1usize, 300, 70_000]
        .iter()
        .map(|&n| rand_vec(&mut rng, n, 2.0))
        .collect();
    let want: f64 = parts.iter().map(|g| cpu::grad_norm(g)).sum();
    let refs: Vec<&[f32]> = parts.iter().map(|g| g.as_slice()).collect();
    assert_close(
        "grad_norm",
        &[b.grad_norm_sq(&refs)],
        &[want as f32],
        tol::REDUCTION,
    );
}

/// Whether a token that differs from the CPU's is explained by rounding: the two tokens'
/// weights are within `REL` of each other (f32 rounding can swap their order), or the draw
/// `u·mass` or `top_p` lies within `REL` of a cumulative boundary of the CPU's walk (a
/// device sums in f32 in another order). Anything else is a real bug.
pub fn explained_by_rounding(
    z: &[f32],
    p: &SamplingParams,
    u: f64,
    cpu_tok: u32,
    got: u32,
) -> bool {
    const REL: f64 = 1e-5;
    let it = if p.temperature > 0.0 {
        1.0 / p.temperature as f64
    } else {
        1.0
    };
    let mx = z
        .iter()
        .fold(f64::NEG_INFINITY, |m, x| m.max(*x as f64 * it));
    let e: Vec<f64> = z.iter().map(|x| (*x as f64 * it - mx).exp()).collect();
    let (ea, eb) = (e[cpu_tok as usize], e[got as usize]);
    if (ea - eb).abs() <= REL * ea.max(eb) {
        return true;
    }
    if p.temperature <= 0.0 {
        return false;
    }
    let mut order: Vec<usize> = (0..z.len()).collect();
    if p.top_k > 0 || p.top_p < 1.0 {
        order.sort_by(|&a, &b| (e[b] as f32).total_cmp(&(e[a] as f32)).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k.min(z.len()));
        }
        let mass: f64 = order.iter().map(|&j| e[j]).sum();
        let mut acc = 0.0;
        for &j in &order {
            acc += e[j];
            if (acc / mass - p.top_p as f64).abs() <= REL {
                return true;
            }
        }
    }
    let mass: f64 = order.iter().map(|&j| e[j]).sum();
    let target = u * mass;
    let mut acc = 0.0;
    for &j in &order {
        acc += e[j];
        if (acc - target).abs() <= REL * mass {
            return true;
        }
    }
    false
}

pub fn sample_matches_cpu_draws(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let settings = |v: usize| {
        [
            (0.0, 0, 1.0),
            (0.7, 0, 1.0),
            (1.0, 5, 1.0),
            (1.0, 0, 0.9),
            (1.2, 20, 0.8),
            (0.9, v + 3, 1.0),
        ]
        .map(|(temperature, top_k, top_p)| SamplingParams {
            temperature,
            top_k,
            top_p,
            ..Default::default()
        })
    };
    let (mut draws, mut differ) = (0usize, 0usize);
    let mut scratch = Vec::new();
    for &v in &[11usize, 64, 1000] {
        // Fewer rows at the large vocabulary.
        let rows = if v > 100 { 12 } else { 48 };
        for p in settings(v) {
            let z = rand_vec(&mut rng, rows * v, 4.0);
            let us: Vec<f64> = (0..rows)
                .map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
                .collect();
            let (toks, lps) = b.sample(&z, v, &p, &us);
            for r in 0..rows {
                let row = &z[r * v..(r + 1) * v];
                let (ct, clp) = cpu::sample(row, &p, us[r], &mut scratch);
                draws += 1;
                if toks[r] == ct {
                    assert_close("sample logp", &[lps[r]], &[clp], tol::REDUCTION);
                } else {
                    differ += 1;
                    assert!(
                        explained_by_rounding(row, &p, us[r], ct, toks[r]),
                        "v={v} {p:?} row {r} u={}: token {} vs cpu {ct}, not a rounding boundary",
                        us[r],
                        toks[r]
                    );
                }
            }
        }
    }
    eprintln!("sample: {differ} of {draws} draws differ from the CPU, each at a rounding boundary");
    // Boundaries are hit with probability ~1e-5 per draw; a handful means a bug even if each
    // case looked like a boundary.
    assert!(differ * 100 <= draws, "{differ} of {draws} draws differ");
}

/// Selection cases where the token must equal the CPU's exactly (no rounding allowance: a
/// wrong index among equal weights would otherwise pass as "equal weights"): logits from 5
/// values only, so runs of ~60 equal weights straddle every top-k and top-p cut (the
/// kernel's index select), k = 1, k = V and k > V, p = 1, a tiny p, and greedy with tied maxima.
pub fn sample_selection_edge_cases(b: &mut impl OpRunner) {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let (v, rows) = (300usize, 16usize);
    let settings = [
        (1.0, 7, 1.0),
        (1.0, 40, 0.5),
        (0.8, 1, 1.0),
        (1.0, v, 1.0),
        (1.0, v + 10, 0.95),
        (1.0, 0, 1.0),
        (1.0, 0, 1e-6),
        (1.0, 25, 1e-6),
        (1.3, 0, 0.3),
        (0.0, 0, 1.0),
    ];
    let mut scratch = Vec::new();
    for (temperature, top_k, top_p) in settings {
        let p = SamplingParams {
            temperature,
            top_k,
            top_p,
            ..Default::default()
        };
        let z: Vec<f32> = rand_ids(&mut rng, rows * v, 5)
            .iter()
            .map(|&q| q as f32 * 0.75 - 1.0)
            .collect();
        let us: Vec<f64> = (0..rows)
            .map(|_| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
            .collect();
        let (toks, lps) = b.sample(&z, v, &p, &us);
        for r in 0..rows {
            let (ct, clp) = cpu::sample(&z[r * v..(r + 1) * v], &p, us[r], &mut scratch);
            assert_eq!(toks[r], ct, "{p:?} row {r} u={}", us[r]);
            assert_close("sample logp", &[lps[r]], &[clp], tol::REDUCTION);
        }
    }
}
