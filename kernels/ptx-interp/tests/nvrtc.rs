//! Reference kernels written in CUDA C (`tests/cuda/*.cu`), compiled to PTX by NVRTC
//! (`tests/nvrtc/*.ptx`, committed; `scripts/ci.d/ptx_nvrtc.py --check` keeps them fresh),
//! executed by the interpreter and checked against plain Rust: compiler-generated PTX the
//! interpreter's authors did not write, exercising signed arithmetic, 2-D blocks, dynamic
//! shared memory, `__syncwarp`, the shuffle intrinsics' width semantics (as the CUDA C
//! Programming Guide defines them), the rounding intrinsics, cp.async, ldmatrix and mma.

mod isa_util;

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rolloutpipe_ptx_interp::{Arg, Device, LaunchConfig, ModuleId};

use isa_util::{Mode, check_rounding, exact_add, exact_div, exact_fma, exact_mul};

fn load(name: &str) -> (Device, ModuleId) {
    let path = format!("{}/tests/nvrtc/{name}.ptx", env!("CARGO_MANIFEST_DIR"));
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let dev = Device::new();
    let m = dev
        .load_module(name, &src)
        .unwrap_or_else(|e| panic!("{e}"));
    (dev, m)
}

fn up<T: bytemuck::Pod>(dev: &Device, v: &[T]) -> Arg {
    Arg::Ptr(dev.upload(v).unwrap_or_else(|e| panic!("{e}")))
}

fn get<T: bytemuck::Pod>(dev: &Device, a: &Arg, n: usize) -> Vec<T> {
    let Arg::Ptr(p) = a else {
        panic!("not a pointer")
    };
    dev.download(*p, n).unwrap_or_else(|e| panic!("{e}"))
}

fn out<T: bytemuck::Pod>(dev: &Device, n: usize) -> Arg {
    Arg::Ptr(
        dev.alloc(n * size_of::<T>())
            .unwrap_or_else(|e| panic!("{e}")),
    )
}

fn run(dev: &Device, m: ModuleId, entry: &str, cfg: LaunchConfig, args: &[Arg]) {
    dev.launch(m, entry, &cfg, args)
        .unwrap_or_else(|e| panic!("{e}"));
}

fn rand_f32(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-scale..scale)).collect()
}

#[test]
fn saxpy_is_an_fma_per_element() {
    let (dev, m) = load("reduce");
    let mut r = ChaCha8Rng::seed_from_u64(1);
    let n = 1000;
    let (x, y) = (rand_f32(&mut r, n, 4.0), rand_f32(&mut r, n, 4.0));
    let py = up(&dev, &y);
    run(
        &dev,
        m,
        "saxpy",
        LaunchConfig::linear(3, 128),
        &[py.clone(), up(&dev, &x), Arg::F32(1.5), Arg::I32(n as i32)],
    );
    let want: Vec<u32> = (0..n)
        .map(|i| 1.5f32.mul_add(x[i], y[i]).to_bits())
        .collect();
    assert_eq!(
        get::<f32>(&dev, &py, n)
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        want
    );
}

#[test]
fn block_sum_reduces_through_shared_memory_and_shuffles() {
    let (dev, m) = load("reduce");
    let mut r = ChaCha8Rng::seed_from_u64(2);
    for (n, grid, block) in [(1usize, 1u32, 32u32), (5000, 4, 256), (777, 3, 96)] {
        let x = rand_f32(&mut r, n, 1.0);
        let sums = out::<f32>(&dev, grid as usize);
        run(
            &dev,
            m,
            "block_sum",
            LaunchConfig::linear(grid, block),
            &[sums.clone(), up(&dev, &x), Arg::I32(n as i32)],
        );
        let got: f64 = get::<f32>(&dev, &sums, grid as usize)
            .iter()
            .map(|&v| v as f64)
            .sum();
        let want: f64 = x.iter().map(|&v| v as f64).sum();
        // f32 sums of n terms in |x| < 1, in another order: a few n ulp of 1.
        assert!(
            (got - want).abs() < 1e-6 * n as f64,
            "n {n}: {got} vs {want}"
        );
    }
}

/// The CUDA C Programming Guide's `__shfl_*_sync` with `width`: lanes form segments of
/// `width`; up/down stay inside the segment (else the own value), xor may reach an earlier
/// segment but not a later one, idx reads `src % width` of the own segment.
fn shuffles_ref(x: &[i32], delta: usize, src: usize, width: usize) -> Vec<i32> {
    let mut o = Vec::new();
    for (t, &v) in x.iter().enumerate() {
        let (warp, lane) = (t / 32 * 32, t % 32);
        let seg = lane / width * width;
        let at = |l: usize| x[warp + l];
        o.push(if lane % width >= delta {
            at(lane - delta)
        } else {
            v
        });
        o.push(if lane % width + delta < width {
            at(lane + delta)
        } else {
            v
        });
        let j = lane ^ delta;
        o.push(if j / width <= lane / width { at(j) } else { v });
        o.push(at(seg + src % width));
    }
    o
}

