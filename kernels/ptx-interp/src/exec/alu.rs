//! Per-lane arithmetic: integer, float, comparison, selection and conversion operations.

use crate::error::FaultKind;
use crate::exec::warp::{Warp, for_lanes};
use crate::float::{self, BF16, F16, F32, Mode, Rnd};
use crate::ir::{BoolOp, Cmp, FBin, FUn, IntOp, IntTy, IntUn, Op, Reg, Src, Ty};

/// `v` truncated to `bits`.
#[inline(always)]
pub(crate) fn trunc(v: u64, bits: u8) -> u64 {
    if bits >= 64 {
        v
    } else {
        v & ((1u64 << bits) - 1)
    }
}

/// `v`'s low `bits` sign-extended.
#[inline(always)]
pub(crate) fn sext(v: u64, bits: u8) -> i64 {
    let s = 64 - bits as u32;
    ((v << s) as i64) >> s
}

#[inline(always)]
fn f(v: u64) -> f32 {
    f32::from_bits(v as u32)
}

#[inline(always)]
fn d64(v: u64) -> f64 {
    f64::from_bits(v)
}

/// `d = f(a, b)` for the lanes of `mask`.
#[inline(always)]
fn map2(w: &mut Warp, mask: u32, d: Reg, a: Src, b: Src, f: impl Fn(u64, u64) -> u64) {
    for_lanes(mask, |l| {
        let v = f(w.get(a, l), w.get(b, l));
        w.set(d, l, v);
    });
}

/// `d = f(a, b, c)` for the lanes of `mask`; the first lane whose `f` fails stops it.
#[inline(always)]
fn try_map3(
    w: &mut Warp,
    mask: u32,
    d: Reg,
    a: Src,
    b: Src,
    c: Src,
    f: impl Fn(u64, u64, u64) -> Result<u64, FaultKind>,
) -> Result<(), (usize, FaultKind)> {
    let mut m = mask;
    while m != 0 {
        let l = m.trailing_zeros() as usize;
        m &= m - 1;
        let v = f(w.get(a, l), w.get(b, l), w.get(c, l)).map_err(|k| (l, k))?;
        w.set(d, l, v);
    }
    Ok(())
}

/// Executes an arithmetic, comparison, selection, move or conversion op on `mask`;
/// `Ok(false)` when `op` is none of these.
pub(crate) fn alu(w: &mut Warp, op: &Op, mask: u32) -> Result<bool, (usize, FaultKind)> {
    match *op {
        Op::Mov { d, a, bits } => map2(w, mask, d, a, a, |x, _| trunc(x, bits)),
        Op::Int { op, t, d, a, b, c } => match op {
            // The common forms without a fault path, kept out of `int_bin`'s general match.
            IntOp::Add => map2(w, mask, d, a, b, |x, y| trunc(x.wrapping_add(y), t.bits)),
            IntOp::MulWide if !t.signed => map2(w, mask, d, a, b, |x, y| {
                trunc(x, t.bits).wrapping_mul(trunc(y, t.bits))
            }),
            IntOp::Shl => map2(w, mask, d, a, b, |x, y| {
                if (y as u32) >= t.bits as u32 {
                    0
                } else {
                    trunc(x << y, t.bits)
                }
            }),
            _ => try_map3(w, mask, d, a, b, c, |x, y, z| int_bin(op, t, x, y, z))?,
        },
        Op::IntUn { op, t, d, a } => map2(w, mask, d, a, a, |x, _| int_un(op, t, x)),
        Op::F32 { op, m, d, a, b } => match op {
            FBin::Add => map2(w, mask, d, a, b, |x, y| float::add(f(x), f(y), m) as u64),
            FBin::Sub => map2(w, mask, d, a, b, |x, y| float::add(f(x), -f(y), m) as u64),
            FBin::Mul => map2(w, mask, d, a, b, |x, y| float::mul(f(x), f(y), m) as u64),
            FBin::Div => map2(w, mask, d, a, b, |x, y| float::div(f(x), f(y), m) as u64),
            FBin::Min { nan } => map2(w, mask, d, a, b, |x, y| {
                float::min(f(x), f(y), m.ftz, nan) as u64
            }),
            FBin::Max { nan } => map2(w, mask, d, a, b, |x, y| {
                float::max(f(x), f(y), m.ftz, nan) as u64
            }),
        },
        Op::Fma32 { m, d, a, b, c } => try_map3(w, mask, d, a, b, c, |x, y, z| {
            Ok(float::fma(f(x), f(y), f(z), m) as u64)
        })?,
        Op::F32Un { op, m, d, a } => map2(w, mask, d, a, a, |x, _| f32_un(op, m, f(x)) as u64),
        Op::F64 { op, d, a, b } => map2(w, mask, d, a, b, |x, y| f64_bin(op, d64(x), d64(y))),
        Op::Fma64 { d, a, b, c } => try_map3(w, mask, d, a, b, c, |x, y, z| {
            Ok(d64(x).mul_add(d64(y), d64(z)).to_bits())
        })?,
        Op::F64Un { op, d, a } => map2(w, mask, d, a, a, |x, _| f64_un(op, d64(x))),
        _ => return other(w, op, mask),
    }
    Ok(true)
}

