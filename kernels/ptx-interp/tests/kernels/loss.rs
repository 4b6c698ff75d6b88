//! The log-prob and loss kernels: logprob_fwd over vocabulary chunks + logprob_fwd_finish,
//! logprob_bwd, grpo_loss_fwd, grpo_loss_bwd.

use rand::RngExt;
use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::Arg;

use crate::common::*;

/// (logp, entropy, lse) of each row of `z` [rows, vocab] under softmax(z * inv_temp).
fn logprob_ref(z: &[f32], targets: &[u32], vocab: usize, inv_temp: f32) -> [Vec<f64>; 3] {
    let mut out = [Vec::new(), Vec::new(), Vec::new()];
    for (row, &t) in z.chunks_exact(vocab).zip(targets) {
        let x: Vec<f64> = row.iter().map(|&v| (v * inv_temp) as f64).collect();
        let m = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let s: f64 = x.iter().map(|v| (v - m).exp()).sum();
        let lse = m + s.ln();
        let ent = lse
            - x.iter()
                .filter(|v| v.is_finite())
                .map(|v| (v - m).exp() * v)
                .sum::<f64>()
                / s;
        out[0].push(x[t as usize] - lse);
        out[1].push(ent);
        out[2].push(lse);
    }
    out
}

/// Runs the chunked forward: logprob_fwd per chunk of `chunk` columns, then the finish.
fn logprob_run(
    k: &K,
    z: &[f32],
    targets: &[u32],
    rows: usize,
    vocab: usize,
    chunk: usize,
    inv_temp: f32,
) -> [Vec<f32>; 3] {
    let state = k.out::<f32>(4 * rows);
    let tg = k.up(targets);
    for v0 in (0..vocab).step_by(chunk) {
        let c = chunk.min(vocab - v0);
        let part: Vec<f32> = z
            .chunks_exact(vocab)
            .flat_map(|r| r[v0..v0 + c].to_vec())
            .collect();
        k.run(
            "logprob_fwd",
            cfg(rows as u32, 256),
            &[
                state.clone(),
                k.up(&part),
                tg.clone(),
                Arg::U32(rows as u32),
                Arg::U32(c as u32),
                Arg::U32(v0 as u32),
                Arg::U32((v0 == 0) as u32),
                Arg::F32(inv_temp),
            ],
        );
    }
    let (lp, ent, lse) = (k.out::<f32>(rows), k.out::<f32>(rows), k.out::<f32>(rows));
    k.run(
        "logprob_fwd_finish",
        cfg(rows.div_ceil(64) as u32, 64),
        &[
            lp.clone(),
            ent.clone(),
            lse.clone(),
            state,
            Arg::U32(rows as u32),
        ],
    );
    [k.get(&lp, rows), k.get(&ent, rows), k.get(&lse, rows)]
}

#[test]
fn logprob_fwd_folds_chunks_into_logp_entropy_and_lse() {
    let k = K::new(Kernel::LogprobFwd);
    let mut r = rng(40);
    for (rows, vocab, chunk, temp) in [
        (1usize, 3usize, 3usize, 1.0f32),
        (3, 700, 256, 0.7),
        (5, 1000, 300, 1.3),
    ] {
        let z = rand_f32(&mut r, rows * vocab, 8.0);
        let targets: Vec<u32> = (0..rows).map(|_| r.random_range(0..vocab as u32)).collect();
        let got = logprob_run(&k, &z, &targets, rows, vocab, chunk, 1.0 / temp);
        let want = logprob_ref(&z, &targets, vocab, 1.0 / temp);
        // Online log-sum-exp with ex2.approx rescales, merged by a fixed tree over 256
        // threads and the chunks: relative error ~1e-6 of the sums, absolute on lse.
        for (n, (g, w)) in ["logp", "entropy", "lse"].iter().zip(got.iter().zip(&want)) {
            assert_close(&format!("logprob_fwd {n}"), g, w, 2e-5, 2e-6);
        }
    }
}

