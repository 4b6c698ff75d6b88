//! Per-instruction semantics against the PTX ISA's definitions: rounding modes, flush to zero,
//! saturation and canonical NaNs of f32 arithmetic; conversions to bf16/f16 and between
//! integers and floats; min/max with NaN and signed zeros; ex2/lg2.approx within their
//! stated error; the fragment layouts of mma.sync m16n8k16 (bf16 and f16, f32 accumulators)
//! and ldmatrix (with .trans); cp.async commit/wait groups; shfl.sync's four modes with
//! clamps, segments and the predicate output. Expected values come from `isa_util`'s exact
//! checkers, from brute force, from the `half` crate, or from the ISA's formulas written out
//! here, never from the interpreter's own code.

mod isa_util;

use half::{bf16, f16};
use isa_util::{
    Exact, Mode, check_half, check_rounding, exact_add, exact_div, exact_fma, exact_mul, exact_sqrt,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rolloutpipe_ptx_interp::{Arg, Device, Error, LaunchConfig};

/// A kernel that loads a[i], b[i], c[i] as .b32 into %r1..%r3 (and %f1..%f3), runs `body`
/// and stores %r4 to out[i].
fn elementwise(body: &str) -> String {
    format!(
        r#".version 8.0
.target sm_80
.address_size 64
.visible .entry t(.param .u64 po, .param .u64 pa, .param .u64 pb, .param .u64 pc, .param .u32 pn)
{{
    .reg .pred %p<4>;
    .reg .b16 %h<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<12>;
    .reg .f32 %f<8>;
    .reg .f64 %fd<4>;
    ld.param.u64 %rd1, [po];
    ld.param.u64 %rd2, [pa];
    ld.param.u64 %rd3, [pb];
    ld.param.u64 %rd4, [pc];
    ld.param.u32 %r7, [pn];
    mov.u32 %r5, %tid.x;
    mov.u32 %r6, %ctaid.x;
    mad.lo.u32 %r5, %r6, 128, %r5;
    setp.ge.u32 %p3, %r5, %r7;
    @%p3 bra DONE;
    mul.wide.u32 %rd5, %r5, 4;
    add.u64 %rd6, %rd2, %rd5;
    ld.global.b32 %r1, [%rd6];
    add.u64 %rd6, %rd3, %rd5;
    ld.global.b32 %r2, [%rd6];
    add.u64 %rd6, %rd4, %rd5;
    ld.global.b32 %r3, [%rd6];
    mov.b32 %f1, %r1;
    mov.b32 %f2, %r2;
    mov.b32 %f3, %r3;
    mov.b32 %r4, 0;
    {body}
    add.u64 %rd6, %rd1, %rd5;
    st.global.b32 [%rd6], %r4;
DONE:
    ret;
}}"#
    )
}

/// Runs `body` over the three operand vectors (bits); returns %r4 per element.
fn run(body: &str, a: &[u32], b: &[u32], c: &[u32]) -> Vec<u32> {
    let dev = Device::new();
    let m = dev
        .load_module("isa", &elementwise(body))
        .unwrap_or_else(|e| panic!("{body}: {e}"));
    let n = a.len();
    let o = dev.alloc(4 * n).unwrap_or_else(|e| panic!("{e}"));
    let up = |v: &[u32]| Arg::Ptr(dev.upload(v).unwrap_or_else(|e| panic!("{e}")));
    let args = [Arg::Ptr(o), up(a), up(b), up(c), Arg::U32(n as u32)];
    dev.launch(
        m,
        "t",
        &LaunchConfig::linear(n.div_ceil(128) as u32, 128),
        &args,
    )
    .unwrap_or_else(|e| panic!("{body}: {e}"));
    dev.download(o, n).unwrap_or_else(|e| panic!("{e}"))
}

fn f32s(r: &mut ChaCha8Rng, n: usize, lo: i32, hi: i32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-2.0f32..2.0) * 2f32.powi(r.random_range(lo..hi)))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const MODES: [(&str, Mode); 4] = [
    ("rn", Mode::Rn),
    ("rz", Mode::Rz),
    ("rm", Mode::Rm),
    ("rp", Mode::Rp),
];