#[test]
fn shuffle_intrinsics_follow_the_programming_guide() {
    let (dev, m) = load("reduce");
    let x: Vec<i32> = (0..64).map(|i| 1000 + i * 7).collect();
    for (delta, src, width) in [
        (1usize, 5usize, 32usize),
        (3, 17, 16),
        (4, 2, 8),
        (16, 31, 32),
        (2, 9, 4),
    ] {
        let o = out::<i32>(&dev, 4 * x.len());
        run(
            &dev,
            m,
            "shuffles",
            LaunchConfig::linear(2, 32),
            &[
                o.clone(),
                up(&dev, &x),
                Arg::I32(delta as i32),
                Arg::I32(src as i32),
                Arg::I32(width as i32),
            ],
        );
        assert_eq!(
            get::<i32>(&dev, &o, 4 * x.len()),
            shuffles_ref(&x, delta, src, width),
            "delta {delta} src {src} width {width}"
        );
    }
}

/// Operand pairs with exponents close enough for the exact checkers, signs mixed, a few
/// exactly representable results and ties.
fn operands(r: &mut ChaCha8Rng, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut a = Vec::new();
    let mut b = Vec::new();
    for i in 0..n {
        let x: f32 = r.random_range(-8.0f32..8.0) * 2f32.powi(r.random_range(-20..20));
        let y: f32 = match i % 4 {
            0 => x * 2f32.powi(-24), // adds a half ulp: a tie
            _ => r.random_range(-8.0f32..8.0) * 2f32.powi(r.random_range(-20..20)),
        };
        a.push(x);
        b.push(if y == 0.0 { 1.0 } else { y });
    }
    (a, b)
}

const MODES: [Mode; 4] = [Mode::Rn, Mode::Rz, Mode::Rm, Mode::Rp];

#[test]
fn rounding_intrinsics_round_add_mul_fma_div_exactly() {
    let (dev, m) = load("math");
    let mut r = ChaCha8Rng::seed_from_u64(3);
    let n = 400;
    let (a, b) = operands(&mut r, n);
    let c: Vec<f32> = rand_f32(&mut r, n, 64.0);
    let o = out::<f32>(&dev, 8 * n);
    run(
        &dev,
        m,
        "rounding",
        LaunchConfig::linear(4, 128),
        &[o.clone(), up(&dev, &a), up(&dev, &b), Arg::I32(n as i32)],
    );
    let got = get::<f32>(&dev, &o, 8 * n);
    for i in 0..n {
        for (k, &md) in MODES.iter().enumerate() {
            check_rounding(
                got[8 * i + k],
                md,
                exact_add(a[i], b[i]),
                &format!("__fadd {md:?} {} {}", a[i], b[i]),
            );
            check_rounding(
                got[8 * i + 4 + k],
                md,
                exact_mul(a[i], b[i]),
                &format!("__fmul {md:?} {} {}", a[i], b[i]),
            );
        }
    }
    let o = out::<f32>(&dev, 8 * n);
    run(
        &dev,
        m,
        "rounding3",
        LaunchConfig::linear(4, 128),
        &[
            o.clone(),
            up(&dev, &a),
            up(&dev, &b),
            up(&dev, &c),
            Arg::I32(n as i32),
        ],
    );
    let got = get::<f32>(&dev, &o, 8 * n);
    for i in 0..n {
        for (k, &md) in MODES.iter().enumerate() {
            check_rounding(
                got[8 * i + k],
                md,
                exact_fma(a[i], b[i], c[i]),
                &format!("__fmaf {md:?}"),
            );
            check_rounding(
                got[8 * i + 4 + k],
                md,
                exact_div(a[i], b[i]),
                &format!("__fdiv {md:?} {} {}", a[i], b[i]),
            );
        }
    }
}

