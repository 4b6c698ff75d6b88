//! The decoded form that executes: every instruction resolved once at load time to an
//! [`Op`] with register indices into a flat per-lane register file, immediates as bits,
//! symbols as addresses and labels as instruction indices.

use crate::float::{Fmt, Mode, Rnd};

/// A register index. Indices below [`SPECIAL_REGS`] are the special registers.
pub(crate) type Reg = u32;

/// Special registers, in register-file order (filled in when a warp starts).
pub(crate) const SPECIALS: [&str; 20] = [
    "%tid.x",
    "%tid.y",
    "%tid.z",
    "%ntid.x",
    "%ntid.y",
    "%ntid.z",
    "%ctaid.x",
    "%ctaid.y",
    "%ctaid.z",
    "%nctaid.x",
    "%nctaid.y",
    "%nctaid.z",
    "%laneid",
    "%warpid",
    "%nwarpid",
    "%lanemask_eq",
    "%lanemask_le",
    "%lanemask_lt",
    "%lanemask_ge",
    "%lanemask_gt",
];
/// The register `_` writes to (a sink).
pub(crate) const SINK: Reg = SPECIALS.len() as Reg;
/// Registers before the declared ones.
pub(crate) const SPECIAL_REGS: u32 = SINK + 1;

/// A source operand.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Src {
    /// A register.
    R(Reg),
    /// An immediate, as the bits of the instruction's type.
    I(u64),
}

/// A state space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Space {
    Global,
    Shared,
    Param,
    /// No state space written: decided per address (the shared window or global).
    Generic,
}

/// `[base + off]`; symbols are already folded into `off`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Addr {
    pub base: Option<Reg>,
    pub off: i64,
}

/// An integer type: width in bits and signedness (`.b` types are unsigned here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IntTy {
    pub bits: u8,
    pub signed: bool,
}

/// A value type, for comparisons, selections and conversions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ty {
    Int(IntTy),
    F16,
    Bf16,
    F32,
    F64,
    Pred,
}

impl Ty {
    pub(crate) fn bits(self) -> u8 {
        match self {
            Ty::Int(t) => t.bits,
            Ty::F16 | Ty::Bf16 => 16,
            Ty::F32 => 32,
            Ty::F64 => 64,
            Ty::Pred => 1,
        }
    }
}

/// Two-operand integer operations (`mad` also reads `c`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntOp {
    Add,
    Sub,
    MulLo,
    MulHi,
    MulWide,
    MadLo,
    MadHi,
    MadWide,
    Div,
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Shl,
    Shr,
}

/// One-operand integer and bit operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntUn {
    Not,
    Cnot,
    Neg,
    Abs,
    Clz,
    Popc,
    Brev,
}

/// Two-operand float operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FBin {
    Add,
    Sub,
    Mul,
    Div,
    /// `min`; `nan` is the `.NaN` modifier.
    Min {
        nan: bool,
    },
    /// `max`.
    Max {
        nan: bool,
    },
}

/// One-operand float operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FUn {
    Neg,
    Abs,
    /// `rcp.rnd`.
    Rcp,
    /// `sqrt.rnd`.
    Sqrt,
    Ex2,
    Lg2,
    RcpApprox,
    SqrtApprox,
    RsqrtApprox,
    Sin,
    Cos,
    Tanh,
}

/// A comparison of `setp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

/// A boolean combination of predicates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BoolOp {
    And,
    Or,
    Xor,
}

/// The lane selection of `shfl.sync`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShflMode {
    Up,
    Down,
    Bfly,
    Idx,
}