/// A -inf logit (a token masked out) has probability 0 and contributes nothing to the
/// entropy: entropy stays finite.
#[test]
fn logprob_fwd_entropy_is_finite_with_a_minus_infinity_logit() {
    let k = K::new(Kernel::LogprobFwd);
    let mut r = rng(41);
    let (rows, vocab) = (2usize, 300usize);
    let mut z = rand_f32(&mut r, rows * vocab, 4.0);
    z[5] = f32::NEG_INFINITY;
    z[vocab + 299] = f32::NEG_INFINITY;
    let targets = [7u32, 12];
    let got = logprob_run(&k, &z, &targets, rows, vocab, 128, 1.0);
    let want = logprob_ref(&z, &targets, vocab, 1.0);
    for (n, (g, w)) in ["logp", "entropy", "lse"].iter().zip(got.iter().zip(&want)) {
        assert!(g.iter().all(|v| v.is_finite()), "logprob_fwd {n}: {g:?}");
        assert_close(&format!("logprob_fwd {n} with -inf"), g, w, 2e-5, 2e-6);
    }
}

#[test]
fn logprob_bwd_writes_dlogits_in_place_and_their_bf16_copy() {
    let k = K::new(Kernel::LogprobBwd);
    let mut r = rng(42);
    for (rows, chunk, v0, with_copy) in [
        (1usize, 5usize, 0u32, true),
        (3, 300, 256, true),
        (2, 257, 0, false),
    ] {
        let z = rand_f32(&mut r, rows * chunk, 5.0);
        let inv_temp = 1.25f32;
        let dlogp = rand_f32(&mut r, rows, 1.0);
        // lse of each chunk row (only the chunk's own columns here), and targets in and out.
        let lse: Vec<f32> = z
            .chunks_exact(chunk)
            .map(|row| {
                row.iter()
                    .map(|&v| ((v * inv_temp) as f64).exp())
                    .sum::<f64>()
                    .ln() as f32
            })
            .collect();
        let targets: Vec<u32> = (0..rows)
            .map(|i| {
                if i % 2 == 0 {
                    v0 + (i as u32 * 7) % chunk as u32
                } else {
                    v0 + chunk as u32 + 1
                }
            })
            .collect();
        let logits = k.up(&z);
        let copy = if with_copy {
            k.out::<u16>(rows * chunk)
        } else {
            Arg::Ptr(rolloutpipe_ptx_interp::DevicePtr::NULL)
        };
        k.run(
            "logprob_bwd",
            cfg2((rows as u32, chunk.div_ceil(256) as u32), 256),
            &[
                logits.clone(),
                copy.clone(),
                k.up(&dlogp),
                k.up(&lse),
                k.up(&targets),
                Arg::U32(rows as u32),
                Arg::U32(chunk as u32),
                Arg::U32(v0),
                Arg::F32(inv_temp),
            ],
        );
        let mut want = Vec::new();
        for i in 0..rows {
            let g = (dlogp[i] * inv_temp) as f64;
            for j in 0..chunk {
                let p = (((z[i * chunk + j] * inv_temp) as f64) - lse[i] as f64).exp();
                let hit = v0 as usize + j == targets[i] as usize;
                want.push(-g * p + if hit { g } else { 0.0 });
            }
        }
        let got = k.get::<f32>(&logits, rows * chunk);
        // p by ex2.approx of a rounded argument, one product and one add.
        assert_close("logprob_bwd dlogits", &got, &want, 1e-6, 1e-5);
        if with_copy {
            let bf: Vec<u16> = got
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            assert_eq!(
                k.get::<u16>(&copy, rows * chunk),
                bf,
                "the bf16 copy is the rounded f32 result"
            );
        }
    }
}

/// One token's GRPO terms: (weighted loss, kl, clipped, dlogp) as SPEC section 6 defines them.
#[allow(clippy::too_many_arguments)]
fn grpo_ref(
    lp: f32,
    old: f32,
    rf: f32,
    a: f32,
    w: f32,
    flags: u32,
    sft: bool,
    lo: f32,
    hi: f32,
    beta: f32,
) -> (f64, f64, f64, f64) {
    let (lp, w, a) = (lp as f64, w as f64, a as f64);
    if sft {
        return (-w * lp, 0.0, 0.0, -w);
    }
    let old = if flags & 2 != 0 { old as f64 } else { lp };
    let rf = if flags & 4 != 0 { rf as f64 } else { lp };
    let rho = (lp - old).exp();
    let rc = rho.clamp(lo as f64, hi as f64);
    let (un, cl) = (rho * a, rc * a);
    let clipped = cl < un;
    let kl = (rf - lp).exp() - (rf - lp) - 1.0;
    let loss = w * (-(un.min(cl)) + beta as f64 * kl);
    let dsurr = if un <= cl { un } else { 0.0 };
    let dkl = 1.0 - (rf - lp).exp();
    (
        loss,
        kl,
        clipped as u32 as f64,
        w * (-dsurr + beta as f64 * dkl),
    )
}