#[test]
fn conversions_to_16_bits_and_to_int_round_per_mode() {
    let (dev, m) = load("math");
    let mut r = ChaCha8Rng::seed_from_u64(4);
    let mut x = rand_f32(&mut r, 300, 70000.0);
    x.extend([
        0.5f32,
        1.5,
        2.5,
        -2.5,
        65519.0,
        65520.0,
        1e-8,
        -1e-8,
        f32::NAN,
        f32::INFINITY,
        3e9,
        -3e9,
        f32::from_bits(0x3f80_8000),
    ]);
    let n = x.len();
    let h = out::<u16>(&dev, 6 * n);
    run(
        &dev,
        m,
        "to_half",
        LaunchConfig::linear(3, 128),
        &[h.clone(), up(&dev, &x), Arg::I32(n as i32)],
    );
    let got = get::<u16>(&dev, &h, 6 * n);
    let ints = out::<i32>(&dev, 4 * n);
    run(
        &dev,
        m,
        "to_int",
        LaunchConfig::linear(3, 128),
        &[ints.clone(), up(&dev, &x), Arg::I32(n as i32)],
    );
    let gi = get::<i32>(&dev, &ints, 4 * n);
    for (i, &v) in x.iter().enumerate() {
        // half's conversions are round-to-nearest-even: an independent reference for .rn
        // (any NaN for a NaN: payloads are not modelled).
        if !v.is_nan() {
            assert_eq!(got[6 * i], bf16::from_f32(v).to_bits(), "bf16 rn {v}");
            assert_eq!(got[6 * i + 2], f16::from_f32(v).to_bits(), "f16 rn {v}");
        }
        isa_util::check_half(got[6 * i], v, Mode::Rn, true);
        isa_util::check_half(got[6 * i + 2], v, Mode::Rn, false);
        isa_util::check_half(got[6 * i + 1], v, Mode::Rz, true);
        for (k, md) in [(3, Mode::Rz), (4, Mode::Rm), (5, Mode::Rp)] {
            isa_util::check_half(got[6 * i + k], v, md, false);
        }
        let sat = |f: f64| {
            if f.is_nan() {
                0
            } else {
                f.clamp(i32::MIN as f64, i32::MAX as f64) as i32
            }
        };
        let v = v as f64;
        assert_eq!(
            &gi[4 * i..4 * i + 4],
            &[
                sat(v.round_ties_even()),
                sat(v.trunc()),
                sat(v.floor()),
                sat(v.ceil())
            ],
            "to_int {v}"
        );
    }
}

#[test]
fn minmax_nan_and_fast_exp2_log2() {
    let (dev, m) = load("math");
    let mut r = ChaCha8Rng::seed_from_u64(5);
    let mut a = rand_f32(&mut r, 200, 20.0);
    let mut b: Vec<f32> = rand_f32(&mut r, 200, 100.0)
        .iter()
        .map(|v| v.abs() + 1e-3)
        .collect();
    a.extend([f32::NAN, 1.0, -0.0, 0.0, f32::NEG_INFINITY]);
    b.extend([2.0, f32::NAN, 0.0, -0.0, 1.0]);
    let n = a.len();
    let o = out::<f32>(&dev, 4 * n);
    run(
        &dev,
        m,
        "misc",
        LaunchConfig::linear(2, 128),
        &[o.clone(), up(&dev, &a), up(&dev, &b), Arg::I32(n as i32)],
    );
    let got = get::<f32>(&dev, &o, 4 * n);
    for i in 0..n {
        let (x, y) = (a[i], b[i]);
        // fminf/fmaxf: the non-NaN operand wins (C99); for -0/+0 either is allowed in C.
        let (mn, mx) = (got[4 * i], got[4 * i + 1]);
        if x.is_nan() || y.is_nan() {
            let other = if x.is_nan() { y } else { x };
            assert_eq!(
                (mn.to_bits(), mx.to_bits()),
                (other.to_bits(), other.to_bits()),
                "min/max with NaN"
            );
        } else {
            assert_eq!((mn, mx), (x.min(y), x.max(y)));
        }
        // exp2f: 2 ulp (Programming Guide); __log2f: 2^-22 absolute on [0.5, 2], else 2 ulp.
        let e = (x as f64).exp2();
        assert!(
            x.is_nan() && got[4 * i + 2].is_nan()
                || got[4 * i + 2] as f64 == e
                || (got[4 * i + 2] as f64 - e).abs() <= 2.0 * ulp(e),
            "exp2f({x}) = {} vs {e}",
            got[4 * i + 2]
        );
        let l = (y as f64).log2();
        let tol = if (0.5..=2.0).contains(&y) {
            2f64.powi(-22)
        } else {
            2.0 * ulp(l)
        };
        let g = got[4 * i + 3] as f64;
        assert!(
            y.is_nan() && g.is_nan() || g == l || (g - l).abs() <= tol,
            "__log2f({y}) = {g} vs {l}"
        );
    }
}

/// One f32 ulp at the magnitude of `v`.
fn ulp(v: f64) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return 0.0;
    }
    2f64.powi(v.abs().log2().floor() as i32 - 23)
}

