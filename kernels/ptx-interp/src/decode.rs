//! One instruction's opcode, modifiers and operands to an [`Op`]. Every modifier must be
//! understood: a leftover one makes the instruction [`Op::Unimplemented`], so nothing is
//! silently ignored (cache and eviction hints, which do not change results, are the
//! exception and are listed in `is_hint`).

use crate::float::{BF16, F16, Mode, Rnd};
use crate::ir::{BoolOp, Cmp, FBin, FUn, IntOp, IntTy, IntUn, Op, ShflMode, Space, Src, Ty};
use crate::lower::{Cx, int_ty, ty};
use crate::parse::{InstAst, Operand};

/// The modifiers of an opcode, consumed as they are understood.
struct Mods {
    base: String,
    rest: Vec<String>,
}

impl Mods {
    fn new(opcode: &str) -> Mods {
        let mut parts = opcode.split('.');
        let base = parts.next().unwrap_or("").to_string();
        Mods {
            base,
            rest: parts.filter(|p| !is_hint(p)).map(str::to_string).collect(),
        }
    }

    fn has(&mut self, m: &str) -> bool {
        match self.rest.iter().position(|r| r == m) {
            Some(i) => {
                self.rest.remove(i);
                true
            }
            None => false,
        }
    }

    fn one_of<'a>(&mut self, opts: &[&'a str]) -> Option<&'a str> {
        opts.iter().copied().find(|o| self.has(o))
    }

    /// The first remaining modifier that is a type, removed.
    fn ty(&mut self) -> Option<(String, Ty)> {
        let i = self
            .rest
            .iter()
            .position(|r| ty(r).is_some() || r == "f16x2" || r == "bf16x2")?;
        let name = self.rest.remove(i);
        let t = ty(&name).unwrap_or(Ty::F32);
        Some((name, t))
    }

    fn rnd(&mut self) -> Option<Rnd> {
        self.one_of(&["rn", "rz", "rm", "rp"]).map(rnd_of)
    }

    /// `Err` naming the modifiers left over.
    fn done(&self) -> Result<(), String> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "modifier `.{}` of `{}` is not implemented",
                self.rest.join("."),
                self.base
            ))
        }
    }
}

fn rnd_of(s: &str) -> Rnd {
    match s {
        "rz" | "rzi" => Rnd::Z,
        "rm" | "rmi" => Rnd::M,
        "rp" | "rpi" => Rnd::P,
        _ => Rnd::N,
    }
}

/// Cache, eviction and prefetch hints: they change no value.
fn is_hint(m: &str) -> bool {
    m.starts_with("L1::")
        || m.starts_with("L2::")
        || matches!(m, "ca" | "cg" | "cs" | "lu" | "cv" | "wb" | "wt")
}

fn unimpl(i: &InstAst, why: impl Into<String>) -> Op {
    Op::Unimplemented(format!("{} ({})", i.opcode, why.into()))
}

/// Decodes one instruction; `Err` is a malformed instruction (a load error), while an
/// instruction the interpreter does not execute decodes to [`Op::Unimplemented`].
pub(crate) fn decode(cx: &Cx, i: &InstAst) -> Result<Op, String> {
    let mut m = Mods::new(&i.opcode);
    let op = match m.base.as_str() {
        "mov" => mov(cx, i, &mut m)?,
        "cvta" => cvta(cx, i, &mut m)?,
        "add" | "sub" | "mul" | "mad" | "fma" | "div" | "rem" | "min" | "max" | "and" | "or"
        | "xor" | "shl" | "shr" => binary(cx, i, &mut m)?,
        "not" | "cnot" | "neg" | "abs" | "clz" | "popc" | "brev" | "rcp" | "sqrt" | "rsqrt"
        | "ex2" | "lg2" | "sin" | "cos" | "tanh" => unary(cx, i, &mut m)?,
        "setp" => setp(cx, i, &mut m)?,
        "selp" => {
            let (_, t) = m.ty().ok_or("missing type")?;
            let o = ops(i, 4)?;
            Op::Selp {
                d: cx.dst(&o[0])?,
                a: cx.src(&o[1], t)?,
                b: cx.src(&o[2], t)?,
                c: cx.src(&o[3], Ty::Pred)?,
            }
        }
        "cvt" => cvt(cx, i, &mut m)?,
        "ld" | "ldu" => ld(cx, i, &mut m)?,
        "st" => st(cx, i, &mut m)?,
        "cp" => cp(cx, i, &mut m)?,
        "ldmatrix" => ldmatrix(cx, i, &mut m)?,
        "mma" => mma(cx, i, &mut m)?,
        "shfl" => shfl(cx, i, &mut m)?,
        "bar" | "barrier" if m.rest.first().is_some_and(|r| r == "warp") => {
            m.has("warp");
            if !m.has("sync") {
                return Ok(unimpl(i, "only bar.warp.sync"));
            }
            let o = ops(i, 1)?;
            Op::WarpBar {
                mask: cx.src(&o[0], Ty::Int(U32))?,
            }
        }
        "bar" | "barrier" => {
            m.has("cta");
            if !m.has("sync") {
                return Ok(unimpl(i, "only bar.sync is implemented"));
            }
            m.has("aligned");
            let o = i.operands.as_slice();
            if o.first() != Some(&Operand::Int(0)) {
                return Ok(unimpl(i, "only barrier 0 is modelled"));
            }
            let count = o.get(1).map(|c| cx.src(c, Ty::Int(U32))).transpose()?;
            Op::Bar { count }
        }
        "bra" => {
            let uni = m.has("uni");
            Op::Bra { target: 0, uni }
        }
        "ret" | "exit" => Op::Exit,
        other => return Ok(unimpl(i, format!("`{other}` is not implemented"))),
    };
    if let Err(e) = m.done() {
        return Ok(unimpl(i, e));
    }
    Ok(op)
}

