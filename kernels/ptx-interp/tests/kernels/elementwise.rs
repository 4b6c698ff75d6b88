//! Grid-stride elementwise kernels: residual_fwd, swiglu_fwd/bwd, adamw_step. Sizes cover a
//! single element, a partial warp, a partial block and more elements than threads (the
//! grid-stride loop's second pass).

use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::Arg;

use crate::common::*;

/// Element counts and grids: (n, grid) with grid * 256 below and above n.
const SIZES: [(usize, u32); 4] = [(1, 1), (31, 1), (300, 1), (1000, 2)];

#[test]
fn residual_fwd_adds_bit_exactly_also_in_place() {
    let k = K::new(Kernel::ResidualFwd);
    let mut r = rng(1);
    for (n, grid) in SIZES {
        let (a, b) = (rand_f32(&mut r, n, 4.0), rand_f32(&mut r, n, 4.0));
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let (pa, pb, out) = (k.up(&a), k.up(&b), k.out::<f32>(n));
        k.run(
            "residual_fwd",
            cfg(grid, 256),
            &[out.clone(), pa.clone(), pb, Arg::U32(n as u32)],
        );
        assert_bits("residual_fwd", &k.get::<f32>(&out, n), &want);
        // out aliasing a: each element is read before the same thread writes it.
        let pb2 = k.up(&b);
        k.run(
            "residual_fwd",
            cfg(grid, 256),
            &[pa.clone(), pa.clone(), pb2, Arg::U32(n as u32)],
        );
        assert_bits("residual_fwd in place", &k.get::<f32>(&pa, n), &want);
    }
}

fn sigmoid(g: f32) -> f64 {
    1.0 / (1.0 + (-(g as f64)).exp())
}

#[test]
fn swiglu_fwd_matches_silu_times_up() {
    let k = K::new(Kernel::SwigluFwd);
    let mut r = rng(2);
    for (n, grid) in SIZES {
        let (g, u) = (rand_f32(&mut r, n, 8.0), rand_f32(&mut r, n, 2.0));
        let want: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| g as f64 * sigmoid(g) * u as f64)
            .collect();
        let out = k.out::<f32>(n);
        k.run(
            "swiglu_fwd",
            cfg(grid, 256),
            &[out.clone(), k.up(&g), k.up(&u), Arg::U32(n as u32)],
        );
        // exp via ex2 of a rounded product (-g log2 e), then four .rn operations: a few ulp.
        assert_close("swiglu_fwd", &k.get::<f32>(&out, n), &want, 1e-6, 4e-6);
    }
    // Very negative gates: exp(-g) overflows to +inf and silu(g) is -0, never NaN.
    let out = k.out::<f32>(2);
    k.run(
        "swiglu_fwd",
        cfg(1, 256),
        &[
            out.clone(),
            k.up(&[-200.0f32, 200.0]),
            k.up(&[1.0f32, 1.0]),
            Arg::U32(2),
        ],
    );
    assert_eq!(k.get::<f32>(&out, 2), vec![-0.0, 200.0]);
}

#[test]
fn swiglu_bwd_accumulates_both_gradients() {
    let k = K::new(Kernel::SwigluBwd);
    let mut r = rng(3);
    for (n, grid) in SIZES {
        let (dout, g, u) = (
            rand_f32(&mut r, n, 1.0),
            rand_f32(&mut r, n, 6.0),
            rand_f32(&mut r, n, 2.0),
        );
        let (dg0, du0) = (rand_f32(&mut r, n, 1.0), rand_f32(&mut r, n, 1.0));
        let mut want_dg = Vec::new();
        let mut want_du = Vec::new();
        for i in 0..n {
            let s = sigmoid(g[i]);
            let (d, gg, uu) = (dout[i] as f64, g[i] as f64, u[i] as f64);
            want_du.push(du0[i] as f64 + d * gg * s);
            want_dg.push(dg0[i] as f64 + d * uu * s * (1.0 + gg * (1.0 - s)));
        }
        let (dg, du) = (k.up(&dg0), k.up(&du0));
        k.run(
            "swiglu_bwd",
            cfg(grid, 256),
            &[
                dg.clone(),
                du.clone(),
                k.up(&dout),
                k.up(&g),
                k.up(&u),
                Arg::U32(n as u32),
            ],
        );
        // As the forward: one approximate exponential, then a handful of roundings.
        assert_close(
            "swiglu_bwd dgate",
            &k.get::<f32>(&dg, n),
            &want_dg,
            2e-6,
            1e-5,
        );
        assert_close(
            "swiglu_bwd dup",
            &k.get::<f32>(&du, n),
            &want_du,
            2e-6,
            1e-5,
        );
    }
}

/// The CPU reference's AdamW element update, in f32 with the kernel's operation order.
#[allow(clippy::too_many_arguments)]
fn adamw_ref(p: f32, g: f32, m: f32, v: f32, s: &[f32; 8]) -> (f32, f32, f32) {
    let [grad_scale, decay, step_size, w1, b2, w2, bc2_sqrt, eps] = *s;
    let g = g * grad_scale;
    let p = p * decay;
    let m = m + w1 * (g - m);
    let v = v * b2 + (w2 * g) * g;
    let denom = v.sqrt() / bc2_sqrt + eps;
    (p - step_size * (m / denom), m, v)
}

#[test]
fn adamw_step_is_bit_identical_to_the_reference_order() {
    let k = K::new(Kernel::AdamwStep);
    let mut r = rng(4);
    // Scalars as the host derives them (lr 1e-3, wd 0.01, betas 0.9/0.999, step 3), in f32.
    let (lr, wd, b1, b2, t) = (1e-3f64, 0.01f64, 0.9f64, 0.999f64, 3);
    let s = [
        0.5f32,
        (1.0 - lr * wd) as f32,
        (lr / (1.0 - b1.powi(t))) as f32,
        (1.0 - b1) as f32,
        b2 as f32,
        (1.0 - b2) as f32,
        (1.0 - b2.powi(t)).sqrt() as f32,
        1e-8,
    ];
    for (n, grid) in SIZES {
        let (p0, g) = (rand_f32(&mut r, n, 1.0), rand_f32(&mut r, n, 3.0));
        let m0 = rand_f32(&mut r, n, 0.1);
        let v0: Vec<f32> = rand_f32(&mut r, n, 0.1).iter().map(|x| x * x).collect();
        let want: Vec<(f32, f32, f32)> = (0..n)
            .map(|i| adamw_ref(p0[i], g[i], m0[i], v0[i], &s))
            .collect();
        let (pp, pm, pv) = (k.up(&p0), k.up(&m0), k.up(&v0));
        let mut args = vec![
            pp.clone(),
            k.up(&g),
            pm.clone(),
            pv.clone(),
            Arg::U32(n as u32),
        ];
        args.extend(s.iter().map(|&x| Arg::F32(x)));
        k.run("adamw_step", cfg(grid, 256), &args);
        assert_bits(
            "adamw p",
            &k.get::<f32>(&pp, n),
            &want.iter().map(|w| w.0).collect::<Vec<_>>(),
        );
        assert_bits(
            "adamw m",
            &k.get::<f32>(&pm, n),
            &want.iter().map(|w| w.1).collect::<Vec<_>>(),
        );
        assert_bits(
            "adamw v",
            &k.get::<f32>(&pv, n),
            &want.iter().map(|w| w.2).collect::<Vec<_>>(),
        );
    }
}
