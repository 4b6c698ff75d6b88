//! Row kernels: embedding_fwd/bwd, rope_fwd/bwd, rmsnorm_fwd/bwd/bwd_dw, grad_norm(_reduce).

use rand::RngExt;
use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::Arg;

use crate::common::*;

#[test]
fn embedding_fwd_gathers_rows_and_zeroes_bad_ids() {
    let k = K::new(Kernel::EmbeddingFwd);
    let mut r = rng(10);
    for (vocab, d, n) in [(5usize, 1usize, 1usize), (17, 40, 9), (50, 300, 4)] {
        let table = rand_f32(&mut r, vocab * d, 1.0);
        let mut ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
        ids[n - 1] = vocab as u32 + 3; // out of range: a zero row, no wild read
        let out = k.out::<f32>(n * d);
        k.run(
            "embedding_fwd",
            cfg(n as u32, 256),
            &[
                out.clone(),
                k.up(&table),
                k.up(&ids),
                Arg::U32(n as u32),
                Arg::U32(d as u32),
                Arg::U32(vocab as u32),
            ],
        );
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&id| {
                if (id as usize) < vocab {
                    table[id as usize * d..][..d].to_vec()
                } else {
                    vec![0.0; d]
                }
            })
            .collect();
        assert_bits("embedding_fwd", &k.get::<f32>(&out, n * d), &want);
    }
}

#[test]
fn embedding_bwd_scatter_adds_in_token_order() {
    let k = K::new(Kernel::EmbeddingBwd);
    let mut r = rng(11);
    for (vocab, d, n) in [(4usize, 1usize, 3usize), (6, 70, 25), (30, 129, 40)] {
        let dout = rand_f32(&mut r, n * d, 1.0);
        let mut ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
        ids[0] = vocab as u32; // skipped
        let mut want = rand_f32(&mut r, vocab * d, 1.0);
        let dt = k.up(&want);
        for (t, &id) in ids.iter().enumerate() {
            if (id as usize) < vocab {
                for c in 0..d {
                    want[id as usize * d + c] += dout[t * d + c];
                }
            }
        }
        k.run(
            "embedding_bwd",
            cfg(d.div_ceil(64) as u32, 64),
            &[
                dt.clone(),
                k.up(&dout),
                k.up(&ids),
                Arg::U32(n as u32),
                Arg::U32(d as u32),
                Arg::U32(vocab as u32),
            ],
        );
        // Repeated ids add up in token order, the reference's order: bit-identical.
        assert_bits("embedding_bwd", &k.get::<f32>(&dt, vocab * d), &want);
    }
}

/// The rotation of rope_fwd (sign 1) or rope_bwd (sign -1) in the kernels' operation order.
#[allow(clippy::too_many_arguments)]
fn rope_ref(
    x: &mut [f32],
    pos: &[u32],
    heads: usize,
    half: usize,
    cos: &[f32],
    sin: &[f32],
    max_pos: usize,
    sign: f32,
) {
    for (row, &p) in x.chunks_exact_mut(heads * 2 * half).zip(pos) {
        if p as usize >= max_pos {
            continue;
        }
        for h in row.chunks_exact_mut(2 * half) {
            for i in 0..half {
                let (a, b) = (h[i], h[i + half]);
                let (c, s) = (cos[p as usize * half + i], sin[p as usize * half + i]);
                if sign > 0.0 {
                    h[i] = a * c - b * s;
                    h[i + half] = b * c + a * s;
                } else {
                    h[i] = a * c + b * s;
                    h[i + half] = b * c - a * s;
                }
            }
        }
    }
}

#[test]
fn rope_fwd_and_bwd_rotate_bit_exactly() {
    let mut r = rng(12);
    for (entry, kern, sign) in [
        ("rope_fwd", Kernel::RopeFwd, 1.0f32),
        ("rope_bwd", Kernel::RopeBwd, -1.0),
    ] {
        let k = K::new(kern);
        for (n, heads, half, max_pos) in [
            (1usize, 1usize, 1usize, 4usize),
            (5, 3, 16, 8),
            (3, 8, 64, 300),
        ] {
            let mut x = rand_f32(&mut r, n * heads * 2 * half, 2.0);
            let angles: Vec<f64> = (0..max_pos * half)
                .map(|j| (j / half) as f64 * 10000f64.powf(-((j % half) as f64) / half as f64))
                .collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = angles
                .iter()
                .map(|a| (a.cos() as f32, a.sin() as f32))
                .unzip();
            let mut pos: Vec<u32> = (0..n).map(|_| r.random_range(0..max_pos as u32)).collect();
            pos[n - 1] = max_pos as u32; // no table row: the row stays as it is
            let px = k.up(&x);
            k.run(
                entry,
                cfg(n as u32, 256),
                &[
                    px.clone(),
                    k.up(&pos),
                    k.up(&cos),
                    k.up(&sin),
                    Arg::U32(n as u32),
                    Arg::U32(heads as u32),
                    Arg::U32(half as u32),
                    Arg::U32(max_pos as u32),
                ],
            );
            rope_ref(&mut x, &pos, heads, half, &cos, &sin, max_pos, sign);
            assert_bits(entry, &k.get::<f32>(&px, x.len()), &x);
        }
    }
}