const U32: IntTy = IntTy {
    bits: 32,
    signed: false,
};

/// Exactly `n` operands.
fn ops(i: &InstAst, n: usize) -> Result<&[Operand], String> {
    if i.operands.len() == n {
        Ok(&i.operands)
    } else {
        Err(format!("expected {n} operands, found {}", i.operands.len()))
    }
}

fn mov(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let (_, t) = m.ty().ok_or("missing type")?;
    let o = ops(i, 2)?;
    let bits = t.bits();
    Ok(match (&o[0], &o[1]) {
        (Operand::Vector(ds), a) => {
            let ds = ds
                .iter()
                .map(|d| cx.dst(d))
                .collect::<Result<Vec<_>, _>>()?;
            let width = bits / ds.len() as u8;
            Op::Unpack {
                a: cx.src(a, t)?,
                width,
                ds,
            }
        }
        (d, Operand::Vector(parts)) => {
            let width = bits / parts.len() as u8;
            let pt = Ty::Int(IntTy {
                bits: width,
                signed: false,
            });
            let parts = parts
                .iter()
                .map(|p| cx.src(p, pt))
                .collect::<Result<Vec<_>, _>>()?;
            Op::Pack {
                d: cx.dst(d)?,
                parts,
                width,
            }
        }
        (d, a) => Op::Mov {
            d: cx.dst(d)?,
            a: cx.src(a, t)?,
            bits,
        },
    })
}

fn cvta(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let to = m.has("to");
    let space = m.one_of(&["global", "shared"]);
    m.ty().ok_or("missing type")?;
    let o = ops(i, 2)?;
    let (d, a) = (
        cx.dst(&o[0])?,
        cx.src(
            &o[1],
            Ty::Int(IntTy {
                bits: 64,
                signed: false,
            }),
        )?,
    );
    Ok(match space {
        Some("global") => Op::Mov { d, a, bits: 64 },
        Some(_) => Op::CvtaShared {
            d,
            a,
            to_generic: !to,
        },
        None => unimpl(i, "only the global and shared windows are implemented"),
    })
}

fn fmode(m: &mut Mods, rnd: Rnd) -> Mode {
    Mode {
        rnd: m.rnd().unwrap_or(rnd),
        ftz: m.has("ftz"),
        sat: m.has("sat"),
    }
}

fn binary(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let base = m.base.clone();
    let (tname, t) = m.ty().ok_or("missing type")?;
    let three = matches!(base.as_str(), "mad" | "fma");
    let o = ops(i, if three { 4 } else { 3 })?;
    let d = cx.dst(&o[0])?;
    match t {
        Ty::F32 | Ty::F64 => float_binary(cx, i, m, &base, t, o),
        Ty::Int(it) => int_binary(cx, i, m, &base, it, o),
        Ty::Pred if matches!(base.as_str(), "and" | "or" | "xor") => {
            let op = match base.as_str() {
                "and" => BoolOp::And,
                "or" => BoolOp::Or,
                _ => BoolOp::Xor,
            };
            Ok(Op::Pred {
                op: Some(op),
                d,
                a: cx.src(&o[1], t)?,
                b: cx.src(&o[2], t)?,
            })
        }
        _ => Ok(unimpl(i, format!("`{base}` on .{tname}"))),
    }
}

