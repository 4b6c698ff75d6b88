//! The matrix products: matmul_fwd (bf16 tensor cores), matmul_fwd_f32 (the strided SIMT
//! GEMM in every operand layout the model uses), matmul_fwd_cast (f32 -> bf16), and
//! matmul_bwd_dx / matmul_bwd_dw (tensor cores with ldmatrix.trans). Shapes include tails in
//! every dimension (not multiples of the 64-wide tile or the 32-wide k tile).

use half::bf16;
use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::Arg;

use crate::common::*;

fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

fn from_bf16(v: &[u16]) -> Vec<f64> {
    v.iter().map(|&b| bf16::from_bits(b).to_f64()).collect()
}

/// `c[i][j] (+)= sum_k a(i, k) b(k, j)` in f64, with the sum of |products| for tolerances.
fn gemm(
    m: usize,
    n: usize,
    kk: usize,
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut mag = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for k in 0..kk {
                let p = a(i, k) * b(k, j);
                c[i * n + j] += p;
                mag[i * n + j] += p.abs();
            }
        }
    }
    (c, mag)
}

/// Tensor-core results against the f64 product: each mma rounds its f32 accumulator once
/// per 16 products (K/16 roundings of the running sum), so the error is a few f32 ulp of
/// the sum of |products|.
#[track_caller]
fn assert_tc(what: &str, got: &[f32], want: &[f64], mag: &[f64], k: usize) {
    let tol: Vec<f64> = mag
        .iter()
        .map(|m| m * (k as f64 / 16.0 + 1.0) * 2f64.powi(-23))
        .collect();
    let bad: Vec<String> = (0..got.len())
        .filter(|&i| (got[i] as f64 - want[i]).abs() > tol[i] + 1e-30)
        .take(5)
        .map(|i| format!("[{i}] got {} want {} tol {:e}", got[i], want[i], tol[i]))
        .collect();
    assert!(bad.is_empty(), "{what}: {}", bad.join("; "));
}

/// (M, N, K): tails in every dimension, one tile, several k tiles.
const SHAPES: [(usize, usize, usize); 4] = [(1, 8, 8), (70, 72, 48), (64, 64, 32), (130, 40, 136)];

#[test]
fn matmul_fwd_tensor_cores_match_the_f64_product() {
    let k = K::new(Kernel::MatmulFwd);
    let mut r = rng(20);
    for (m, n, kk) in SHAPES {
        let (x, w) = (
            to_bf16(&rand_f32(&mut r, m * kk, 2.0)),
            to_bf16(&rand_f32(&mut r, n * kk, 2.0)),
        );
        let y = k.out::<f32>(m * n);
        k.run(
            "matmul_fwd",
            cfg2((n.div_ceil(64) as u32, m.div_ceil(64) as u32), 128),
            &[
                y.clone(),
                k.up(&x),
                k.up(&w),
                Arg::U32(m as u32),
                Arg::U32(n as u32),
                Arg::U32(kk as u32),
            ],
        );
        let (xf, wf) = (from_bf16(&x), from_bf16(&w));
        let (want, mag) = gemm(m, n, kk, |i, k| xf[i * kk + k], |k, j| wf[j * kk + k]);
        assert_tc(
            &format!("matmul_fwd {m}x{n}x{kk}"),
            &k.get::<f32>(&y, m * n),
            &want,
            &mag,
            kk,
        );
    }
}

#[test]
fn matmul_bwd_dx_and_dw_accumulate_the_f64_products() {
    let k = K::new(Kernel::MatmulBwd);
    let mut r = rng(21);
    // (tokens M, d_out N', d_in K'): N' and K' multiples of 8 as the kernels require.
    for (m, nn, kk) in [(1usize, 8usize, 8usize), (70, 40, 72), (33, 136, 64)] {
        let (dy, w, x) = (
            to_bf16(&rand_f32(&mut r, m * nn, 1.0)),
            to_bf16(&rand_f32(&mut r, nn * kk, 1.0)),
            to_bf16(&rand_f32(&mut r, m * kk, 1.0)),
        );
        let (dyf, wf, xf) = (from_bf16(&dy), from_bf16(&w), from_bf16(&x));
        let (dx0, dw0) = (
            rand_f32(&mut r, m * kk, 0.5),
            rand_f32(&mut r, nn * kk, 0.5),
        );
        let (dx, dw) = (k.up(&dx0), k.up(&dw0));
        // The dimension arguments are each product's own (m, n, k): dx (M, K', N'), dw (N', K', M).
        let dims = |a: usize, b: usize, c: usize| {
            [Arg::U32(a as u32), Arg::U32(b as u32), Arg::U32(c as u32)]
        };
        k.run(
            "matmul_bwd_dx",
            cfg2((kk.div_ceil(64) as u32, m.div_ceil(64) as u32), 128),
            &[&[dx.clone(), k.up(&dy), k.up(&w)][..], &dims(m, kk, nn)].concat(),
        );
        k.run(
            "matmul_bwd_dw",
            cfg2((kk.div_ceil(64) as u32, nn.div_ceil(64) as u32), 128),
            &[&[dw.clone(), k.up(&dy), k.up(&x)][..], &dims(nn, kk, m)].concat(),
        );
        let (mut want_dx, mut mag_dx) =
            gemm(m, kk, nn, |i, j| dyf[i * nn + j], |j, c| wf[j * kk + c]);
        let (mut want_dw, mut mag_dw) =
            gemm(nn, kk, m, |j, i| dyf[i * nn + j], |i, c| xf[i * kk + c]);
        for (i, v) in dx0.iter().enumerate() {
            want_dx[i] += *v as f64;
            mag_dx[i] += v.abs() as f64;
        }
        for (i, v) in dw0.iter().enumerate() {
            want_dw[i] += *v as f64;
            mag_dw[i] += v.abs() as f64;
        }
        assert_tc(
            "matmul_bwd_dx",
            &k.get::<f32>(&dx, m * kk),
            &want_dx,
            &mag_dx,
            nn,
        );
        assert_tc(
            "matmul_bwd_dw",
            &k.get::<f32>(&dw, nn * kk),
            &want_dw,
            &mag_dw,
            m,
        );
    }
}