/// A decoded operation.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// `mov`, `cvta` (generic and global addresses coincide): `d = a` masked to `bits`.
    Mov {
        d: Reg,
        a: Src,
        bits: u8,
    },
    /// `cvta.shared` (`to_generic`) and `cvta.to.shared`: add or remove the shared window.
    CvtaShared {
        d: Reg,
        a: Src,
        to_generic: bool,
    },
    /// `mov.bN d, {a, b, ..}`: parts of `width` bits, the first in the low bits.
    Pack {
        d: Reg,
        parts: Vec<Src>,
        width: u8,
    },
    /// `mov.bN {d0, d1, ..}, a`.
    Unpack {
        ds: Vec<Reg>,
        a: Src,
        width: u8,
    },
    Int {
        op: IntOp,
        t: IntTy,
        d: Reg,
        a: Src,
        b: Src,
        c: Src,
    },
    IntUn {
        op: IntUn,
        t: IntTy,
        d: Reg,
        a: Src,
    },
    F32 {
        op: FBin,
        m: Mode,
        d: Reg,
        a: Src,
        b: Src,
    },
    Fma32 {
        m: Mode,
        d: Reg,
        a: Src,
        b: Src,
        c: Src,
    },
    F32Un {
        op: FUn,
        m: Mode,
        d: Reg,
        a: Src,
    },
    F64 {
        op: FBin,
        d: Reg,
        a: Src,
        b: Src,
    },
    Fma64 {
        d: Reg,
        a: Src,
        b: Src,
        c: Src,
    },
    F64Un {
        op: FUn,
        d: Reg,
        a: Src,
    },
    /// `setp.cmp[.bool].ty p[|q], a, b[, {!}c]`.
    Setp {
        cmp: Cmp,
        t: Ty,
        p: Reg,
        q: Option<Reg>,
        a: Src,
        b: Src,
        comb: Option<(BoolOp, Src, bool)>,
    },
    /// `selp.ty d, a, b, c`: `c ? a : b`.
    Selp {
        d: Reg,
        a: Src,
        b: Src,
        c: Src,
    },
    /// `and/or/xor.pred` and `not.pred` (`b` unused).
    Pred {
        op: Option<BoolOp>,
        d: Reg,
        a: Src,
        b: Src,
    },
    Cvt {
        d: Reg,
        a: Src,
        to: Ty,
        from: Ty,
        rnd: Option<Rnd>,
        int_rnd: bool,
        ftz: bool,
        sat: bool,
    },
    /// `cvt.rnd.{bf16x2,f16x2}.f32 d, hi, lo`.
    CvtPack {
        d: Reg,
        hi: Src,
        lo: Src,
        fmt: Fmt,
        rnd: Rnd,
    },
    /// `ld`: `n` elements of `bytes` each; `sext` sign-extends narrow signed loads.
    Ld {
        space: Space,
        bytes: u8,
        n: u8,
        d: [Reg; 4],
        addr: Addr,
        sext: bool,
        nc: bool,
    },
    St {
        space: Space,
        bytes: u8,
        n: u8,
        a: [Src; 4],
        addr: Addr,
    },
    CpAsync {
        dst: Addr,
        src: Addr,
        size: u8,
        src_size: Option<Src>,
    },
    CpCommit,
    CpWait(u32),
    Ldmatrix {
        n: u8,
        trans: bool,
        d: [Reg; 4],
        addr: Addr,
    },
    Mma {
        bf16: bool,
        d: [Reg; 4],
        a: [Src; 4],
        b: [Src; 2],
        c: [Src; 4],
    },
    Shfl {
        mode: ShflMode,
        d: Reg,
        p: Option<Reg>,
        a: Src,
        b: Src,
        c: Src,
        mask: Src,
    },
    /// `bar.sync 0[, count]` (barrier 0 is the only one modelled).
    Bar {
        count: Option<Src>,
    },
    /// `bar.warp.sync membermask` (`__syncwarp`): orders the shared-memory accesses of the
    /// lanes it names.
    WarpBar {
        mask: Src,
    },
    Bra {
        target: u32,
        uni: bool,
    },
    Exit,
    /// An instruction or modifier the interpreter does not execute, with the reason; an entry
    /// containing one refuses to launch.
    Unimplemented(String),
}

/// One instruction: operation, guard predicate (register, negated) and source line.
#[derive(Clone, Debug)]
pub(crate) struct Inst {
    pub op: Op,
    pub guard: Option<(Reg, bool)>,
    pub line: u32,
}

/// A kernel parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    /// Its name in the PTX.
    pub name: String,
    /// Its type as declared, without the dot (`u64`, `u32`, `f32`, `b8`, ...).
    pub ty: String,
    /// Byte offset in the parameter buffer.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
}

/// A decoded `.entry`.
#[derive(Debug)]
pub(crate) struct Entry {
    pub name: String,
    pub params: Vec<Param>,
    pub param_bytes: u32,
    pub nregs: u32,
    pub insts: Vec<Inst>,
    /// Bytes of static shared memory (the variables the entry references).
    pub shared_static: u32,
    /// Where dynamic shared memory (`.extern .shared` arrays) starts.
    pub shared_dyn_base: u32,
}
