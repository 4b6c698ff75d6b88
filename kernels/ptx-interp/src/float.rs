//! Floating-point semantics of the PTX ISA: IEEE rounding in the four modes (`.rn`, `.rz`,
//! `.rm`, `.rp`) for f32 arithmetic and for conversions to f32, f16 and bf16, flush to zero
//! (`.ftz`), saturation (`.sat`), canonical NaN results, `min`/`max` with NaN and signed
//! zeros, and the `.approx` functions.
//!
//! Round to nearest even uses the host's IEEE operations directly. The directed modes start
//! from that nearest result `r` and look at which side of `r` the exact result lies (derived
//! exactly: products of f32 are exact in f64, sums get their error by TwoSum, quotients and
//! square roots by the sign of an exact residual), then step to the neighbouring value where
//! the mode asks for it. The `.approx` functions return the correctly rounded value, which
//! lies within the ISA's stated error of what hardware returns, never its exact bits.

use std::cmp::Ordering;

/// A rounding mode of the ISA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rnd {
    /// `.rn`: to nearest, ties to even (also the default of unqualified float instructions).
    N,
    /// `.rz`: toward zero.
    Z,
    /// `.rm`: toward minus infinity.
    M,
    /// `.rp`: toward plus infinity.
    P,
}

/// A binary floating-point format: explicit fraction bits and exponent bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fmt {
    /// Fraction bits (the significand has one more).
    pub frac: u32,
    /// Exponent bits.
    pub exp: u32,
}

/// IEEE binary32.
pub const F32: Fmt = Fmt { frac: 23, exp: 8 };
/// IEEE binary16.
pub const F16: Fmt = Fmt { frac: 10, exp: 5 };
/// bfloat16.
pub const BF16: Fmt = Fmt { frac: 7, exp: 8 };

impl Fmt {
    const fn sign(self) -> u64 {
        1 << (self.frac + self.exp)
    }
    const fn inf(self) -> u64 {
        ((1 << self.exp) - 1) << self.frac
    }
    /// The NaN every arithmetic result and conversion produces (all ones but the sign: f32
    /// 0x7fffffff, f16 and bf16 0x7fff).
    pub const fn canonical_nan(self) -> u64 {
        self.sign() - 1
    }
    fn is_nan(self, b: u64) -> bool {
        b & (self.sign() - 1) > self.inf()
    }
}

/// f32's canonical NaN bits.
pub const NAN32: u32 = 0x7fff_ffff;

/// `x` with subnormal values replaced by a zero of the same sign (`.ftz`).
pub fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// The bits of an f32 result: NaN becomes the canonical NaN.
pub fn canon(x: f32) -> u32 {
    if x.is_nan() { NAN32 } else { x.to_bits() }
}

/// Decodes `bits` of `fmt` exactly.
pub fn to_f64(bits: u64, fmt: Fmt) -> f64 {
    let neg = bits & fmt.sign() != 0;
    let e = ((bits >> fmt.frac) & ((1 << fmt.exp) - 1)) as i32;
    let f = bits & ((1 << fmt.frac) - 1);
    let bias = (1 << (fmt.exp - 1)) - 1;
    let mag = if e == (1 << fmt.exp) - 1 {
        if f == 0 { f64::INFINITY } else { f64::NAN }
    } else if e == 0 {
        f as f64 * 2f64.powi(1 - bias - fmt.frac as i32)
    } else {
        (f | 1 << fmt.frac) as f64 * 2f64.powi(e - bias - fmt.frac as i32)
    };
    if neg { -mag } else { mag }
}