#[test]
fn transpose_with_2d_blocks_and_padded_tiles() {
    let (dev, m) = load("memory");
    let mut r = ChaCha8Rng::seed_from_u64(6);
    for (rows, cols) in [(1usize, 1usize), (33, 70), (64, 32)] {
        let x = rand_f32(&mut r, rows * cols, 1.0);
        let o = out::<f32>(&dev, rows * cols);
        let cfg = LaunchConfig {
            grid: (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1),
            block: (32, 8, 1),
            shared_bytes: 0,
        };
        run(
            &dev,
            m,
            "transpose",
            cfg,
            &[
                o.clone(),
                up(&dev, &x),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
            ],
        );
        let want: Vec<f32> = (0..rows * cols)
            .map(|k| x[(k % rows) * cols + k / rows])
            .collect();
        assert_eq!(get::<f32>(&dev, &o, rows * cols), want, "{rows}x{cols}");
    }
}

#[test]
fn dynamic_shared_memory_reverses_each_block() {
    let (dev, m) = load("memory");
    let x: Vec<i32> = (0..3 * 96).collect();
    let o = out::<i32>(&dev, x.len());
    let cfg = LaunchConfig {
        grid: (3, 1, 1),
        block: (96, 1, 1),
        shared_bytes: 96 * 4,
    };
    run(&dev, m, "reverse", cfg, &[o.clone(), up(&dev, &x)]);
    let want: Vec<i32> = (0..x.len() as i32)
        .map(|i| i / 96 * 96 + 95 - i % 96)
        .collect();
    assert_eq!(get::<i32>(&dev, &o, x.len()), want);
    // Too little dynamic shared memory for the block: the fault names the shared access.
    let small = LaunchConfig {
        shared_bytes: 95 * 4,
        ..cfg
    };
    let e = dev
        .launch(m, "reverse", &small, &[o, up(&dev, &x)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("out-of-bounds shared write"), "{e}");
}

#[test]
fn cp_async_groups_land_in_commit_order() {
    let (dev, m) = load("memory");
    let mut r = ChaCha8Rng::seed_from_u64(7);
    let (grid, block) = (2usize, 128usize);
    let n = grid * block * 4;
    let (a, b) = (rand_f32(&mut r, n, 1.0), rand_f32(&mut r, n, 1.0));
    let o = out::<f32>(&dev, n);
    run(
        &dev,
        m,
        "async_add",
        LaunchConfig::linear(grid as u32, block as u32),
        &[o.clone(), up(&dev, &a), up(&dev, &b)],
    );
    let want: Vec<f32> = (0..n).map(|i| a[i] + b[i]).collect();
    assert_eq!(get::<f32>(&dev, &o, n), want);
}

#[test]
fn ldmatrix_and_mma_compute_a_16x8_tile() {
    let (dev, m) = load("tensor");
    let mut r = ChaCha8Rng::seed_from_u64(8);
    for (entry, bf) in [("mma_bf16", true), ("mma_f16", false)] {
        let af: Vec<f32> = rand_f32(&mut r, 256, 2.0);
        let bf_: Vec<f32> = rand_f32(&mut r, 128, 2.0);
        let c = rand_f32(&mut r, 128, 1.0);
        let bits = |v: &[f32]| -> Vec<u16> {
            v.iter()
                .map(|&x| {
                    if bf {
                        bf16::from_f32(x).to_bits()
                    } else {
                        f16::from_f32(x).to_bits()
                    }
                })
                .collect()
        };
        let val = |h: u16| -> f64 {
            if bf {
                bf16::from_bits(h).to_f64()
            } else {
                f16::from_bits(h).to_f64()
            }
        };
        let (ab, bb) = (bits(&af), bits(&bf_));
        let d = out::<f32>(&dev, 128);
        run(
            &dev,
            m,
            entry,
            LaunchConfig::linear(1, 32),
            &[d.clone(), up(&dev, &ab), up(&dev, &bb), up(&dev, &c)],
        );
        let got = get::<f32>(&dev, &d, 128);
        for i in 0..16 {
            for j in 0..8 {
                let (mut s, mut mag) = (c[i * 8 + j] as f64, (c[i * 8 + j] as f64).abs());
                for k in 0..16 {
                    let p = val(ab[i * 16 + k]) * val(bb[k * 8 + j]);
                    s += p;
                    mag += p.abs();
                }
                // One rounding to f32 of a sum of exact products: an f32 ulp of the terms.
                assert!(
                    (got[i * 8 + j] as f64 - s).abs() <= mag * 2f64.powi(-23),
                    "{entry} D[{i}][{j}] = {} vs {s}",
                    got[i * 8 + j]
                );
            }
        }
    }
}