#[test]
fn f32_arithmetic_rounds_in_every_mode_including_subnormals() {
    let mut r = ChaCha8Rng::seed_from_u64(1);
    // Normal operands over a wide range, then operands whose products and sums are
    // subnormal (below 2^-126).
    let mut a = f32s(&mut r, 300, -30, 30);
    let mut b = f32s(&mut r, 300, -30, 30);
    a.extend(f32s(&mut r, 100, -75, -60));
    b.extend(f32s(&mut r, 100, -75, -60));
    let c = f32s(&mut r, a.len(), -60, 30);
    for (name, md) in MODES {
        let got = |op: &str| {
            run(
                &format!("{op}.{name}.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;"),
                &bits(&a),
                &bits(&b),
                &bits(&c),
            )
        };
        let (add, sub, mul, div) = (got("add"), got("sub"), got("mul"), got("div"));
        let fma = run(
            &format!("fma.{name}.f32 %f4, %f1, %f2, %f3; mov.b32 %r4, %f4;"),
            &bits(&a),
            &bits(&b),
            &bits(&c),
        );
        let sqrt = run(
            &format!("abs.f32 %f1, %f1; sqrt.{name}.f32 %f4, %f1; mov.b32 %r4, %f4;"),
            &bits(&a),
            &bits(&b),
            &bits(&c),
        );
        let rcp = run(
            &format!("rcp.{name}.f32 %f4, %f1; mov.b32 %r4, %f4;"),
            &bits(&a),
            &bits(&b),
            &bits(&c),
        );
        for i in 0..a.len() {
            let f = |v: u32| f32::from_bits(v);
            let what = |op: &str| format!("{op}.{name} a={:e} b={:e} c={:e}", a[i], b[i], c[i]);
            check_rounding(f(add[i]), md, exact_add(a[i], b[i]), &what("add"));
            check_rounding(f(sub[i]), md, exact_add(a[i], -b[i]), &what("sub"));
            check_rounding(f(mul[i]), md, exact_mul(a[i], b[i]), &what("mul"));
            check_rounding(f(div[i]), md, exact_div(a[i], b[i]), &what("div"));
            check_rounding(f(fma[i]), md, exact_fma(a[i], b[i], c[i]), &what("fma"));
            check_rounding(f(sqrt[i]), md, exact_sqrt(a[i].abs()), &what("sqrt"));
            if (1.0 / a[i] as f64).abs() < 1e38 {
                check_rounding(f(rcp[i]), md, exact_div(1.0, a[i]), &what("rcp"));
            }
        }
    }
}

#[test]
fn exact_zero_sums_are_minus_zero_only_when_rounding_down() {
    let (a, b) = (bits(&[1.5f32, -0.0, -0.0]), bits(&[-1.5f32, -0.0, 0.0]));
    for (name, neg) in [("rn", false), ("rz", false), ("rm", true), ("rp", false)] {
        let got = run(
            &format!("add.{name}.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;"),
            &a,
            &b,
            &a,
        );
        // x + (-x): +0 except toward -inf; (-0) + (-0) = -0 in every mode.
        let want = [
            if neg { 0x8000_0000 } else { 0 },
            0x8000_0000,
            if neg { 0x8000_0000 } else { 0 },
        ];
        assert_eq!(got, want, "add.{name}");
    }
}