/// Rounds `x` to the nearest value of `fmt`, ties to even (NaN to the canonical NaN).
pub fn round_nearest(x: f64, fmt: Fmt) -> u64 {
    if fmt == F32 {
        return canon(x as f32) as u64;
    }
    if x.is_nan() {
        return fmt.canonical_nan();
    }
    let sign = if x.is_sign_negative() { fmt.sign() } else { 0 };
    let a = x.abs();
    if a.is_infinite() {
        return sign | fmt.inf();
    }
    if a == 0.0 {
        return sign;
    }
    let b = a.to_bits();
    let (mut e, m) = match (b >> 52) as i32 {
        0 => (-1022, b & ((1 << 52) - 1)),
        be => (be - 1023, b & ((1 << 52) - 1) | 1 << 52),
    };
    // Normalise f64 subnormals so that `e` is the exponent of the leading bit.
    let lead = 63 - m.leading_zeros() as i32;
    e -= 52 - lead;
    let bias = (1i32 << (fmt.exp - 1)) - 1;
    let emin = 1 - bias;
    let qe = e.max(emin) - fmt.frac as i32; // exponent of one unit in the last place
    let shift = qe - (e - lead); // low bits of m below the quantum
    let n = if shift <= 0 {
        (m as u128) << (-shift)
    } else if shift > 100 {
        0
    } else {
        let m = m as u128;
        let (n, rem, half) = (m >> shift, m & ((1 << shift) - 1), 1u128 << (shift - 1));
        n + u128::from(rem > half || (rem == half && n & 1 == 1))
    };
    let n = n as u64;
    if e < emin {
        return sign | n; // subnormal, or the smallest normal when rounding carried into it
    }
    let (n, e) = if n >> (fmt.frac + 1) != 0 {
        (n >> 1, e + 1)
    } else {
        (n, e)
    };
    let biased = (e + bias) as u64;
    if biased >= (1 << fmt.exp) - 1 {
        return sign | fmt.inf();
    }
    sign | biased << fmt.frac | (n & ((1 << fmt.frac) - 1))
}

/// The next value of `fmt` toward plus infinity (IEEE nextUp).
pub fn next_up(b: u64, fmt: Fmt) -> u64 {
    if fmt.is_nan(b) || b == fmt.inf() {
        b
    } else if b == fmt.sign() || b == 0 {
        1
    } else if b & fmt.sign() == 0 {
        b + 1
    } else {
        b - 1
    }
}

/// The next value of `fmt` toward minus infinity (IEEE nextDown).
pub fn next_down(b: u64, fmt: Fmt) -> u64 {
    next_up(b ^ fmt.sign(), fmt) ^ fmt.sign()
}

/// Applies a directed mode given the nearest result `rv` and where the exact value lies
/// relative to it (`t_vs_rv`).
fn direct(rv: u64, t_vs_rv: Ordering, fmt: Fmt, rnd: Rnd) -> u64 {
    if fmt.is_nan(rv) {
        return rv;
    }
    let positive = rv & fmt.sign() == 0;
    match (rnd, t_vs_rv) {
        (_, Ordering::Equal) | (Rnd::N, _) => rv,
        (Rnd::M, Ordering::Less) | (Rnd::Z, Ordering::Less) if positive => next_down(rv, fmt),
        (Rnd::P, Ordering::Greater) | (Rnd::Z, Ordering::Greater) if !positive => next_up(rv, fmt),
        (Rnd::M, Ordering::Less) => next_down(rv, fmt),
        (Rnd::P, Ordering::Greater) => next_up(rv, fmt),
        _ => rv,
    }
}

/// Rounds the exact value `s + e` (`e` only through its sign, |e| at most half an f64 ulp
/// of `s`) to `fmt` in mode `rnd`.
pub fn round(s: f64, e: f64, fmt: Fmt, rnd: Rnd) -> u64 {
    let rv = round_nearest(s, fmt);
    let v = to_f64(rv, fmt);
    let rel = if s != v {
        s.partial_cmp(&v).unwrap_or(Ordering::Equal)
    } else {
        e.partial_cmp(&0.0).unwrap_or(Ordering::Equal)
    };
    if rnd == Rnd::N && rel != Ordering::Equal && s != v {
        // s may sit exactly on a midpoint of fmt while the exact value lies past it.
        let nb = if rel == Ordering::Greater {
            next_up(rv, fmt)
        } else {
            next_down(rv, fmt)
        };
        let mid = (v + to_f64(nb, fmt)) / 2.0;
        let past = if rel == Ordering::Greater {
            e > 0.0
        } else {
            e < 0.0
        };
        return if s == mid && past { nb } else { rv };
    }
    direct(rv, rel, fmt, rnd)
}