/// f32 and f64 `add sub mul div min max mad fma`. `div.approx`/`div.full` compute the IEEE
/// quotient, which lies within their stated error.
fn float_binary(
    cx: &Cx,
    i: &InstAst,
    m: &mut Mods,
    base: &str,
    t: Ty,
    o: &[Operand],
) -> Result<Op, String> {
    if t == Ty::F32 {
        m.has("approx");
        m.has("full");
    }
    let nan = m.has("NaN");
    let mode = fmode(m, Rnd::N);
    if t == Ty::F64 && (mode.rnd != Rnd::N || mode.ftz || mode.sat) {
        return Ok(unimpl(i, "directed rounding, .ftz or .sat on f64"));
    }
    let (d, a, b) = (cx.dst(&o[0])?, cx.src(&o[1], t)?, cx.src(&o[2], t)?);
    let op = match base {
        "add" => FBin::Add,
        "sub" => FBin::Sub,
        "mul" => FBin::Mul,
        "div" => FBin::Div,
        "min" => FBin::Min { nan },
        "max" => FBin::Max { nan },
        "mad" | "fma" => {
            let c = cx.src(&o[3], t)?;
            return Ok(if t == Ty::F32 {
                Op::Fma32 {
                    m: mode,
                    d,
                    a,
                    b,
                    c,
                }
            } else {
                Op::Fma64 { d, a, b, c }
            });
        }
        _ => return Ok(unimpl(i, format!("`{base}` on a float type"))),
    };
    Ok(if t == Ty::F32 {
        Op::F32 {
            op,
            m: mode,
            d,
            a,
            b,
        }
    } else {
        Op::F64 { op, d, a, b }
    })
}

fn int_binary(
    cx: &Cx,
    i: &InstAst,
    m: &mut Mods,
    base: &str,
    t: IntTy,
    o: &[Operand],
) -> Result<Op, String> {
    let part = m.one_of(&["lo", "hi", "wide"]);
    let op = match (base, part) {
        ("add", None) => IntOp::Add,
        ("sub", None) => IntOp::Sub,
        ("mul", Some("lo")) => IntOp::MulLo,
        ("mul", Some("hi")) => IntOp::MulHi,
        ("mul", Some("wide")) => IntOp::MulWide,
        ("mad", Some("lo")) => IntOp::MadLo,
        ("mad", Some("hi")) => IntOp::MadHi,
        ("mad", Some("wide")) => IntOp::MadWide,
        ("div", None) => IntOp::Div,
        ("rem", None) => IntOp::Rem,
        ("min", None) => IntOp::Min,
        ("max", None) => IntOp::Max,
        ("and", None) => IntOp::And,
        ("or", None) => IntOp::Or,
        ("xor", None) => IntOp::Xor,
        ("shl", None) => IntOp::Shl,
        ("shr", None) => IntOp::Shr,
        _ => return Ok(unimpl(i, format!("integer `{base}`"))),
    };
    let wide = matches!(op, IntOp::MulWide | IntOp::MadWide);
    let at = Ty::Int(t);
    let st = if matches!(op, IntOp::Shl | IntOp::Shr) {
        Ty::Int(U32)
    } else {
        at
    };
    let ct = if wide {
        Ty::Int(IntTy {
            bits: t.bits * 2,
            signed: t.signed,
        })
    } else {
        at
    };
    let c = if o.len() == 4 {
        cx.src(&o[3], ct)?
    } else {
        Src::I(0)
    };
    Ok(Op::Int {
        op,
        t,
        d: cx.dst(&o[0])?,
        a: cx.src(&o[1], at)?,
        b: cx.src(&o[2], st)?,
        c,
    })
}

