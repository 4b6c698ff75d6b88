//! attention_fwd and attention_bwd_dq / attention_bwd_dkv against an f64 reference, on a
//! packed training batch (several sequences, causal windows from `qmeta`) and on decode rows
//! reading a KV cache at their own slots, with grouped-query heads and every supported
//! head_dim.

use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::Arg;

use crate::common::*;

/// An attention problem: shapes, inputs and the query windows.
pub struct Att {
    pub n_q: usize,
    pub n_k: usize,
    pub heads: usize,
    pub kvh: usize,
    pub hd: usize,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// (base, pos) per query: it attends keys base..=base+pos.
    pub qmeta: Vec<u32>,
}

impl Att {
    /// Packed causal sequences of the given lengths (query row i of a sequence starting at
    /// row b has window b..=i), keys = queries' rows.
    pub fn packed(lens: &[usize], heads: usize, kvh: usize, hd: usize, seed: u64) -> Att {
        let n: usize = lens.iter().sum();
        let mut qmeta = Vec::new();
        let mut b = 0;
        for &l in lens {
            for p in 0..l {
                qmeta.extend([b as u32, p as u32]);
            }
            b += l;
        }
        Att::with(n, n, heads, kvh, hd, qmeta, seed)
    }

    fn with(
        n_q: usize,
        n_k: usize,
        heads: usize,
        kvh: usize,
        hd: usize,
        qmeta: Vec<u32>,
        seed: u64,
    ) -> Att {
        let mut r = rng(seed);
        Att {
            n_q,
            n_k,
            heads,
            kvh,
            hd,
            q: rand_f32(&mut r, n_q * heads * hd, 1.0),
            k: rand_f32(&mut r, n_k * kvh * hd, 1.0),
            v: rand_f32(&mut r, n_k * kvh * hd, 1.0),
            qmeta,
        }
    }

    fn scale(&self) -> f64 {
        (self.hd as f64).powf(-0.5)
    }

    fn window(&self, i: usize) -> std::ops::RangeInclusive<usize> {
        let (b, p) = (self.qmeta[2 * i] as usize, self.qmeta[2 * i + 1] as usize);
        b..=b + p
    }

    fn score(&self, i: usize, h: usize, j: usize) -> f64 {
        let g = h / (self.heads / self.kvh);
        (0..self.hd)
            .map(|d| {
                self.q[(i * self.heads + h) * self.hd + d] as f64
                    * self.k[(j * self.kvh + g) * self.hd + d] as f64
            })
            .sum::<f64>()
            * self.scale()
    }

    /// (out [n_q, heads*hd], lse [n_q*heads]) in f64.
    pub fn forward(&self) -> (Vec<f64>, Vec<f64>) {
        let mut out = vec![0.0; self.n_q * self.heads * self.hd];
        let mut lse = vec![0.0; self.n_q * self.heads];
        for i in 0..self.n_q {
            for h in 0..self.heads {
                let g = h / (self.heads / self.kvh);
                let s: Vec<(usize, f64)> =
                    self.window(i).map(|j| (j, self.score(i, h, j))).collect();
                let m = s.iter().fold(f64::NEG_INFINITY, |a, x| a.max(x.1));
                let l: f64 = s.iter().map(|x| (x.1 - m).exp()).sum();
                lse[i * self.heads + h] = m + l.ln();
                for &(j, sj) in &s {
                    let p = (sj - m).exp() / l;
                    for d in 0..self.hd {
                        out[(i * self.heads + h) * self.hd + d] +=
                            p * self.v[(j * self.kvh + g) * self.hd + d] as f64;
                    }
                }
            }
        }
        (out, lse)
    }

    pub fn args(&self, kd: &K) -> [Arg; 10] {
        [
            k_ptr(kd, &self.q),
            k_ptr(kd, &self.k),
            k_ptr(kd, &self.v),
            kd.up(&self.qmeta),
            Arg::U32(self.n_q as u32),
            Arg::U32(self.heads as u32),
            Arg::U32(self.kvh as u32),
            Arg::U32(self.hd as u32),
            Arg::U32(self.n_k as u32),
            Arg::F32(self.scale() as f32),
        ]
    }
}