/// Error-free sum: `a + b = s + e` exactly.
fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    let e = (a - (s - bb)) + (b - bb);
    (s, if e.is_finite() { e } else { 0.0 })
}

/// Flags of an f32 arithmetic instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    /// Rounding mode.
    pub rnd: Rnd,
    /// `.ftz`: subnormal inputs and results become signed zeros.
    pub ftz: bool,
    /// `.sat`: the result is clamped to [0, 1], NaN to 0.
    pub sat: bool,
}

impl Mode {
    /// `.rn`, no flush, no saturation.
    pub const RN: Mode = Mode {
        rnd: Rnd::N,
        ftz: false,
        sat: false,
    };

    fn fr(self, x: f32) -> f32 {
        if self.ftz { ftz(x) } else { x }
    }

    /// The result's bits after flushing, saturation and NaN canonicalisation.
    fn out(self, x: f32) -> u32 {
        let x = self.fr(x);
        if self.sat {
            return if x > 0.0 { x.min(1.0).to_bits() } else { 0 };
        }
        canon(x)
    }
}

/// The exact zero of `a + b` when it is zero: the operands' sign when both are zeros of one
/// sign, otherwise +0 (-0 when rounding toward minus infinity).
fn zero_sum_sign(a: f32, b: f32, rnd: Rnd) -> f32 {
    if a == 0.0 && b == 0.0 && a.is_sign_negative() == b.is_sign_negative() {
        a
    } else if rnd == Rnd::M {
        -0.0
    } else {
        0.0
    }
}

/// `add{.rnd}{.ftz}{.sat}.f32`.
pub fn add(a: f32, b: f32, m: Mode) -> u32 {
    let (a, b) = (m.fr(a), m.fr(b));
    if m.rnd == Rnd::N {
        return m.out(a + b);
    }
    let (s, e) = two_sum(a as f64, b as f64);
    if s == 0.0 && e == 0.0 {
        return m.out(zero_sum_sign(a, b, m.rnd));
    }
    m.out(f32::from_bits(round(s, e, F32, m.rnd) as u32))
}

/// `mul{.rnd}{.ftz}{.sat}.f32` (the product of two f32 is exact in f64).
pub fn mul(a: f32, b: f32, m: Mode) -> u32 {
    let (a, b) = (m.fr(a), m.fr(b));
    if m.rnd == Rnd::N {
        return m.out(a * b);
    }
    m.out(f32::from_bits(
        round(a as f64 * b as f64, 0.0, F32, m.rnd) as u32
    ))
}

/// `fma.rnd{.ftz}{.sat}.f32`: a*b + c rounded once.
pub fn fma(a: f32, b: f32, c: f32, m: Mode) -> u32 {
    let (a, b, c) = (m.fr(a), m.fr(b), m.fr(c));
    let p = a as f64 * b as f64; // exact
    let (s, e) = two_sum(p, c as f64);
    if m.rnd == Rnd::N {
        // s rounded to f32 is the fused result unless s sits exactly on an f32 midpoint
        // (low 29 bits 1000...0) with a non-zero residual, or s is tiny or not finite.
        let normal = s.is_finite() && s.abs() >= f32::MIN_POSITIVE as f64;
        if normal && (e == 0.0 || s.to_bits() & 0x1fff_ffff != 0x1000_0000) {
            return m.out(s as f32);
        }
        return m.out(a.mul_add(b, c));
    }
    if s == 0.0 && e == 0.0 {
        return m.out(zero_sum_sign(
            f32::from_bits(round_nearest(p, F32) as u32),
            c,
            m.rnd,
        ));
    }
    m.out(f32::from_bits(round(s, e, F32, m.rnd) as u32))
}