/// RMSNorm sizes: (rows, d) with d below, at and above the block's 128 threads.
const NORM: [(usize, usize); 4] = [(1, 1), (3, 100), (7, 128), (4, 1000)];

#[test]
fn rmsnorm_fwd_matches_the_f64_reference() {
    let k = K::new(Kernel::RmsnormFwd);
    let mut r = rng(13);
    let eps = 1e-6f32;
    for (rows, d) in NORM {
        let (x, w) = (rand_f32(&mut r, rows * d, 3.0), rand_f32(&mut r, d, 1.5));
        let (out, rstd) = (k.out::<f32>(rows * d), k.out::<f32>(rows));
        k.run(
            "rmsnorm_fwd",
            cfg(rows as u32, 128),
            &[
                out.clone(),
                rstd.clone(),
                k.up(&x),
                k.up(&w),
                Arg::U32(rows as u32),
                Arg::U32(d as u32),
                Arg::F32(eps),
            ],
        );
        let mut want_r = Vec::new();
        let mut want_o = Vec::new();
        for row in x.chunks_exact(d) {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
            let rs = 1.0 / (ms + eps as f64).sqrt();
            want_r.push(rs);
            want_o.extend(
                row.iter()
                    .zip(&w)
                    .map(|(&v, &wi)| wi as f64 * v as f64 * rs),
            );
        }
        // A tree-ordered f32 sum of d squares (relative error ~ log2(d) ulp), one sqrt, two
        // reciprocals and two products.
        assert_close(
            "rmsnorm_fwd rstd",
            &k.get::<f32>(&rstd, rows),
            &want_r,
            0.0,
            3e-6,
        );
        assert_close(
            "rmsnorm_fwd out",
            &k.get::<f32>(&out, rows * d),
            &want_o,
            1e-7,
            4e-6,
        );
    }
}

#[test]
fn rmsnorm_bwd_and_dw_match_the_f64_reference() {
    let k = K::new(Kernel::RmsnormBwd);
    let mut r = rng(14);
    for (rows, d) in NORM {
        let (dout, x, w) = (
            rand_f32(&mut r, rows * d, 1.0),
            rand_f32(&mut r, rows * d, 2.0),
            rand_f32(&mut r, d, 1.5),
        );
        let rstd: Vec<f32> = x
            .chunks_exact(d)
            .map(|row| 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / d as f32 + 1e-6).sqrt())
            .collect();
        let (dx0, dw0) = (rand_f32(&mut r, rows * d, 0.5), rand_f32(&mut r, d, 0.5));
        let mut want_dx: Vec<f64> = dx0.iter().map(|&v| v as f64).collect();
        let mut want_dw: Vec<f64> = dw0.iter().map(|&v| v as f64).collect();
        for (row, &r_row) in rstd.iter().enumerate() {
            let rs = r_row as f64;
            let o = row * d;
            let gx: f64 = (0..d)
                .map(|i| dout[o + i] as f64 * w[i] as f64 * x[o + i] as f64)
                .sum();
            let c = rs * rs * rs * gx / d as f64;
            for i in 0..d {
                want_dx[o + i] += rs * dout[o + i] as f64 * w[i] as f64 - c * x[o + i] as f64;
                want_dw[i] += dout[o + i] as f64 * x[o + i] as f64 * rs;
            }
        }
        let (pdx, pdw) = (k.up(&dx0), k.up(&dw0));
        let args = [
            pdx.clone(),
            pdw.clone(),
            k.up(&dout),
            k.up(&x),
            k.up(&w),
            k.up(&rstd),
            Arg::U32(rows as u32),
            Arg::U32(d as u32),
        ];
        k.run("rmsnorm_bwd", cfg(rows as u32, 128), &args);
        k.run("rmsnorm_bwd_dw", cfg(d.div_ceil(128) as u32, 128), &args);
        // dx: a tree-ordered sum of d products, then a difference of two terms of similar
        // size, so the error is relative to the terms' magnitude (atol), not to dx.
        assert_close(
            "rmsnorm_bwd dx",
            &k.get::<f32>(&pdx, rows * d),
            &want_dx,
            2e-5,
            1e-5,
        );
        // dw: rows products summed onto dw (f32, a few ulp of the running sum per row).
        assert_close(
            "rmsnorm_bwd_dw dw",
            &k.get::<f32>(&pdw, d),
            &want_dw,
            2e-6 * rows as f64,
            1e-5,
        );
    }
}