/// Comparisons, selections, predicate logic, packing and conversions; `Ok(false)` for any
/// other op.
fn other(w: &mut Warp, op: &Op, mask: u32) -> Result<bool, (usize, FaultKind)> {
    match *op {
        Op::Setp {
            cmp,
            t,
            p,
            q,
            a,
            b,
            comb,
        } => for_lanes(mask, |l| {
            let r = compare(cmp, t, w.get(a, l), w.get(b, l));
            let (rp, rq) = match comb {
                Some((bop, c, neg)) => {
                    let cv = (w.get(c, l) & 1 != 0) != neg;
                    (boolop(bop, r, cv), boolop(bop, !r, cv))
                }
                None => (r, !r),
            };
            w.set(p, l, rp as u64);
            if let Some(q) = q {
                w.set(q, l, rq as u64);
            }
        }),
        Op::Selp { d, a, b, c } => for_lanes(mask, |l| {
            let v = if w.get(c, l) & 1 != 0 {
                w.get(a, l)
            } else {
                w.get(b, l)
            };
            w.set(d, l, v);
        }),
        Op::Pred { op, d, a, b } => map2(w, mask, d, a, b, |x, y| match op {
            Some(o) => boolop(o, x & 1 != 0, y & 1 != 0) as u64,
            None => (x & 1 == 0) as u64,
        }),
        Op::Pack {
            d,
            ref parts,
            width,
        } => for_lanes(mask, |l| {
            let v = parts.iter().enumerate().fold(0u64, |acc, (k, p)| {
                acc | trunc(w.get(*p, l), width) << (k as u32 * width as u32)
            });
            w.set(d, l, v);
        }),
        Op::Unpack { ref ds, a, width } => for_lanes(mask, |l| {
            let v = w.get(a, l);
            for (k, d) in ds.iter().enumerate() {
                w.set(*d, l, trunc(v >> (k as u32 * width as u32), width));
            }
        }),
        Op::Cvt {
            d,
            a,
            to,
            from,
            rnd,
            int_rnd,
            ftz,
            sat,
        } => map2(w, mask, d, a, a, |x, _| {
            cvt(x, to, from, rnd.unwrap_or(Rnd::N), int_rnd, ftz, sat)
        }),
        Op::CvtPack {
            d,
            hi,
            lo,
            fmt,
            rnd,
        } => map2(w, mask, d, hi, lo, |h, l| {
            float::convert(f(h) as f64, fmt, rnd) << 16 | float::convert(f(l) as f64, fmt, rnd)
        }),
        _ => return Ok(false),
    }
    Ok(true)
}

fn boolop(op: BoolOp, a: bool, b: bool) -> bool {
    match op {
        BoolOp::And => a && b,
        BoolOp::Or => a || b,
        BoolOp::Xor => a != b,
    }
}