fn k_ptr(k: &K, v: &[f32]) -> Arg {
    k.up(v)
}

fn grid(pairs: usize) -> LaunchArgs {
    cfg(pairs.div_ceil(4) as u32, 128)
}

type LaunchArgs = rolloutpipe_ptx_interp::LaunchConfig;

#[test]
fn attention_fwd_matches_f64_softmax_on_packed_and_decode_rows() {
    let kd = K::new(Kernel::AttentionFwd);
    let mut cases = vec![
        Att::packed(&[3, 1, 5], 4, 2, 32, 30),
        Att::packed(&[7], 2, 1, 128, 31),
        Att::packed(&[2, 4], 3, 3, 96, 32),
    ];
    // Decode: two requests reading a 24-row cache at slots 0.. and 12.., attending 6 and 9 keys.
    cases.push(Att::with(2, 24, 4, 2, 64, vec![0, 5, 12, 8], 33));
    for a in cases {
        let (out, stats) = (
            kd.out::<f32>(a.n_q * a.heads * a.hd),
            kd.out::<f32>(2 * a.n_q * a.heads),
        );
        let args: Vec<Arg> = [out.clone(), stats.clone()]
            .into_iter()
            .chain(a.args(&kd))
            .collect();
        kd.run("attention_fwd", grid(a.n_q * a.heads), &args);
        let (want_o, want_l) = a.forward();
        // Scores through a 5-step butterfly and ex2.approx of rounded log2-domain values:
        // a few ulp of the scores' magnitude (|s| < ~6 here).
        assert_close(
            "attention_fwd out",
            &kd.get::<f32>(&out, want_o.len()),
            &want_o,
            2e-6,
            2e-5,
        );
        assert_close(
            "attention_fwd lse",
            &kd.get::<f32>(&stats, want_l.len()),
            &want_l,
            4e-6,
            4e-6,
        );
    }
}

/// dq, dk, dv (accumulated onto the given initial values) and D, in f64.
fn backward(a: &Att, out: &[f32], lse: &[f32], dout: &[f32]) -> [Vec<f64>; 4] {
    let hd = a.hd;
    let mut dq = vec![0.0; a.q.len()];
    let mut dk = vec![0.0; a.k.len()];
    let mut dv = vec![0.0; a.v.len()];
    let mut dd = vec![0.0; a.n_q * a.heads];
    for i in 0..a.n_q {
        for h in 0..a.heads {
            let g = h / (a.heads / a.kvh);
            let row = (i * a.heads + h) * hd;
            let d: f64 = (0..hd)
                .map(|x| dout[row + x] as f64 * out[row + x] as f64)
                .sum();
            dd[i * a.heads + h] = d;
            for j in a.window(i) {
                let p = (a.score(i, h, j) - lse[i * a.heads + h] as f64).exp();
                let kr = (j * a.kvh + g) * hd;
                let dp: f64 = (0..hd)
                    .map(|x| dout[row + x] as f64 * a.v[kr + x] as f64)
                    .sum();
                let ds = p * (dp - d) * a.scale();
                for x in 0..hd {
                    dq[row + x] += ds * a.k[kr + x] as f64;
                    dk[kr + x] += ds * a.q[row + x] as f64;
                    dv[kr + x] += p * dout[row + x] as f64;
                }
            }
        }
    }
    [dq, dk, dv, dd]
}