#[test]
fn grad_norm_sums_squares_in_f64_over_tensors_and_partials() {
    let k = K::new(Kernel::GradNorm);
    let mut r = rng(15);
    // Two tensors, each with its own partial range, then one reduce (the host's pattern).
    let tensors = [rand_f32(&mut r, 1, 2.0), rand_f32(&mut r, 5000, 2.0)];
    let grids = [1u32, 3];
    let count: u32 = grids.iter().sum();
    let partials = k.out::<f64>(count as usize);
    let mut base = 0;
    for (t, &g) in tensors.iter().zip(&grids) {
        k.run(
            "grad_norm",
            cfg(g, 256),
            &[
                k.up(t),
                partials.clone(),
                Arg::U32(t.len() as u32),
                Arg::U32(base),
            ],
        );
        base += g;
    }
    let total = k.out::<f64>(1);
    k.run(
        "grad_norm_reduce",
        cfg(1, 256),
        &[partials, total.clone(), Arg::U32(count)],
    );
    let want: f64 = tensors.iter().flatten().map(|&v| v as f64 * v as f64).sum();
    let got = k.get::<f64>(&total, 1)[0];
    // f64 sums of exact f32 squares in another order: relative error ~ 1e-15.
    assert!(
        (got - want).abs() <= 1e-12 * want,
        "grad_norm {got} vs {want}"
    );
}

/// dw of q_norm/k_norm (d = 128, rows = tokens x heads) must not run on one block that walks
/// every row: with 32 columns per block and 1024 threads, each warp sums every 32nd row and
/// the 32 partial sums are added in warp order. The longest warp's instruction count (the
/// critical path on a GPU) stays near rows / 32 row steps; the result is the same sum within
/// f32 rounding, and the old launch geometry (ceil(d / 128) blocks of 128) still works.
#[test]
fn rmsnorm_bwd_dw_splits_the_rows_across_warps() {
    let k = K::new(Kernel::RmsnormBwd);
    let mut r = rng(16);
    let (rows, d) = (2048usize, 128usize);
    let (dout, x) = (
        rand_f32(&mut r, rows * d, 1.0),
        rand_f32(&mut r, rows * d, 2.0),
    );
    let rstd: Vec<f32> = rand_f32(&mut r, rows, 1.0)
        .iter()
        .map(|v| v.abs() + 0.5)
        .collect();
    let dw0 = rand_f32(&mut r, d, 0.5);
    let want: Vec<f64> = (0..d)
        .map(|i| {
            dw0[i] as f64
                + (0..rows)
                    .map(|t| dout[t * d + i] as f64 * x[t * d + i] as f64 * rstd[t] as f64)
                    .sum::<f64>()
        })
        .collect();
    let (pdo, px, pr) = (k.up(&dout), k.up(&x), k.up(&rstd));
    for (grid, block) in [
        (d.div_ceil(32) as u32, 1024u32),
        (d.div_ceil(128) as u32, 128),
    ] {
        let pdw = k.up(&dw0);
        let none = Arg::Ptr(rolloutpipe_ptx_interp::DevicePtr::NULL);
        let s = k.run(
            "rmsnorm_bwd_dw",
            cfg(grid, block),
            &[
                none.clone(),
                pdw.clone(),
                pdo.clone(),
                px.clone(),
                none,
                pr.clone(),
                Arg::U32(rows as u32),
                Arg::U32(d as u32),
            ],
        );
        // 2048 products per column summed in f32: ~1e-6 relative of the sum of |terms|
        // (about rows/4 here).
        assert_close(
            &format!("rmsnorm_bwd_dw grid {grid} block {block}"),
            &k.get::<f32>(&pdw, d),
            &want,
            2e-4,
            0.0,
        );
        if block == 1024 {
            // 64 rows per warp at ~12 instructions each, plus the tile's reduction.
            assert!(
                s.max_warp_steps < 64 * 16 + 300,
                "longest warp: {} instructions",
                s.max_warp_steps
            );
        }
    }
}