/// Two- and three-operand integer operations at width `t`.
pub(crate) fn int_bin(op: IntOp, t: IntTy, a: u64, b: u64, c: u64) -> Result<u64, FaultKind> {
    let bits = t.bits;
    let (ua, ub) = (trunc(a, bits), trunc(b, bits));
    let (sa, sb) = (sext(a, bits), sext(b, bits));
    let wide = |x: u64, y: u64| -> u64 {
        if t.signed {
            (sext(x, bits) as i128 * sext(y, bits) as i128) as u64
        } else {
            (trunc(x, bits) as u128 * trunc(y, bits) as u128) as u64
        }
    };
    let hi = || -> u64 {
        let p = if t.signed {
            sa as i128 * sb as i128
        } else {
            (ua as u128 * ub as u128) as i128
        };
        (p >> bits) as u64
    };
    let v = match op {
        IntOp::Add => a.wrapping_add(b),
        IntOp::Sub => a.wrapping_sub(b),
        IntOp::MulLo => a.wrapping_mul(b),
        IntOp::MulHi => hi(),
        IntOp::MulWide => return Ok(trunc(wide(a, b), (bits * 2).min(64))),
        IntOp::MadLo => a.wrapping_mul(b).wrapping_add(c),
        IntOp::MadHi => hi().wrapping_add(c),
        IntOp::MadWide => return Ok(trunc(wide(a, b).wrapping_add(c), (bits * 2).min(64))),
        IntOp::Div | IntOp::Rem if ub == 0 => return Err(FaultKind::DivideByZero),
        IntOp::Div if t.signed => sa.wrapping_div(sb) as u64,
        IntOp::Div => ua / ub,
        IntOp::Rem if t.signed => sa.wrapping_rem(sb) as u64,
        IntOp::Rem => ua % ub,
        IntOp::Min if t.signed => sa.min(sb) as u64,
        IntOp::Min => ua.min(ub),
        IntOp::Max if t.signed => sa.max(sb) as u64,
        IntOp::Max => ua.max(ub),
        IntOp::And => a & b,
        IntOp::Or => a | b,
        IntOp::Xor => a ^ b,
        // Shift amounts are unsigned 32-bit and clamp at the width.
        IntOp::Shl => {
            if (b as u32) >= bits as u32 {
                0
            } else {
                a << (b as u32)
            }
        }
        IntOp::Shr if t.signed => (sa >> (b as u32).min(bits as u32 - 1)) as u64,
        IntOp::Shr => {
            if (b as u32) >= bits as u32 {
                0
            } else {
                ua >> (b as u32)
            }
        }
    };
    Ok(trunc(v, bits))
}

fn int_un(op: IntUn, t: IntTy, a: u64) -> u64 {
    let bits = t.bits;
    let ua = trunc(a, bits);
    let v = match op {
        IntUn::Not => !a,
        IntUn::Cnot => (ua == 0) as u64,
        IntUn::Neg => a.wrapping_neg(),
        IntUn::Abs => sext(a, bits).unsigned_abs(),
        IntUn::Clz => (ua.leading_zeros() - (64 - bits as u32)) as u64,
        IntUn::Popc => ua.count_ones() as u64,
        IntUn::Brev => ua.reverse_bits() >> (64 - bits as u32),
    };
    trunc(v, bits)
}

fn f32_un(op: FUn, m: Mode, x: f32) -> u32 {
    let fx = if m.ftz { float::ftz(x) } else { x };
    match op {
        FUn::Neg => float::canon(-fx),
        FUn::Abs => float::canon(fx.abs()),
        FUn::Rcp => float::rcp(x, m),
        FUn::Sqrt => float::sqrt(x, m),
        FUn::Ex2 => float::ex2(x, m.ftz),
        FUn::Lg2 => float::lg2(x, m.ftz),
        FUn::RcpApprox => float::approx(|v| 1.0 / v, x, m.ftz),
        FUn::SqrtApprox => float::approx(f64::sqrt, x, m.ftz),
        FUn::RsqrtApprox => float::approx(|v| 1.0 / v.sqrt(), x, m.ftz),
        FUn::Sin => float::approx(f64::sin, x, m.ftz),
        FUn::Cos => float::approx(f64::cos, x, m.ftz),
        FUn::Tanh => float::approx(f64::tanh, x, m.ftz),
    }
}

fn f64_bin(op: FBin, a: f64, b: f64) -> u64 {
    let r = match op {
        FBin::Add => a + b,
        FBin::Sub => a - b,
        FBin::Mul => a * b,
        FBin::Div => a / b,
        FBin::Min { nan } | FBin::Max { nan } if nan && (a.is_nan() || b.is_nan()) => f64::NAN,
        FBin::Min { .. } => {
            if a < b || (a == b && a.is_sign_negative()) || b.is_nan() {
                a
            } else {
                b
            }
        }
        FBin::Max { .. } => {
            if a > b || (a == b && b.is_sign_negative()) || b.is_nan() {
                a
            } else {
                b
            }
        }
    };
    r.to_bits()
}

fn f64_un(op: FUn, a: f64) -> u64 {
    match op {
        FUn::Neg => (-a).to_bits(),
        FUn::Abs => a.abs().to_bits(),
        FUn::Rcp | FUn::RcpApprox => (1.0 / a).to_bits(),
        FUn::Sqrt | FUn::SqrtApprox => a.sqrt().to_bits(),
        FUn::RsqrtApprox => (1.0 / a.sqrt()).to_bits(),
        FUn::Ex2 => a.exp2().to_bits(),
        FUn::Lg2 => a.log2().to_bits(),
        FUn::Sin => a.sin().to_bits(),
        FUn::Cos => a.cos().to_bits(),
        FUn::Tanh => a.tanh().to_bits(),
    }
}

/// A float register's value as f64 (exact for every format here).
fn fval(v: u64, t: Ty) -> f64 {
    match t {
        Ty::F16 => float::to_f64(v & 0xffff, F16),
        Ty::Bf16 => float::to_f64(v & 0xffff, BF16),
        Ty::F32 => f(v) as f64,
        _ => d64(v),
    }
}