fn unary(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let base = m.base.clone();
    let (tname, t) = m.ty().ok_or("missing type")?;
    let o = ops(i, 2)?;
    let (d, a) = (cx.dst(&o[0])?, cx.src(&o[1], t)?);
    match t {
        Ty::Int(it) => {
            let op = match base.as_str() {
                "not" => IntUn::Not,
                "cnot" => IntUn::Cnot,
                "neg" => IntUn::Neg,
                "abs" => IntUn::Abs,
                "clz" => IntUn::Clz,
                "popc" => IntUn::Popc,
                "brev" => IntUn::Brev,
                _ => return Ok(unimpl(i, format!("`{base}` on .{tname}"))),
            };
            Ok(Op::IntUn { op, t: it, d, a })
        }
        Ty::Pred if base == "not" => Ok(Op::Pred {
            op: None,
            d,
            a,
            b: Src::I(0),
        }),
        Ty::F32 | Ty::F64 => {
            let approx = m.has("approx");
            let op = match (base.as_str(), approx) {
                ("neg", false) => FUn::Neg,
                ("abs", false) => FUn::Abs,
                ("rcp", false) => FUn::Rcp,
                ("sqrt", false) => FUn::Sqrt,
                ("rcp", true) => FUn::RcpApprox,
                ("sqrt", true) => FUn::SqrtApprox,
                ("rsqrt", true) => FUn::RsqrtApprox,
                ("ex2", true) => FUn::Ex2,
                ("lg2", true) => FUn::Lg2,
                ("sin", true) => FUn::Sin,
                ("cos", true) => FUn::Cos,
                ("tanh", true) => FUn::Tanh,
                _ => {
                    return Ok(unimpl(
                        i,
                        format!("`{base}` without .approx or with it where the ISA has none"),
                    ));
                }
            };
            if t == Ty::F64 {
                if m.one_of(&["rz", "rm", "rp"]).is_some() {
                    return Ok(unimpl(i, "directed rounding of f64"));
                }
                m.has("rn");
                return Ok(Op::F64Un { op, d, a });
            }
            let needs_rnd = matches!(op, FUn::Rcp | FUn::Sqrt);
            let mode = fmode(m, Rnd::N);
            if needs_rnd != (mode.rnd != Rnd::N || i.opcode.contains(".rn")) {
                return Ok(unimpl(i, "rounding modifier"));
            }
            Ok(Op::F32Un { op, m: mode, d, a })
        }
        _ => Ok(unimpl(i, format!("`{base}` on .{tname}"))),
    }
}