/// `C (=|+=) A.B` with A[i, k] = a[i*rsa + k*csa], B[k, j] = b[k*rsb + j*csb], each output an
/// fma chain over k in order from 0, then added to C: the kernel's exact operation order.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    n: usize,
    kk: usize,
    s: [usize; 4],
    acc: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut t = 0.0f32;
            for k in 0..kk {
                t = a[i * s[0] + k * s[1]].mul_add(b[k * s[2] + j * s[3]], t);
            }
            c[i * n + j] = if acc { c[i * n + j] + t } else { t };
        }
    }
}

#[test]
fn matmul_fwd_f32_is_bit_identical_in_every_layout() {
    let k = K::new(Kernel::MatmulFwd);
    let mut r = rng(22);
    for (m, n, kk) in SHAPES {
        // The model's three uses: y = x.W^T, dx += dy.W, dW += dy^T.x (matmul_bwd.ptx's strides).
        let layouts = [
            ([kk, 1, 1, kk], false),
            ([kk, 1, n, 1], true),
            ([1, m, n, 1], true),
        ];
        for (s, acc) in layouts {
            let a = rand_f32(&mut r, m * kk, 1.0);
            let b = rand_f32(&mut r, kk * n, 1.0);
            let mut want = rand_f32(&mut r, m * n, 1.0);
            let c = k.up(&want);
            let strides = s.map(|v| Arg::U32(v as u32));
            let args = [
                &[
                    c.clone(),
                    k.up(&a),
                    k.up(&b),
                    Arg::U32(m as u32),
                    Arg::U32(n as u32),
                    Arg::U32(kk as u32),
                ][..],
                &strides,
                &[Arg::U32(acc as u32)],
            ]
            .concat();
            k.run(
                "matmul_fwd_f32",
                cfg2((n.div_ceil(64) as u32, m.div_ceil(64) as u32), 256),
                &args,
            );
            gemm_f32(&mut want, &a, &b, m, n, kk, s, acc);
            assert_bits(
                &format!("matmul_fwd_f32 {m}x{n}x{kk} {s:?}"),
                &k.get::<f32>(&c, m * n),
                &want,
            );
        }
    }
}

#[test]
fn matmul_fwd_cast_rounds_to_nearest_even_bf16() {
    let k = K::new(Kernel::MatmulFwd);
    let mut r = rng(23);
    for (n, grid) in [(1usize, 1u32), (7, 1), (1001, 2)] {
        let mut src = rand_f32(&mut r, n, 100.0);
        src[0] = f32::from_bits(0x3f80_8000); // a tie: rounds to the even 0x3f80
        let dst = k.out::<u16>(n);
        k.run(
            "matmul_fwd_cast",
            cfg(grid, 256),
            &[dst.clone(), k.up(&src), Arg::U32(n as u32)],
        );
        let got = k.get::<u16>(&dst, n);
        // half's conversion is an independent implementation of round-to-nearest-even.
        assert_eq!(got, to_bf16(&src), "matmul_fwd_cast n={n}");
        assert_eq!(got[0], 0x3f80);
    }
}

/// The header promises 4-byte alignment for src and dst (a view at any f32 offset): the
/// kernel must not load 8 bytes at once.
#[test]
fn matmul_fwd_cast_takes_4_byte_aligned_views() {
    let k = K::new(Kernel::MatmulFwd);
    let mut r = rng(24);
    let n = 9;
    let src = rand_f32(&mut r, n + 1, 3.0);
    let (s, d) = (ptr(&k.up(&src)), ptr(&k.out::<u16>(n + 2)));
    k.run(
        "matmul_fwd_cast",
        cfg(1, 256),
        &[
            Arg::Ptr(d.offset(4)),
            Arg::Ptr(s.offset(4)),
            Arg::U32(n as u32),
        ],
    );
    let got: Vec<u16> = k
        .dev
        .download::<u16>(d.offset(4), n)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got, to_bf16(&src[1..]));
}
