//! Independent checkers of IEEE rounding for the ISA and NVRTC tests: exact results as sums
//! of integer-times-power-of-two terms in a small big integer (no floating point involved),
//! and brute force over all 65,536 values of the 16-bit formats. Nothing here shares code
//! with the interpreter's `float` module.
#![allow(dead_code)]

use std::cmp::Ordering;

/// A rounding mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Rn,
    Rz,
    Rm,
    Rp,
}

/// A finite f64 as (integer mantissa, exponent): v = m * 2^e.
fn parts(v: f64) -> (i128, i32) {
    if v == 0.0 {
        return (0, 0);
    }
    let b = v.to_bits();
    let e = ((b >> 52) & 0x7ff) as i32;
    let f = (b & ((1 << 52) - 1)) as i128;
    let (mut m, mut e) = if e == 0 {
        (f, -1074)
    } else {
        (f | 1 << 52, e - 1075)
    };
    // Strip trailing zeros: an f32's mantissa then has at most 24 bits, which keeps every
    // product of two below 2^49 and every shifted term inside u128.
    let tz = m.trailing_zeros();
    m >>= tz;
    e += tz as i32;
    (if v < 0.0 { -m } else { m }, e)
}

/// Sign of sum of m_i * 2^e_i, in base-2^32 limbs (exact for any exponents).
fn sign_of(terms: &[(i128, i32)]) -> Ordering {
    let terms: Vec<(i128, i32)> = terms.iter().copied().filter(|t| t.0 != 0).collect();
    let Some(emin) = terms.iter().map(|t| t.1).min() else {
        return Ordering::Equal;
    };
    let mut acc: Vec<i64> = Vec::new();
    for (m, e) in terms {
        let shift = (e - emin) as usize;
        let (words, bits) = (shift / 32, shift % 32);
        let mag = m.unsigned_abs() << bits; // m < 2^97 here, so the shift fits
        let mut limbs = vec![0i64; words];
        let mut v = mag;
        while v != 0 {
            limbs.push((v & 0xffff_ffff) as i64);
            v >>= 32;
        }
        if acc.len() < limbs.len() {
            acc.resize(limbs.len(), 0);
        }
        for (k, l) in limbs.iter().enumerate() {
            acc[k] += if m < 0 { -l } else { *l };
        }
    }
    // Normalise carries, then the top non-zero limb gives the sign.
    let mut carry = 0i64;
    for a in acc.iter_mut() {
        let v = *a + carry;
        carry = v.div_euclid(1 << 32);
        *a = v.rem_euclid(1 << 32);
    }
    if carry != 0 {
        return carry.cmp(&0);
    }
    if acc.iter().all(|&a| a == 0) {
        Ordering::Equal
    } else {
        Ordering::Greater
    }
}

/// An exact result, compared with candidate values.
pub enum Exact {
    /// A sum of exact terms.
    Sum(Vec<(i128, i32)>),
    /// a / b.
    Quot(f64, f64),
    /// sqrt(a).
    Sqrt(f64),
}

impl Exact {
    /// The exact result compared with `v` (finite).
    pub fn cmp(&self, v: f64) -> Ordering {
        let (mv, ev) = parts(v);
        match self {
            Exact::Sum(t) => {
                let mut t = t.clone();
                t.push((-mv, ev));
                sign_of(&t)
            }
            Exact::Quot(a, b) => {
                // a/b vs v  <=>  sign(a - v b) * sign(b)
                let (ma, ea) = parts(*a);
                let (mb, eb) = parts(*b);
                let s = sign_of(&[(ma, ea), (-(mv * mb), ev + eb)]);
                if *b < 0.0 { s.reverse() } else { s }
            }
            Exact::Sqrt(a) => {
                if v < 0.0 {
                    return Ordering::Greater;
                }
                let (ma, ea) = parts(*a);
                sign_of(&[(ma, ea), (-(mv * mv), 2 * ev)])
            }
        }
    }
}

pub fn exact_add(a: f32, b: f32) -> Exact {
    let ((ma, ea), (mb, eb)) = (parts(a as f64), parts(b as f64));
    Exact::Sum(vec![(ma, ea), (mb, eb)])
}

pub fn exact_mul(a: f32, b: f32) -> Exact {
    let ((ma, ea), (mb, eb)) = (parts(a as f64), parts(b as f64));
    Exact::Sum(vec![(ma * mb, ea + eb)])
}