/// Runs attention_bwd_dq then attention_bwd_dkv; returns (dq, dk, dv, stats, dkv's stats).
pub fn run_backward(
    kd: &K,
    a: &Att,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    init: &[Vec<f32>; 3],
) -> ([Vec<f32>; 3], Vec<f32>, rolloutpipe_ptx_interp::LaunchStats) {
    let (dq, dk, dv) = (kd.up(&init[0]), kd.up(&init[1]), kd.up(&init[2]));
    let mut st = lse.to_vec();
    st.resize(2 * lse.len(), f32::NAN); // the D half is written by attention_bwd_dq
    let stats = kd.up(&st);
    let mut args = vec![
        dq.clone(),
        dk.clone(),
        dv.clone(),
        stats.clone(),
        kd.up(dout),
        kd.up(out),
    ];
    args.extend(a.args(kd));
    kd.run("attention_bwd_dq", grid(a.n_q * a.heads), &args);
    let s = kd.run("attention_bwd_dkv", grid(a.n_k * a.kvh), &args);
    (
        [
            kd.get(&dq, a.q.len()),
            kd.get(&dk, a.k.len()),
            kd.get(&dv, a.v.len()),
        ],
        kd.get(&stats, st.len()),
        s,
    )
}

#[test]
fn attention_bwd_matches_f64_gradients_with_grouped_heads() {
    let kd = K::new(Kernel::AttentionBwd);
    let mut r = rng(34);
    for a in [
        Att::packed(&[3, 1, 5], 4, 2, 32, 35),
        Att::packed(&[6], 2, 1, 64, 36),
        Att::packed(&[2, 3], 2, 2, 128, 37),
    ] {
        let (o, l) = a.forward();
        let (out, lse): (Vec<f32>, Vec<f32>) = (
            o.iter().map(|&x| x as f32).collect(),
            l.iter().map(|&x| x as f32).collect(),
        );
        let dout = rand_f32(&mut r, out.len(), 1.0);
        let init = [
            rand_f32(&mut r, a.q.len(), 0.1),
            rand_f32(&mut r, a.k.len(), 0.1),
            rand_f32(&mut r, a.v.len(), 0.1),
        ];
        let (got, stats, _) = run_backward(&kd, &a, &out, &lse, &dout, &init);
        let want = backward(&a, &out, &lse, &dout);
        for (n, (g, (w, i0))) in ["dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(want.iter().zip(&init)))
        {
            let w: Vec<f64> = w.iter().zip(i0).map(|(w, i)| w + *i as f64).collect();
            // Recomputed probabilities (ex2.approx), f32 dot products by butterfly and fma
            // accumulation over the window: errors of a few ulp of the terms' size (|g| < ~3).
            assert_close(&format!("attention_bwd {n}"), g, &w, 2e-5, 2e-5);
        }
        assert_close("attention_bwd D", &stats[lse.len()..], &want[3], 2e-6, 1e-5);
    }
}

/// attention_bwd_dkv visits only the queries of each key's own sequence: a key's work does
/// not grow with the other sequences packed beside it (it tested every query of the batch,
/// N^2 over the whole batch). Same gradients either way.
#[test]
fn attention_bwd_dkv_work_stays_within_each_key_sequence() {
    let kd = K::new(Kernel::AttentionBwd);
    let mut r = rng(38);
    let mut per_key = Vec::new();
    for seqs in [1usize, 16] {
        let a = Att::packed(&vec![4; seqs], 2, 1, 32, 39);
        let (o, l) = a.forward();
        let (out, lse): (Vec<f32>, Vec<f32>) = (
            o.iter().map(|&x| x as f32).collect(),
            l.iter().map(|&x| x as f32).collect(),
        );
        let dout = rand_f32(&mut r, out.len(), 1.0);
        let init = [
            vec![0.0; a.q.len()],
            vec![0.0; a.k.len()],
            vec![0.0; a.v.len()],
        ];
        let (got, _, stats) = run_backward(&kd, &a, &out, &lse, &dout, &init);
        let want = backward(&a, &out, &lse, &dout);
        assert_close("dkv dk", &got[1], &want[1], 2e-5, 2e-5);
        assert_close("dkv dv", &got[2], &want[2], 2e-5, 2e-5);
        per_key.push(stats.warp_steps as f64 / (a.n_k * a.kvh) as f64);
    }
    // A binary search over the 64 rows' windows costs a few dozen instructions more per key
    // than over 4; scanning all 64 queries cost ~3.5x.
    assert!(
        per_key[1] < 1.6 * per_key[0],
        "warp steps per key: {per_key:?}"
    );
}