#[test]
fn ftz_sat_and_canonical_nans() {
    let sub = f32::from_bits(0x0000_1000); // subnormal
    let a = bits(&[
        sub,
        -sub,
        0.7,
        -3.0,
        f32::NAN,
        f32::INFINITY,
        0.0,
        f32::from_bits(0x7fa0_0001),
    ]);
    let b = bits(&[
        0.0,
        -0.0,
        0.6,
        1.0,
        1.0,
        f32::NEG_INFINITY,
        f32::INFINITY,
        1.0,
    ]);
    let ftz = run("add.ftz.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    assert_eq!(
        &ftz[..2],
        &[0, 0x8000_0000],
        "subnormal inputs flush to signed zero"
    );
    let no_ftz = run("add.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    assert_eq!(
        &no_ftz[..2],
        &[sub.to_bits(), (-sub).to_bits()],
        "without .ftz subnormals are kept"
    );
    let prod = run(
        "mul.rn.ftz.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;",
        &bits(&[1e-20]),
        &bits(&[1e-20]),
        &[0],
    );
    assert_eq!(prod, [0], "a subnormal product flushes to zero");
    let sat = run("add.sat.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    assert_eq!(f32::from_bits(sat[2]), 1.0);
    assert_eq!(sat[3], 0);
    assert_eq!(sat[4], 0, ".sat turns NaN into +0");
    // inf - inf, 0 * inf and a NaN with a payload all give the canonical NaN 0x7fffffff.
    assert_eq!(no_ftz[5], 0x7fff_ffff);
    let m = run("mul.rn.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    assert_eq!((m[6], m[7]), (0x7fff_ffff, 0x7fff_ffff));
}

#[test]
fn min_max_prefer_numbers_and_order_signed_zeros() {
    let nan = f32::NAN;
    let a = bits(&[nan, 1.0, nan, -0.0, 0.0, -2.0]);
    let b = bits(&[1.0, nan, nan, 0.0, -0.0, 3.0]);
    let min = run("min.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    let max = run("max.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    assert_eq!(
        min,
        bits(&[1.0, 1.0, f32::from_bits(0x7fff_ffff), -0.0, -0.0, -2.0])
    );
    assert_eq!(
        max,
        bits(&[1.0, 1.0, f32::from_bits(0x7fff_ffff), 0.0, 0.0, 3.0])
    );
    let min_nan = run("min.NaN.f32 %f4, %f1, %f2; mov.b32 %r4, %f4;", &a, &b, &a);
    assert_eq!(&min_nan[..3], &[0x7fff_ffff; 3], ".NaN propagates");
}

#[test]
fn conversions_to_bf16_and_f16_round_per_mode() {
    let mut r = ChaCha8Rng::seed_from_u64(2);
    let mut x = f32s(&mut r, 300, -30, 20);
    x.extend(f32s(&mut r, 100, -28, -14)); // f16 subnormals and underflow
    x.extend([
        65504.0f32,
        65519.0,
        65520.0,
        70000.0,
        -70000.0,
        3.4e38,
        f32::INFINITY,
        f32::NAN,
        -0.0,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
    ]);
    for (name, md) in MODES {
        for (fmt, bf) in [("bf16", true), ("f16", false)] {
            let got = run(
                &format!("cvt.{name}.{fmt}.f32 %h1, %f1; cvt.u32.u16 %r4, %h1;"),
                &bits(&x),
                &bits(&x),
                &bits(&x),
            );
            for (i, &v) in x.iter().enumerate() {
                check_half(got[i] as u16, v, md, bf);
            }
        }
    }
    // Packed: the first source lands in the upper half.
    let got = run(
        "cvt.rn.bf16x2.f32 %r4, %f1, %f2;",
        &bits(&[1.0]),
        &bits(&[-2.0]),
        &[0],
    );
    assert_eq!(
        got,
        [(bf16::from_f32(1.0).to_bits() as u32) << 16 | bf16::from_f32(-2.0).to_bits() as u32]
    );
    // Widening is exact for every 16-bit value.
    let all: Vec<u32> = (0..=0xffffu32).collect();
    for (fmt, bf) in [("bf16", true), ("f16", false)] {
        let got = run(
            &format!("cvt.u16.u32 %h1, %r1; cvt.f32.{fmt} %f4, %h1; mov.b32 %r4, %f4;"),
            &all,
            &all,
            &all,
        );
        for (&h, &g) in all.iter().zip(&got) {
            let want = if bf {
                bf16::from_bits(h as u16).to_f32()
            } else {
                f16::from_bits(h as u16).to_f32()
            };
            assert!(
                g == want.to_bits() || (want.is_nan() && f32::from_bits(g).is_nan()),
                "cvt.f32.{fmt} {h:#06x}"
            );
        }
    }
}

#[test]
fn integer_float_conversions_round_and_saturate() {
    let ints: Vec<u32> = vec![
        0,
        1,
        16_777_217,
        16_777_219,
        0x7fff_ffff,
        0x8000_0001,
        0xffff_ffff,
        123_456_789,
    ];
    for (name, md) in MODES {
        let u = run(
            &format!("cvt.{name}.f32.u32 %f4, %r1; mov.b32 %r4, %f4;"),
            &ints,
            &ints,
            &ints,
        );
        let s = run(
            &format!("cvt.{name}.f32.s32 %f4, %r1; mov.b32 %r4, %f4;"),
            &ints,
            &ints,
            &ints,
        );
        for (i, &v) in ints.iter().enumerate() {
            check_rounding(
                f32::from_bits(u[i]),
                md,
                Exact::Sum(vec![(v as i128, 0)]),
                &format!("cvt.{name}.f32.u32 {v}"),
            );
            check_rounding(
                f32::from_bits(s[i]),
                md,
                Exact::Sum(vec![(v as i32 as i128, 0)]),
                &format!("cvt.{name}.f32.s32 {v}"),
            );
        }
    }
    let x = [2.5f32, -2.5, 3.5, -0.5, 1e10, -1e10, f32::NAN, 7.9999];
    let sat = |v: f64| {
        if v.is_nan() {
            0
        } else {
            v.clamp(i32::MIN as f64, i32::MAX as f64) as i32
        }
    };
    for (name, f) in [
        ("rni", f64::round_ties_even as fn(f64) -> f64),
        ("rzi", f64::trunc),
        ("rmi", f64::floor),
        ("rpi", f64::ceil),
    ] {
        let got = run(
            &format!("cvt.{name}.s32.f32 %r4, %f1;"),
            &bits(&x),
            &bits(&x),
            &bits(&x),
        );
        let want: Vec<u32> = x.iter().map(|&v| sat(f(v as f64)) as u32).collect();
        assert_eq!(got, want, "cvt.{name}.s32.f32 (saturating, NaN -> 0)");
    }
    let got = run(
        "cvt.rzi.u32.f32 %r4, %f1;",
        &bits(&[-5.0, 5e9, 7.7]),
        &[0; 3],
        &[0; 3],
    );
    assert_eq!(got, [0, u32::MAX, 7]);
}

#[test]
fn ex2_and_lg2_are_within_the_stated_error() {
    let mut r = ChaCha8Rng::seed_from_u64(3);
    let x: Vec<f32> = (0..500).map(|_| r.random_range(-126.0f32..127.0)).collect();
    let y: Vec<f32> = f32s(&mut r, 500, -100, 100)
        .iter()
        .map(|v| v.abs())
        .collect();
    let e = run(
        "ex2.approx.f32 %f4, %f1; mov.b32 %r4, %f4;",
        &bits(&x),
        &bits(&x),
        &bits(&x),
    );
    let l = run(
        "lg2.approx.f32 %f4, %f2; mov.b32 %r4, %f4;",
        &bits(&y),
        &bits(&y),
        &bits(&y),
    );
    for i in 0..x.len() {
        let want = (x[i] as f64).exp2();
        // Relative error at most 2^-22 (two f32 ulp).
        assert!(
            (f32::from_bits(e[i]) as f64 / want - 1.0).abs() <= 2f64.powi(-22),
            "ex2({})",
            x[i]
        );
        let want = (y[i] as f64).log2();
        let got = f32::from_bits(l[i]) as f64;
        // Absolute error at most 2^-22 near 1, relative 2^-22 elsewhere.
        assert!(
            (got - want).abs() <= 2f64.powi(-22) * want.abs().max(1.0),
            "lg2({})",
            y[i]
        );
    }
    let s = bits(&[f32::NEG_INFINITY, f32::INFINITY, -0.0, -130.0, f32::NAN]);
    let e = run("ex2.approx.f32 %f4, %f1; mov.b32 %r4, %f4;", &s, &s, &s);
    assert_eq!(
        &e[..4],
        &[0, 0x7f80_0000, 0x3f80_0000, 2f32.powi(-130).to_bits()]
    );
    assert_eq!(e[4], 0x7fff_ffff);
    let e = run("ex2.approx.ftz.f32 %f4, %f1; mov.b32 %r4, %f4;", &s, &s, &s);
    assert_eq!(e[3], 0, ".ftz flushes the subnormal result");
    let s = bits(&[0.0, -1.0, f32::INFINITY, 1.0, f32::from_bits(1)]);
    let l = run("lg2.approx.f32 %f4, %f1; mov.b32 %r4, %f4;", &s, &s, &s);
    assert_eq!(
        l,
        [
            0xff80_0000,
            0x7fff_ffff,
            0x7f80_0000,
            0,
            (-149.0f32).to_bits()
        ]
    );
    let l = run("lg2.approx.ftz.f32 %f4, %f1; mov.b32 %r4, %f4;", &s, &s, &s);
    assert_eq!(l[4], 0xff80_0000, ".ftz: a subnormal input is 0");
}

/// The ISA's fragment tables for m16n8k16 with .f16/.bf16 A, B and f32 C/D, element-wise:
/// (register, half) -> (row, col). groupID = lane >> 2, threadID_in_group = lane % 4.
fn a_pos(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane >> 2, lane % 4);
    let row = if i < 2 || (4..6).contains(&i) {
        g
    } else {
        g + 8
    };
    let col = t * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
    (row, col)
}

fn b_pos(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane >> 2, lane % 4);
    (t * 2 + (i & 1) + if i >= 2 { 8 } else { 0 }, g)
}

fn c_pos(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane >> 2, lane % 4);
    (if i < 2 { g } else { g + 8 }, t * 2 + (i & 1))
}