#[test]
fn grpo_loss_fwd_and_bwd_match_the_objective() {
    let mut r = rng(43);
    let (kf, kb) = (K::new(Kernel::GrpoLossFwd), K::new(Kernel::GrpoLossBwd));
    let (lo, hi, beta) = (0.8f32, 1.28f32, 0.04f32);
    for (n, sft) in [(1usize, false), (300, false), (600, true)] {
        let lp: Vec<f32> = rand_f32(&mut r, n, 1.0).iter().map(|v| v - 1.5).collect();
        let old: Vec<f32> = lp
            .iter()
            .map(|v| v + r.random_range(-0.4f32..0.4))
            .collect();
        let rf: Vec<f32> = lp
            .iter()
            .map(|v| v + r.random_range(-0.4f32..0.4))
            .collect();
        let (adv, w, ent) = (
            rand_f32(&mut r, n, 2.0),
            rand_f32(&mut r, n, 1.0)
                .iter()
                .map(|v| v.abs())
                .collect::<Vec<_>>(),
            rand_f32(&mut r, n, 3.0),
        );
        let flags: Vec<u32> = (0..n)
            .map(|i| if i == 0 { 7 } else { r.random_range(0..8u32) })
            .collect();
        let sel: Vec<usize> = (0..n).filter(|&i| flags[i] & 1 != 0).collect();
        let terms: Vec<_> = (0..n)
            .map(|i| {
                grpo_ref(
                    lp[i], old[i], rf[i], adv[i], w[i], flags[i], sft, lo, hi, beta,
                )
            })
            .collect();
        let want_stats = [
            sel.iter().map(|&i| terms[i].0).sum::<f64>(),
            sel.iter().map(|&i| terms[i].1).sum::<f64>(),
            sel.iter().map(|&i| terms[i].2).sum::<f64>(),
            sel.iter().map(|&i| ent[i] as f64).sum::<f64>(),
        ];
        let tail = [
            Arg::U32(n as u32),
            Arg::U32(sft as u32),
            Arg::F32(lo),
            Arg::F32(hi),
            Arg::F32(beta),
        ];
        let stats = kf.out::<f32>(4);
        let args = [
            kf.up(&lp),
            kf.up(&old),
            kf.up(&rf),
            kf.up(&adv),
            kf.up(&w),
            kf.up(&ent),
            kf.up(&flags),
            stats.clone(),
        ];
        kf.run("grpo_loss_fwd", cfg(1, 256), &[&args[..], &tail].concat());
        // Sums of n terms by a fixed tree; exp via ex2.approx: relative 1e-5 of the sums'
        // magnitude (the clipped count is exact).
        let mag = sel
            .iter()
            .map(|&i| terms[i].0.abs() + terms[i].1.abs() + ent[i].abs() as f64)
            .sum::<f64>();
        assert_close(
            "grpo_loss_fwd stats",
            &kf.get::<f32>(&stats, 4),
            &want_stats,
            1e-5 * mag + 1e-6,
            0.0,
        );
        let dlogp = kb.out::<f32>(n);
        let args = [
            dlogp.clone(),
            kb.up(&lp),
            kb.up(&old),
            kb.up(&rf),
            kb.up(&adv),
            kb.up(&w),
            kb.up(&flags),
        ];
        kb.run("grpo_loss_bwd", cfg(2, 256), &[&args[..], &tail].concat());
        let want_d: Vec<f64> = (0..n)
            .map(|i| if flags[i] & 1 != 0 { terms[i].3 } else { 0.0 })
            .collect();
        // Elementwise: two approximate exponentials and a few roundings.
        assert_close(
            "grpo_loss_bwd dlogp",
            &kb.get::<f32>(&dlogp, n),
            &want_d,
            1e-6,
            1e-5,
        );
    }
}