/// Where the exact quotient a/b lies relative to its nearest f32 `q`.
fn quotient_side(a: f32, b: f32, q: f32) -> Ordering {
    if !(a.is_finite() && b.is_finite() && b != 0.0) || q.is_nan() {
        return Ordering::Equal;
    }
    if q.is_infinite() {
        // Finite operands: the quotient overflowed, so the exact value is finite.
        return if q > 0.0 {
            Ordering::Less
        } else {
            Ordering::Greater
        };
    }
    // q*b is exact in f64 and the rounded difference keeps the exact difference's sign.
    let r = q as f64 * b as f64 - a as f64;
    let q_vs_t = if b > 0.0 {
        r.partial_cmp(&0.0)
    } else {
        0.0.partial_cmp(&r)
    };
    q_vs_t.unwrap_or(Ordering::Equal).reverse()
}

/// `div.rnd{.ftz}{.sat}.f32` (IEEE division).
pub fn div(a: f32, b: f32, m: Mode) -> u32 {
    let (a, b) = (m.fr(a), m.fr(b));
    let q = a / b;
    if m.rnd == Rnd::N {
        return m.out(q);
    }
    let rel = quotient_side(a, b, q);
    m.out(f32::from_bits(
        direct(canon(q) as u64, rel, F32, m.rnd) as u32
    ))
}

/// `rcp.rnd{.ftz}.f32`: 1/a rounded per the mode.
pub fn rcp(a: f32, m: Mode) -> u32 {
    div(1.0, a, m)
}

/// `sqrt.rnd{.ftz}.f32`.
pub fn sqrt(a: f32, m: Mode) -> u32 {
    let a = m.fr(a);
    let r = a.sqrt();
    if m.rnd == Rnd::N || !(r.is_finite() && r > 0.0) {
        return m.out(r);
    }
    let sq = r as f64 * r as f64; // exact
    let rel = (a as f64).partial_cmp(&sq).unwrap_or(Ordering::Equal);
    m.out(f32::from_bits(
        direct(r.to_bits() as u64, rel, F32, m.rnd) as u32
    ))
}

/// `min{.ftz}{.NaN}.f32`: a NaN operand yields the other operand (with `.NaN`, the canonical
/// NaN); two NaNs yield the canonical NaN; -0.0 is smaller than +0.0.
pub fn min(a: f32, b: f32, ftz_: bool, nan: bool) -> u32 {
    minmax(a, b, ftz_, nan, true)
}

/// `max{.ftz}{.NaN}.f32`: as [`min`], +0.0 is larger than -0.0.
pub fn max(a: f32, b: f32, ftz_: bool, nan: bool) -> u32 {
    minmax(a, b, ftz_, nan, false)
}

fn minmax(a: f32, b: f32, flush: bool, nan: bool, want_min: bool) -> u32 {
    let (a, b) = if flush { (ftz(a), ftz(b)) } else { (a, b) };
    let r = match (a.is_nan(), b.is_nan()) {
        (true, true) => return NAN32,
        (true, false) | (false, true) if nan => return NAN32,
        (true, false) => b,
        (false, true) => a,
        (false, false) => {
            let a_first = if a == b {
                // Only zeros of opposite signs differ here.
                a.is_sign_negative() == want_min
            } else {
                (a < b) == want_min
            };
            if a_first { a } else { b }
        }
    };
    r.to_bits()
}

/// `ex2.approx{.ftz}.f32`: 2^a, here correctly rounded (the ISA bounds the hardware's
/// relative error; its exact bits are not modelled). -inf gives +0, +inf gives +inf.
pub fn ex2(a: f32, flush: bool) -> u32 {
    let a = if flush { ftz(a) } else { a };
    let r = (a as f64).exp2() as f32;
    canon(if flush { ftz(r) } else { r })
}

/// `lg2.approx{.ftz}.f32`: log2(a), correctly rounded here; +-0 gives -inf, a negative
/// input NaN, +inf gives +inf.
pub fn lg2(a: f32, flush: bool) -> u32 {
    let a = if flush { ftz(a) } else { a };
    canon((a as f64).log2() as f32)
}