#[test]
fn mma_m16n8k16_follows_the_isa_fragment_layout() {
    for (ty, bf) in [("bf16", true), ("f16", false)] {
        let mut r = ChaCha8Rng::seed_from_u64(4);
        let to = |v: f32| {
            if bf {
                bf16::from_f32(v).to_bits()
            } else {
                f16::from_f32(v).to_bits()
            }
        };
        let val = |h: u16| {
            if bf {
                bf16::from_bits(h).to_f64()
            } else {
                f16::from_bits(h).to_f64()
            }
        };
        let a: Vec<u16> = (0..256).map(|_| to(r.random_range(-2.0f32..2.0))).collect(); // [16][16]
        let b: Vec<u16> = (0..128).map(|_| to(r.random_range(-2.0f32..2.0))).collect(); // [16][8]
        let c: Vec<f32> = (0..128).map(|_| r.random_range(-1.0f32..1.0)).collect(); // [16][8]
        // Per lane (48 bytes): 4 A registers, 2 B registers and 2 of padding, 4 C values;
        // each register's low half first.
        let mut frag = vec![0u32; 32 * 12];
        for l in 0..32 {
            for k in 0..4 {
                let (lo, hi) = (a_pos(l, 2 * k), a_pos(l, 2 * k + 1));
                frag[l * 12 + k] = a[lo.0 * 16 + lo.1] as u32 | (a[hi.0 * 16 + hi.1] as u32) << 16;
            }
            for k in 0..2 {
                let (lo, hi) = (b_pos(l, 2 * k), b_pos(l, 2 * k + 1));
                frag[l * 12 + 4 + k] =
                    b[lo.0 * 8 + lo.1] as u32 | (b[hi.0 * 8 + hi.1] as u32) << 16;
            }
            for k in 0..4 {
                let (row, col) = c_pos(l, k);
                frag[l * 12 + 8 + k] = c[row * 8 + col].to_bits();
            }
        }
        let src = format!(
            r#".version 8.0
.target sm_80
.address_size 64
.visible .entry t(.param .u64 po, .param .u64 pf)
{{
    .reg .b32 %r<12>;
    .reg .f32 %f<8>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [po];
    ld.param.u64 %rd2, [pf];
    mov.u32 %r11, %tid.x;
    mul.wide.u32 %rd3, %r11, 48;
    add.u64 %rd2, %rd2, %rd3;
    ld.global.v4.b32 {{%r1, %r2, %r3, %r4}}, [%rd2];
    ld.global.v2.b32 {{%r5, %r6}}, [%rd2+16];
    ld.global.v4.f32 {{%f1, %f2, %f3, %f4}}, [%rd2+32];
    mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%f1, %f2, %f3, %f4}}, {{%r1, %r2, %r3, %r4}}, {{%r5, %r6}}, {{%f1, %f2, %f3, %f4}};
    mul.wide.u32 %rd3, %r11, 16;
    add.u64 %rd1, %rd1, %rd3;
    st.global.v4.f32 [%rd1], {{%f1, %f2, %f3, %f4}};
    ret;
}}"#
        );
        let dev = Device::new();
        let m = dev
            .load_module("mma", &src)
            .unwrap_or_else(|e| panic!("{e}"));
        let o = dev.alloc(32 * 16).unwrap();
        let f = dev.upload(&frag).unwrap();
        dev.launch(
            m,
            "t",
            &LaunchConfig::linear(1, 32),
            &[Arg::Ptr(o), Arg::Ptr(f)],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let d: Vec<f32> = dev.download(o, 128).unwrap();
        for l in 0..32 {
            for k in 0..4 {
                let (row, col) = c_pos(l, k);
                let terms: Vec<f64> = (0..16)
                    .map(|kk| val(a[row * 16 + kk]) * val(b[kk * 8 + col]))
                    .collect();
                let want = terms.iter().sum::<f64>() + c[row * 8 + col] as f64;
                let mag =
                    terms.iter().map(|t| t.abs()).sum::<f64>() + c[row * 8 + col].abs() as f64;
                // One f32 rounding of exact products (hardware order unspecified).
                assert!(
                    (d[l * 4 + k] as f64 - want).abs() <= mag * 2f64.powi(-23),
                    "{ty} D[{row}][{col}]"
                );
            }
        }
    }
}

