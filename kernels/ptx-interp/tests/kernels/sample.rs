//! `sample`: greedy, plain temperature sampling, top-k, top-p and both, each row with its
//! own settings, against the semantics stated in the kernel's header (those of the CPU
//! reference). Draws `u` and `top_p` away from cumulative-mass boundaries (relative 1e-5),
//! where the kernel's f32 masses may legitimately pick a neighbour.

use rand::RngExt;
use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::Arg;

use crate::common::*;

struct Row {
    inv_temp: f32,
    top_k: u32,
    top_p: f32,
    u: f32,
}

/// Weights e_j = exp(x_j - max x) of one row (x = z * scale in f32, as the kernel forms it).
fn weights(z: &[f32], scale: f32) -> (Vec<f64>, f64) {
    let x: Vec<f32> = z.iter().map(|&v| v * scale).collect();
    let m = x.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
    (x.iter().map(|&v| (v as f64 - m).exp()).collect(), m)
}

/// The candidates in sampling order: token order, or by weight descending (ties: lower id)
/// cut to top-k; returns (order, kept count before top-p).
fn order(e: &[f64], p: &Row) -> (Vec<usize>, usize) {
    let truncate = p.top_k > 0 || p.top_p < 1.0;
    let mut idx: Vec<usize> = (0..e.len()).collect();
    if !truncate {
        return (idx, e.len());
    }
    idx.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
    let k = if p.top_k > 0 && (p.top_k as usize) < e.len() {
        p.top_k as usize
    } else {
        e.len()
    };
    (idx, k)
}

/// Cumulative masses of `idx[..n]`.
fn cumulative(e: &[f64], idx: &[usize]) -> Vec<f64> {
    idx.iter()
        .scan(0.0, |a, &j| {
            *a += e[j];
            Some(*a)
        })
        .collect()
}

/// Whether `t` lies within a relative 1e-5 of the cumulative masses on either side of
/// where it falls (where the kernel's f32 masses could pick the neighbour).
fn near(t: f64, cum: &[f64]) -> bool {
    let i = cum.partition_point(|&c| c < t);
    [i.checked_sub(1), Some(i)]
        .into_iter()
        .flatten()
        .filter_map(|k| cum.get(k))
        .any(|c| (c - t).abs() <= 1e-5 * t.abs())
}

/// The reference draw: (token, logp), or None when the row's u/top_p sits on a boundary.
fn reference(z: &[f32], p: &Row) -> Option<(u32, f64)> {
    let scale = if p.inv_temp == 0.0 { 1.0 } else { p.inv_temp };
    let (e, m) = weights(z, scale);
    let total: f64 = e.iter().sum();
    let logp = |j: usize| (z[j] * scale) as f64 - m - total.ln();
    if p.inv_temp == 0.0 {
        let j = (0..z.len()).fold(0, |b, j| if z[j] > z[b] { j } else { b });
        return Some((j as u32, logp(j)));
    }
    let (idx, k) = order(&e, p);
    let cum = cumulative(&e, &idx[..k]);
    let mut n = k;
    if p.top_p < 1.0 {
        let t = p.top_p as f64 * cum[k - 1];
        if near(t, &cum) {
            return None;
        }
        n = cum.iter().position(|&c| c >= t).map_or(k, |i| i + 1);
    }
    let t = p.u as f64 * cum[n - 1];
    if near(t, &cum[..n]) {
        return None;
    }
    let j = idx[cum[..n].iter().position(|&c| c > t).unwrap_or(n - 1)];
    Some((j as u32, logp(j)))
}

#[test]
fn sample_draws_like_the_reference_for_every_setting() {
    let k = K::new(Kernel::Sample);
    let mut r = rng(50);
    for vocab in [1usize, 37, 1000] {
        let settings = [
            (0.0f32, 0u32, 1.0f32),
            (1.0, 0, 1.0),
            (1.0 / 0.7, 0, 1.0),
            (1.0, 5, 1.0),
            (1.0, 0, 0.9),
            (1.0 / 1.3, 20, 0.5),
            (1.0, vocab as u32 + 4, 0.95),
        ];
        let mut rows = Vec::new();
        let mut z = Vec::new();
        let mut want = Vec::new();
        for &(inv_temp, top_k, top_p) in &settings {
            // Draw a row until its u and top_p stand clear of the boundaries.
            for tries in 0.. {
                assert!(tries < 100, "no clear draw for {inv_temp} {top_k} {top_p}");
                let zr = rand_f32(&mut r, vocab, 6.0);
                let row = Row {
                    inv_temp,
                    top_k,
                    top_p,
                    u: r.random_range(0.0f32..1.0),
                };
                if let Some(w) = reference(&zr, &row) {
                    z.extend(zr);
                    rows.push(row);
                    want.push(w);
                    break;
                }
            }
        }
        let n = rows.len();
        let rowp: Vec<f32> = rows
            .iter()
            .flat_map(|p| [p.inv_temp, f32::from_bits(p.top_k), p.top_p, p.u])
            .collect();
        let (tok, lp) = (k.out::<u32>(n), k.out::<f32>(n));
        k.run(
            "sample",
            cfg(n as u32, 256),
            &[
                k.up(&z),
                k.up(&rowp),
                tok.clone(),
                lp.clone(),
                Arg::U32(n as u32),
                Arg::U32(vocab as u32),
            ],
        );
        let (gt, gl) = (k.get::<u32>(&tok, n), k.get::<f32>(&lp, n));
        for i in 0..n {
            assert_eq!(
                gt[i], want[i].0,
                "vocab {vocab}, row {i} (settings {:?})",
                settings[i]
            );
            // logp = x_j - m - ln(sum e): f32 tree sums of ex2.approx weights and lg2.approx.
            assert!(
                (gl[i] as f64 - want[i].1).abs() <= 2e-5 + 2e-6 * want[i].1.abs(),
                "logp row {i}: {} vs {}",
                gl[i],
                want[i].1
            );
        }
    }
}

#[test]
fn sample_greedy_takes_the_first_of_tied_maxima() {
    let k = K::new(Kernel::Sample);
    let mut z = vec![0.5f32; 600];
    z[3] = 2.0;
    z[400] = 2.0;
    let (tok, lp) = (k.out::<u32>(1), k.out::<f32>(1));
    k.run(
        "sample",
        cfg(1, 256),
        &[
            k.up(&z),
            k.up(&[0.0f32, 0.0, 1.0, 0.5]),
            tok.clone(),
            lp,
            Arg::U32(1),
            Arg::U32(600),
        ],
    );
    assert_eq!(k.get::<u32>(&tok, 1), vec![3]);
}