pub fn exact_fma(a: f32, b: f32, c: f32) -> Exact {
    let ((ma, ea), (mb, eb), (mc, ec)) = (parts(a as f64), parts(b as f64), parts(c as f64));
    Exact::Sum(vec![(ma * mb, ea + eb), (mc, ec)])
}

pub fn exact_div(a: f32, b: f32) -> Exact {
    Exact::Quot(a as f64, b as f64)
}

pub fn exact_sqrt(a: f32) -> Exact {
    Exact::Sqrt(a as f64)
}

fn up(v: f32) -> f32 {
    v.next_up()
}

fn down(v: f32) -> f32 {
    v.next_down()
}

/// Asserts that `got` is the exact result rounded per `mode` (finite, no overflow).
#[track_caller]
pub fn check_rounding(got: f32, mode: Mode, t: Exact, what: &str) {
    assert!(got.is_finite(), "{what}: got {got}");
    let ok = match mode {
        Mode::Rn => {
            let lo_mid = (got as f64 + down(got) as f64) / 2.0;
            let hi_mid = (got as f64 + up(got) as f64) / 2.0;
            let (a, b) = (t.cmp(lo_mid), t.cmp(hi_mid));
            let even = got.to_bits() & 1 == 0;
            (a == Ordering::Greater || (a == Ordering::Equal && even))
                && (b == Ordering::Less || (b == Ordering::Equal && even))
        }
        Mode::Rm => t.cmp(got as f64) != Ordering::Less && t.cmp(up(got) as f64) == Ordering::Less,
        Mode::Rp => {
            t.cmp(got as f64) != Ordering::Greater && t.cmp(down(got) as f64) == Ordering::Greater
        }
        Mode::Rz => match t.cmp(0.0) {
            Ordering::Greater => {
                got >= 0.0
                    && t.cmp(got as f64) != Ordering::Less
                    && t.cmp(up(got) as f64) == Ordering::Less
            }
            Ordering::Less => {
                got <= 0.0
                    && t.cmp(got as f64) != Ordering::Greater
                    && t.cmp(down(got) as f64) == Ordering::Greater
            }
            Ordering::Equal => got == 0.0,
        },
    };
    assert!(
        ok,
        "{what}: {got:e} ({:#010x}) is not the {mode:?} rounding",
        got.to_bits()
    );
}

/// The value of 16-bit `bits` in bf16 (`bf`) or f16.
pub fn half_value(bits: u16, bf: bool) -> f64 {
    if bf {
        half::bf16::from_bits(bits).to_f64()
    } else {
        half::f16::from_bits(bits).to_f64()
    }
}

/// The expected 16-bit conversion of `x` by brute force over every finite value.
pub fn expected_half(x: f32, mode: Mode, bf: bool) -> u16 {
    let inf: u16 = if bf { 0x7f80 } else { 0x7c00 };
    let sign = if x.is_sign_negative() { 0x8000u16 } else { 0 };
    let a = (x as f64).abs();
    if a.is_infinite() {
        return sign | inf;
    }
    // Positive finite values are increasing in their bits.
    let lo = (0..inf)
        .rev()
        .find(|&b| half_value(b, bf) <= a)
        .unwrap_or(0);
    let hi = (0..inf).find(|&b| half_value(b, bf) >= a).unwrap_or(inf);
    let away_is_up = x >= 0.0;
    let m = match mode {
        Mode::Rz => lo,
        Mode::Rm => {
            if away_is_up {
                lo
            } else {
                hi
            }
        }
        Mode::Rp => {
            if away_is_up {
                hi
            } else {
                lo
            }
        }
        Mode::Rn => {
            let top = half_value(inf - 1, bf);
            let half_ulp = (top - half_value(inf - 2, bf)) / 2.0;
            if hi == inf {
                if a >= top + half_ulp { inf } else { lo }
            } else {
                let (dl, dh) = (a - half_value(lo, bf), half_value(hi, bf) - a);
                if dl < dh || (dl == dh && lo & 1 == 0) {
                    lo
                } else {
                    hi
                }
            }
        }
    };
    sign | m
}

/// Asserts a 16-bit conversion of `x` (NaN: any NaN).
#[track_caller]
pub fn check_half(got: u16, x: f32, mode: Mode, bf: bool) {
    if x.is_nan() {
        assert!(
            half_value(got, bf).is_nan(),
            "NaN converts to NaN, got {got:#06x}"
        );
        return;
    }
    let want = expected_half(x, mode, bf);
    assert_eq!(
        got,
        want,
        "{} {mode:?} of {x:e}: got {got:#06x} want {want:#06x}",
        if bf { "bf16" } else { "f16" }
    );
}