#[test]
fn ldmatrix_gives_each_lane_its_row_pair_or_column_pair() {
    for (x, trans) in [
        (1usize, false),
        (2, false),
        (4, false),
        (1, true),
        (4, true),
    ] {
        // 4 matrices of 8x8 b16, element (m, row, col) = m*64 + row*8 + col + 1, row-major in
        // shared memory at 16-byte aligned rows (matrix m's rows at m*128 + row*16).
        let src = format!(
            r#".version 8.0
.target sm_80
.address_size 64
.visible .entry t(.param .u64 po)
{{
    .shared .align 16 .b8 tile[512];
    .reg .b32 %r<16>;
    .reg .b16 %h<2>;
    .reg .b64 %rd<4>;
    .reg .pred %p<2>;
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, 0;
FILL:
    shl.b32 %r3, %r2, 5;
    add.u32 %r3, %r3, %r1;            // element e = 32*k + lane
    add.u32 %r4, %r3, 1;
    cvt.u16.u32 %h1, %r4;
    shl.b32 %r5, %r3, 1;
    mov.u32 %r6, tile;
    add.u32 %r5, %r5, %r6;
    st.shared.b16 [%r5], %h1;
    add.u32 %r2, %r2, 1;
    setp.lt.u32 %p1, %r2, 8;
    @%p1 bra FILL;
    bar.warp.sync -1;
    // lane l gives row l%8 of matrix l/8
    and.b32 %r7, %r1, 7;
    shr.u32 %r8, %r1, 3;
    shl.b32 %r9, %r8, 7;
    shl.b32 %r10, %r7, 4;
    add.u32 %r9, %r9, %r10;
    add.u32 %r9, %r9, %r6;
    ldmatrix.sync.aligned.m8n8.{xs}{tr}.shared.b16 {dst}, [%r9];
    ld.param.u64 %rd1, [po];
    mul.wide.u32 %rd2, %r1, 16;
    add.u64 %rd1, %rd1, %rd2;
    st.global.v4.b32 [%rd1], {{%r11, %r12, %r13, %r14}};
    ret;
}}"#,
            xs = "x".to_string() + &x.to_string(),
            tr = if trans { ".trans" } else { "" },
            dst = if x == 1 {
                "%r11".to_string()
            } else {
                format!(
                    "{{{}}}",
                    (0..x)
                        .map(|i| format!("%r{}", 11 + i))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        );
        let dev = Device::new();
        let m = dev
            .load_module("ldmatrix", &src)
            .unwrap_or_else(|e| panic!("{e}"));
        let o = dev.alloc(32 * 16).unwrap();
        dev.memset_d8(o, 0, 32 * 16).unwrap();
        dev.launch(m, "t", &LaunchConfig::linear(1, 32), &[Arg::Ptr(o)])
            .unwrap_or_else(|e| panic!("x{x} trans {trans}: {e}"));
        let got: Vec<u32> = dev.download(o, 128).unwrap();
        let el = |mat: usize, row: usize, col: usize| (mat * 64 + row * 8 + col + 1) as u32;
        for l in 0..32 {
            for i in 0..x {
                // The ISA: thread l holds row l/4, elements 2(l%4) and 2(l%4)+1 (.trans: of the
                // transpose, i.e. column l/4 of rows 2(l%4) and 2(l%4)+1).
                let (rr, cc) = (l / 4, 2 * (l % 4));
                let (lo, hi) = if trans {
                    (el(i, cc, rr), el(i, cc + 1, rr))
                } else {
                    (el(i, rr, cc), el(i, rr, cc + 1))
                };
                assert_eq!(
                    got[l * 4 + i],
                    lo | hi << 16,
                    "x{x} trans {trans} lane {l} matrix {i}"
                );
            }
        }
    }
}

/// A kernel where each of 32 threads copies 16 bytes into group 0 and 16 into group 1 with
/// cp.async, then waits per `wait`, optionally reads a group's bytes before a barrier, and
/// writes what it read.
fn cp_async_kernel(wait: &str, read_group: u32, src_size: u32) -> String {
    format!(
        r#".version 8.0
.target sm_80
.address_size 64
.visible .entry t(.param .u64 po, .param .u64 pa)
{{
    .shared .align 16 .b8 buf[1024];
    .reg .b32 %r<12>;
    .reg .b64 %rd<8>;
    .reg .f32 %f<6>;
    ld.param.u64 %rd1, [po];
    ld.param.u64 %rd2, [pa];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 16;
    add.u64 %rd4, %rd2, %rd3;
    shl.b32 %r2, %r1, 4;
    mov.u32 %r3, buf;
    add.u32 %r4, %r3, %r2;
    cp.async.ca.shared.global [%r4], [%rd4], 16, {src_size};
    cp.async.commit_group;
    add.u32 %r5, %r4, 512;
    add.u64 %rd5, %rd4, 512;
    cp.async.ca.shared.global [%r5], [%rd5], 16;
    cp.async.commit_group;
    {wait}
    add.u32 %r6, %r4, {off};
    ld.shared.v4.f32 {{%f1, %f2, %f3, %f4}}, [%r6];
    add.u64 %rd6, %rd1, %rd3;
    st.global.v4.f32 [%rd6], {{%f1, %f2, %f3, %f4}};
    ret;
}}"#,
        off = 512 * read_group
    )
}

#[test]
fn cp_async_wait_group_completes_all_but_the_newest_groups() {
    let dev = Device::new();
    let data: Vec<f32> = (0..256).map(|i| i as f32 + 0.5).collect();
    let a = dev.upload(&data).unwrap();
    let run_k = |wait: &str, group: u32, src_size: u32| -> Result<Vec<f32>, Error> {
        let m = dev
            .load_module("cp", &cp_async_kernel(wait, group, src_size))
            .unwrap_or_else(|e| panic!("{e}"));
        let o = dev.alloc(512).unwrap();
        dev.launch(
            m,
            "t",
            &LaunchConfig::linear(1, 32),
            &[Arg::Ptr(o), Arg::Ptr(a)],
        )?;
        Ok(dev.download(o, 128).unwrap())
    };
    // wait_group 1: group 0 has landed (each thread reads its own bytes, no barrier needed).
    assert_eq!(
        run_k("cp.async.wait_group 1;", 0, 16).unwrap(),
        data[..128].to_vec()
    );
    // wait_group 0 (and wait_all): both have.
    assert_eq!(
        run_k("cp.async.wait_group 0;", 1, 16).unwrap(),
        data[128..].to_vec()
    );
    assert_eq!(
        run_k("cp.async.wait_all;", 1, 16).unwrap(),
        data[128..].to_vec()
    );
    // src-size 4 of 16: the other 12 bytes are zero-filled.
    let got = run_k("cp.async.wait_group 1;", 0, 4).unwrap();
    assert!(
        got.chunks(4)
            .enumerate()
            .all(|(t, c)| c == [data[4 * t], 0.0, 0.0, 0.0])
    );
    // Group 1 is still in flight after wait_group 1: reading it is a race.
    let e = run_k("cp.async.wait_group 1;", 1, 16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shared-memory race"), "{e}");
}

/// The ISA's shfl.sync pseudo-code, per lane: (value, predicate).
fn shfl_ref(mode: &str, x: &[u32], b: u32, c: u32) -> Vec<(u32, bool)> {
    let (clamp, seg) = (c & 31, (c >> 8) & 31);
    (0..32u32)
        .map(|lane| {
            let max_lane = (lane & seg) | (clamp & !seg);
            let min_lane = lane & seg;
            let (j, ok) = match mode {
                "up" => (
                    lane as i32 - b as i32,
                    lane as i32 - b as i32 >= max_lane as i32,
                ),
                "down" => ((lane + b) as i32, lane + b <= max_lane),
                "bfly" => ((lane ^ b) as i32, (lane ^ b) <= max_lane),
                _ => (
                    (min_lane | (b & !seg)) as i32,
                    (min_lane | (b & !seg)) <= max_lane,
                ),
            };
            (if ok { x[j as usize] } else { x[lane as usize] }, ok)
        })
        .collect()
}

#[test]
fn shfl_sync_modes_clamps_segments_and_predicate() {
    let x: Vec<u32> = (0..32).map(|i| 100 + i * 3).collect();
    // c = 0x1f: the whole warp (down/bfly/idx); c = 0 for up; c = 0x101f / 0x1000: segments of 16.
    for (mode, b, c) in [
        ("up", 3, 0),
        ("down", 5, 0x1f),
        ("bfly", 6, 0x1f),
        ("idx", 9, 0x1f),
        ("up", 2, 0x1000),
        ("down", 4, 0x101f),
        ("bfly", 16, 0x101f),
        ("idx", 21, 0x101f),
    ] {
        let got = run(
            &format!(
                "shfl.sync.{mode}.b32 %r3|%p1, %r1, {b}, {c}, -1; selp.u32 %r2, 1, 0, %p1; shl.b32 %r2, %r2, 16; or.b32 %r4, %r3, %r2;"
            ),
            &x,
            &x,
            &x,
        );
        let want: Vec<u32> = shfl_ref(mode, &x, b, c)
            .iter()
            .map(|&(v, p)| v | (p as u32) << 16)
            .collect();
        assert_eq!(got, want, "shfl.sync.{mode} b={b} c={c:#x}");
    }
}