/// The `.approx` unary functions other than ex2/lg2, correctly rounded from f64:
/// `rcp.approx`, `sqrt.approx`, `rsqrt.approx`, `sin.approx`, `cos.approx`, `tanh.approx`.
pub fn approx(f: fn(f64) -> f64, a: f32, flush: bool) -> u32 {
    let a = if flush { ftz(a) } else { a };
    let r = f(a as f64) as f32;
    canon(if flush { ftz(r) } else { r })
}

/// Float to float conversion with rounding (`cvt.rnd.f16.f32`, `cvt.rnd.bf16.f32`,
/// `cvt.rnd.f32.f64`); NaN becomes the destination's canonical NaN.
pub fn convert(x: f64, fmt: Fmt, rnd: Rnd) -> u64 {
    round(x, 0.0, fmt, rnd)
}

/// Integer to float conversion with rounding (`cvt.rnd.f32.s64`, `cvt.rn.f16.u32`, ...):
/// `v` is the integer (at most 64 bits wide), `v as f64` plus its exact residual.
pub fn int_to_float(v: i128, fmt: Fmt, rnd: Rnd) -> u64 {
    let s = v as f64;
    round(s, (v - s as i128) as f64, fmt, rnd)
}

/// f64 from an integer, rounded per the mode.
pub fn int_to_f64(v: i128, rnd: Rnd) -> f64 {
    let r = v as f64;
    let rel = if r.is_finite() {
        v.cmp(&(r as i128))
    } else {
        Ordering::Equal
    };
    let step = match (rnd, rel) {
        (Rnd::N, _) | (_, Ordering::Equal) => 0,
        (Rnd::M, Ordering::Less) => -1,
        (Rnd::P, Ordering::Greater) => 1,
        (Rnd::Z, Ordering::Less) if r > 0.0 => -1,
        (Rnd::Z, Ordering::Greater) if r < 0.0 => 1,
        _ => 0,
    };
    match step {
        -1 => r.next_down(),
        1 => r.next_up(),
        _ => r,
    }
}

/// Rounds a float to an integral value (`.rni`, `.rzi`, `.rmi`, `.rpi`).
pub fn round_int(x: f64, rnd: Rnd) -> f64 {
    match rnd {
        Rnd::N => x.round_ties_even(),
        Rnd::Z => x.trunc(),
        Rnd::M => x.floor(),
        Rnd::P => x.ceil(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_matches_known_bf16_and_f16_values() {
        assert_eq!(round_nearest(1.0, BF16), 0x3f80);
        assert_eq!(round_nearest(1.0 + 2f64.powi(-8), BF16), 0x3f80); // tie -> even
        assert_eq!(round_nearest(1.0 + 3.0 * 2f64.powi(-8), BF16), 0x3f82); // tie -> even (up)
        assert_eq!(round_nearest(65520.0, F16), 0x7c00); // rounds past max -> inf
        assert_eq!(round_nearest(65519.0, F16), 0x7bff);
        assert_eq!(round_nearest(2f64.powi(-24), F16), 1); // smallest subnormal
        assert_eq!(round_nearest(2f64.powi(-25), F16), 0); // tie -> even (zero)
        assert_eq!(round_nearest(f64::NAN, BF16), 0x7fff);
        assert_eq!(round_nearest(-0.0, F16), 0x8000);
    }

    #[test]
    fn directed_modes_step_the_right_way() {
        let third = 1.0f64 / 3.0;
        let n = round_nearest(third, BF16);
        // 1/3 = 1.0101010|1010...b x 2^-2: the nearest bf16 is the one above.
        assert_eq!(n, 0x3eab);
        assert_eq!(convert(third, BF16, Rnd::Z), n - 1);
        assert_eq!(convert(third, BF16, Rnd::P), n);
        assert_eq!(convert(-third, BF16, Rnd::M), n | 0x8000);
        assert_eq!(convert(-third, BF16, Rnd::Z), (n - 1) | 0x8000);
        assert_eq!(convert(1e10, F16, Rnd::Z), 0x7bff);
        assert_eq!(convert(1e10, F16, Rnd::P), 0x7c00);
        assert_eq!(convert(1e-30, F16, Rnd::P), 1);
        assert_eq!(convert(-1e-30, F16, Rnd::M), 0x8001);
    }
}