fn compare(cmp: Cmp, t: Ty, a: u64, b: u64) -> bool {
    if let Ty::Int(it) = t {
        let o = if it.signed {
            sext(a, it.bits).cmp(&sext(b, it.bits))
        } else {
            trunc(a, it.bits).cmp(&trunc(b, it.bits))
        };
        return match cmp {
            Cmp::Eq | Cmp::Equ => o.is_eq(),
            Cmp::Ne | Cmp::Neu => o.is_ne(),
            Cmp::Lt | Cmp::Ltu => o.is_lt(),
            Cmp::Le | Cmp::Leu => o.is_le(),
            Cmp::Gt | Cmp::Gtu => o.is_gt(),
            Cmp::Ge | Cmp::Geu => o.is_ge(),
            Cmp::Num => true,
            Cmp::Nan => false,
        };
    }
    let (x, y) = (fval(a, t), fval(b, t));
    let unordered = x.is_nan() || y.is_nan();
    match cmp {
        Cmp::Eq => x == y,
        Cmp::Ne => !unordered && x != y,
        Cmp::Lt => x < y,
        Cmp::Le => x <= y,
        Cmp::Gt => x > y,
        Cmp::Ge => x >= y,
        Cmp::Equ => unordered || x == y,
        Cmp::Neu => unordered || x != y,
        Cmp::Ltu => unordered || x < y,
        Cmp::Leu => unordered || x <= y,
        Cmp::Gtu => unordered || x > y,
        Cmp::Geu => unordered || x >= y,
        Cmp::Num => !unordered,
        Cmp::Nan => unordered,
    }
}

fn int_range(t: IntTy) -> (i128, i128) {
    if t.signed {
        (-(1i128 << (t.bits - 1)), (1i128 << (t.bits - 1)) - 1)
    } else {
        (0, (1i128 << t.bits) - 1)
    }
}

fn float_bits(x: f64, to: Ty, rnd: Rnd) -> u64 {
    match to {
        Ty::F16 => float::convert(x, F16, rnd),
        Ty::Bf16 => float::convert(x, BF16, rnd),
        Ty::F32 => float::convert(x, F32, rnd),
        _ => x.to_bits(),
    }
}

/// `cvt`: every pairing of integer and float types.
fn cvt(a: u64, to: Ty, from: Ty, rnd: Rnd, int_rnd: bool, ftz: bool, sat: bool) -> u64 {
    let flush = |x: f64, t: Ty| {
        if ftz && t == Ty::F32 {
            float::ftz(x as f32) as f64
        } else {
            x
        }
    };
    let clamp01 = |x: f64| if x > 0.0 { x.min(1.0) } else { 0.0 };
    match (from, to) {
        (Ty::Int(fi), Ty::Int(ti)) => {
            let v = if fi.signed {
                sext(a, fi.bits) as i128
            } else {
                trunc(a, fi.bits) as i128
            };
            let (lo, hi) = int_range(ti);
            trunc((if sat { v.clamp(lo, hi) } else { v }) as u64, ti.bits)
        }
        (Ty::Int(fi), to) => {
            let v = if fi.signed {
                sext(a, fi.bits) as i128
            } else {
                trunc(a, fi.bits) as i128
            };
            let bits = match to {
                Ty::F64 => float::int_to_f64(v, rnd).to_bits(),
                Ty::F16 => float::int_to_float(v, F16, rnd),
                Ty::Bf16 => float::int_to_float(v, BF16, rnd),
                _ => float::int_to_float(v, F32, rnd),
            };
            if sat {
                float_bits(clamp01(fval(bits, to)), to, Rnd::N)
            } else {
                bits
            }
        }
        (from, Ty::Int(ti)) => {
            let x = float::round_int(flush(fval(a, from), from), rnd);
            if x.is_nan() {
                return 0;
            }
            let (lo, hi) = int_range(ti);
            let v = if x <= lo as f64 {
                lo
            } else if x >= hi as f64 {
                hi
            } else {
                x as i128
            };
            trunc(v as u64, ti.bits)
        }
        (from, to) => {
            let mut x = flush(fval(a, from), from);
            if int_rnd {
                x = float::round_int(x, rnd);
            }
            if sat {
                x = if x.is_nan() { 0.0 } else { clamp01(x) };
            }
            let bits = float_bits(x, to, rnd);
            if ftz && to == Ty::F32 {
                float::ftz(f32::from_bits(bits as u32)).to_bits() as u64
            } else {
                bits
            }
        }
    }
}