fn cmp_of(s: &str) -> Option<Cmp> {
    Some(match s {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" | "lo" => Cmp::Lt,
        "le" | "ls" => Cmp::Le,
        "gt" | "hi" => Cmp::Gt,
        "ge" | "hs" => Cmp::Ge,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}

fn setp(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let cname = m.rest.first().cloned().ok_or("missing comparison")?;
    let cmp = cmp_of(&cname).ok_or(format!("unknown comparison `.{cname}`"))?;
    m.rest.remove(0);
    let bop = m.one_of(&["and", "or", "xor"]).map(|b| match b {
        "and" => BoolOp::And,
        "or" => BoolOp::Or,
        _ => BoolOp::Xor,
    });
    let ftz = m.has("ftz");
    let (_, t) = m.ty().ok_or("missing type")?;
    let o = &i.operands;
    if o.len() != 3 + usize::from(bop.is_some()) {
        return Err(format!(
            "expected {} operands",
            3 + usize::from(bop.is_some())
        ));
    }
    let (p, q) = match &o[0] {
        Operand::Pair(p, q) => (cx.reg(p)?, Some(cx.reg(q)?)),
        d => (cx.dst(d)?, None),
    };
    let comb = match (bop, o.get(3)) {
        (Some(b), Some(Operand::Not(c))) => Some((b, Src::R(cx.reg(c)?), true)),
        (Some(b), Some(c)) => Some((b, cx.src(c, Ty::Pred)?, false)),
        _ => None,
    };
    if ftz && t == Ty::F32 {
        return Ok(Op::Unimplemented(format!("{} (.ftz comparison)", i.opcode)));
    }
    Ok(Op::Setp {
        cmp,
        t,
        p,
        q,
        a: cx.src(&o[1], t)?,
        b: cx.src(&o[2], t)?,
        comb,
    })
}

fn cvt(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let r = m.one_of(&["rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi"]);
    let (ftz, sat) = (m.has("ftz"), m.has("sat"));
    let (to_name, to) = m.ty().ok_or("missing destination type")?;
    let (_, from) = m.ty().ok_or("missing source type")?;
    if to_name == "bf16x2" || to_name == "f16x2" {
        let o = ops(i, 3)?;
        if from != Ty::F32 || !matches!(r, Some("rn" | "rz" | "rm" | "rp")) || ftz || sat {
            return Ok(unimpl(
                i,
                "packed conversion other than cvt.rnd.{bf16x2,f16x2}.f32",
            ));
        }
        let fmt = if to_name == "bf16x2" { BF16 } else { F16 };
        return Ok(Op::CvtPack {
            d: cx.dst(&o[0])?,
            hi: cx.src(&o[1], from)?,
            lo: cx.src(&o[2], from)?,
            fmt,
            rnd: rnd_of(r.unwrap_or("rn")),
        });
    }
    let o = ops(i, 2)?;
    let int_rnd = matches!(r, Some("rni" | "rzi" | "rmi" | "rpi"));
    Ok(Op::Cvt {
        d: cx.dst(&o[0])?,
        a: cx.src(&o[1], from)?,
        to,
        from,
        rnd: r.map(rnd_of),
        int_rnd,
        ftz,
        sat,
    })
}

fn space(m: &mut Mods) -> Option<Space> {
    match m.one_of(&["global", "shared", "param", "local", "const"]) {
        Some("global") => Some(Space::Global),
        Some("shared") => Some(Space::Shared),
        Some("param") => Some(Space::Param),
        Some(_) => None,
        None => Some(Space::Generic),
    }
}

fn vec_n(m: &mut Mods) -> u8 {
    match m.one_of(&["v2", "v4"]) {
        Some("v2") => 2,
        Some(_) => 4,
        None => 1,
    }
}

fn ld(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    m.has("shared::cta");
    let Some(space) = space(m) else {
        return Ok(unimpl(i, "local and const spaces"));
    };
    let nc = m.has("nc") || m.base == "ldu";
    m.has("volatile");
    let n = vec_n(m);
    let (tname, t) = m.ty().ok_or("missing type")?;
    let o = ops(i, 2)?;
    let d = dsts(cx, &o[0], n)?;
    let sext = matches!(int_ty(&tname), Some(IntTy { signed: true, .. }));
    Ok(Op::Ld {
        space,
        bytes: t.bits() / 8,
        n,
        d,
        addr: cx.addr(&o[1])?,
        sext,
        nc,
    })
}

fn st(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    m.has("shared::cta");
    let Some(space) = space(m) else {
        return Ok(unimpl(i, "local and const spaces"));
    };
    if space == Space::Param {
        return Ok(unimpl(i, "stores to the param space"));
    }
    m.has("volatile");
    let n = vec_n(m);
    let (_, t) = m.ty().ok_or("missing type")?;
    let o = ops(i, 2)?;
    let mut a = [Src::I(0); 4];
    match &o[1] {
        Operand::Vector(v) if v.len() == n as usize => {
            for (k, r) in v.iter().enumerate() {
                a[k] = cx.src(r, t)?;
            }
        }
        r if n == 1 => a[0] = cx.src(r, t)?,
        _ => return Err("vector width and source count differ".into()),
    }
    Ok(Op::St {
        space,
        bytes: t.bits() / 8,
        n,
        a,
        addr: cx.addr(&o[0])?,
    })
}

fn cp(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    if !m.has("async") {
        return Ok(unimpl(i, "only cp.async is implemented"));
    }
    if m.has("commit_group") {
        return Ok(Op::CpCommit);
    }
    if m.has("wait_group") {
        let o = ops(i, 1)?;
        let Operand::Int(n) = o[0] else {
            return Err("wait_group takes an integer".into());
        };
        return Ok(Op::CpWait(n as u32));
    }
    if m.has("wait_all") {
        return Ok(Op::CpWait(0));
    }
    m.has("shared::cta");
    if !(m.has("shared") && m.has("global")) {
        return Ok(unimpl(i, "cp.async other than shared <- global"));
    }
    let o = &i.operands;
    if !(3..=4).contains(&o.len()) {
        return Err("cp.async takes dst, src, cp-size[, src-size]".into());
    }
    let Operand::Int(size) = o[2] else {
        return Err("cp-size must be an integer".into());
    };
    if ![4, 8, 16].contains(&size) || (i.opcode.contains(".cg") && size != 16) {
        return Err(format!("cp-size {size} is not allowed here"));
    }
    let src_size = o.get(3).map(|s| cx.src(s, Ty::Int(U32))).transpose()?;
    Ok(Op::CpAsync {
        dst: cx.addr(&o[0])?,
        src: cx.addr(&o[1])?,
        size: size as u8,
        src_size,
    })
}

fn ldmatrix(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let ok = m.has("sync") && m.has("aligned") && m.has("m8n8") && m.has("b16");
    let n = match m.one_of(&["x1", "x2", "x4"]) {
        Some("x1") => 1,
        Some("x2") => 2,
        Some(_) => 4,
        None => 0,
    };
    let trans = m.has("trans");
    m.has("shared::cta");
    let shared = m.has("shared");
    if !ok || n == 0 || !shared {
        return Ok(unimpl(
            i,
            "only ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16",
        ));
    }
    let o = ops(i, 2)?;
    let d = dsts(cx, &o[0], n)?;
    Ok(Op::Ldmatrix {
        n,
        trans,
        d,
        addr: cx.addr(&o[1])?,
    })
}

/// `n` destination registers: one register, or a `{..}` vector of exactly `n`.
fn dsts(cx: &Cx, op: &Operand, n: u8) -> Result<[crate::ir::Reg; 4], String> {
    let mut d = [crate::ir::SINK; 4];
    match op {
        Operand::Vector(v) if v.len() == n as usize => {
            for (k, r) in v.iter().enumerate() {
                d[k] = cx.dst(r)?;
            }
        }
        r if n == 1 => d[0] = cx.dst(r)?,
        _ => return Err(format!("expected {n} destination registers")),
    }
    Ok(d)
}

fn regs<const N: usize>(cx: &Cx, op: &Operand, t: Ty) -> Result<[Src; N], String> {
    let Operand::Vector(v) = op else {
        return Err("expected a register vector".into());
    };
    if v.len() != N {
        return Err(format!("expected {N} registers, found {}", v.len()));
    }
    let mut out = [Src::I(0); N];
    for (k, r) in v.iter().enumerate() {
        out[k] = cx.src(r, t)?;
    }
    Ok(out)
}

fn mma(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    let want = ["sync", "aligned", "m16n8k16", "row", "col"];
    if !want.iter().all(|w| m.has(w)) || m.rest.len() != 4 {
        return Ok(unimpl(
            i,
            "only mma.sync.aligned.m16n8k16.row.col with f32 accumulators",
        ));
    }
    let types: Vec<String> = m.rest.drain(..).collect();
    let bf16 = match (
        types[0].as_str(),
        types[1].as_str(),
        types[2].as_str(),
        types[3].as_str(),
    ) {
        ("f32", "bf16", "bf16", "f32") => true,
        ("f32", "f16", "f16", "f32") => false,
        _ => return Ok(unimpl(i, format!("types .{}", types.join(".")))),
    };
    let o = ops(i, 4)?;
    let b32 = Ty::Int(U32);
    let dv: [Src; 4] = regs(cx, &o[0], b32)?;
    let mut d = [0; 4];
    for (k, s) in dv.iter().enumerate() {
        let Src::R(r) = s else {
            return Err("mma destinations must be registers".into());
        };
        d[k] = *r;
    }
    Ok(Op::Mma {
        bf16,
        d,
        a: regs(cx, &o[1], b32)?,
        b: regs(cx, &o[2], b32)?,
        c: regs(cx, &o[3], Ty::F32)?,
    })
}

fn shfl(cx: &Cx, i: &InstAst, m: &mut Mods) -> Result<Op, String> {
    if !m.has("sync") {
        return Ok(unimpl(i, "shfl without .sync"));
    }
    let mode = match m.one_of(&["up", "down", "bfly", "idx"]) {
        Some("up") => ShflMode::Up,
        Some("down") => ShflMode::Down,
        Some("bfly") => ShflMode::Bfly,
        Some(_) => ShflMode::Idx,
        None => return Err("missing shfl mode".into()),
    };
    if !m.has("b32") {
        return Err("shfl.sync takes .b32".into());
    }
    let o = ops(i, 5)?;
    let (d, p) = match &o[0] {
        Operand::Pair(d, p) => (cx.reg(d)?, Some(cx.reg(p)?)),
        d => (cx.dst(d)?, None),
    };
    let t = Ty::Int(U32);
    Ok(Op::Shfl {
        mode,
        d,
        p,
        a: cx.src(&o[1], t)?,
        b: cx.src(&o[2], t)?,
        c: cx.src(&o[3], t)?,
        mask: cx.src(&o[4], t)?,
    })
}
