//! Syntax tree to [`Entry`]: parameter and shared-memory layout, register allocation with
//! nested scopes, label resolution, and each instruction decoded by `decode`.

use std::collections::{HashMap, HashSet};

use crate::decode::decode;
use crate::ir::{Addr, Entry, Inst, IntTy, Op, Param, Reg, SINK, SPECIAL_REGS, SPECIALS, Src, Ty};
use crate::parse::{Function, Module, Operand, ParseError, Stmt, VarDecl, type_size};

/// Decodes every entry of a parsed module.
pub(crate) fn lower_module(m: &Module) -> Result<Vec<Entry>, ParseError> {
    m.entries
        .iter()
        .map(|f| lower_entry(f, &m.shared))
        .collect()
}

/// Names in scope while an entry is decoded.
pub(crate) struct Cx {
    scopes: Vec<HashMap<String, Reg>>,
    nregs: u32,
    /// Shared variables referenced by the entry: name -> shared-space address.
    shared: HashMap<String, u32>,
    /// Parameters: name -> (offset, size).
    params: HashMap<String, (u32, u32)>,
}

impl Cx {
    /// The register named `name` (declared, special or `_`).
    pub(crate) fn reg(&self, name: &str) -> Result<Reg, String> {
        if name == "_" {
            return Ok(SINK);
        }
        if let Some(i) = SPECIALS.iter().position(|s| *s == name) {
            return Ok(i as Reg);
        }
        self.scopes
            .iter()
            .rev()
            .find_map(|s| s.get(name).copied())
            .ok_or_else(|| format!("undeclared register `{name}`"))
    }

    /// The shared-space address of a shared variable, if `name` is one.
    pub(crate) fn shared_addr(&self, name: &str) -> Option<u32> {
        self.shared.get(name).copied()
    }

    /// A destination register.
    pub(crate) fn dst(&self, op: &Operand) -> Result<Reg, String> {
        match op {
            Operand::Name(n) => self.reg(n),
            Operand::Sink => Ok(SINK),
            o => Err(format!("expected a destination register, found {o:?}")),
        }
    }

    /// A source of type `t`: a register, a shared variable's address or an immediate.
    pub(crate) fn src(&self, op: &Operand, t: Ty) -> Result<Src, String> {
        Ok(match op {
            Operand::Name(n) => match self.shared_addr(n) {
                Some(a) => Src::I(a as u64),
                None => Src::R(self.reg(n)?),
            },
            Operand::Int(v) => Src::I(int_imm(*v, t)),
            Operand::F32(b) => Src::I(match t {
                Ty::F64 => (f32::from_bits(*b) as f64).to_bits(),
                _ => *b as u64,
            }),
            Operand::F64(b) => Src::I(match t {
                Ty::F32 => (f64::from_bits(*b) as f32).to_bits() as u64,
                _ => *b,
            }),
            o => return Err(format!("expected a value, found {o:?}")),
        })
    }

    /// An address operand: `[reg+off]`, `[symbol+off]` (shared variable or parameter) or
    /// `[imm]`.
    pub(crate) fn addr(&self, op: &Operand) -> Result<Addr, String> {
        let Operand::Addr { base, offset } = op else {
            return Err(format!("expected an address `[..]`, found {op:?}"));
        };
        let Some(b) = base else {
            return Ok(Addr {
                base: None,
                off: *offset,
            });
        };
        if let Some(a) = self.shared_addr(b) {
            return Ok(Addr {
                base: None,
                off: a as i64 + offset,
            });
        }
        if let Some(&(o, _)) = self.params.get(b) {
            return Ok(Addr {
                base: None,
                off: o as i64 + offset,
            });
        }
        Ok(Addr {
            base: Some(self.reg(b)?),
            off: *offset,
        })
    }

    fn declare(&mut self, name: String) {
        let r = self.nregs;
        self.nregs += 1;
        if let Some(s) = self.scopes.last_mut() {
            s.insert(name, r);
        }
    }
}

/// An integer literal as the bits of type `t` (a float type takes the integer's value).
fn int_imm(v: i128, t: Ty) -> u64 {
    match t {
        Ty::F32 => (v as f32).to_bits() as u64,
        Ty::F64 => (v as f64).to_bits(),
        _ => v as u64,
    }
}

fn align_up(x: u32, a: u32) -> u32 {
    x.div_ceil(a.max(1)) * a.max(1)
}

/// Names an operand mentions (registers, symbols, address bases).
fn names(op: &Operand, out: &mut HashSet<String>) {
    match op {
        Operand::Name(n) | Operand::Not(n) => {
            out.insert(n.clone());
        }
        Operand::Addr { base: Some(b), .. } => {
            out.insert(b.clone());
        }
        Operand::Vector(v) => v.iter().for_each(|o| names(o, out)),
        Operand::Pair(a, b) => {
            out.insert(a.clone());
            out.insert(b.clone());
        }
        _ => {}
    }
}

/// Lays out the shared variables the entry uses: its own, then the module's it references,
/// statics first; every `.extern` array starts at the (aligned) end of the statics.
fn shared_layout(f: &Function, module: &[VarDecl]) -> (HashMap<String, u32>, u32, u32) {
    let mut used = HashSet::new();
    for s in &f.body {
        if let Stmt::Inst(i) = s {
            i.operands.iter().for_each(|o| names(o, &mut used));
        }
    }
    let own: Vec<&VarDecl> = f
        .body
        .iter()
        .filter_map(|s| {
            if let Stmt::Shared(v) = s {
                Some(v)
            } else {
                None
            }
        })
        .collect();
    let own_names: HashSet<&str> = own.iter().map(|v| v.name.as_str()).collect();
    let vars: Vec<&VarDecl> = own
        .iter()
        .copied()
        .chain(
            module
                .iter()
                .filter(|v| used.contains(&v.name) && !own_names.contains(v.name.as_str())),
        )
        .collect();
    let mut map = HashMap::new();
    let mut size = 0u32;
    for v in vars.iter().filter(|v| v.count.is_some()) {
        size = align_up(size, v.align);
        map.insert(v.name.clone(), size);
        size += v.elem_size * v.count.unwrap_or(0) as u32;
    }
    let dyn_align = vars
        .iter()
        .filter(|v| v.count.is_none())
        .map(|v| v.align)
        .max()
        .unwrap_or(16);
    let dyn_base = align_up(size, dyn_align.max(16));
    for v in vars.iter().filter(|v| v.count.is_none()) {
        map.insert(v.name.clone(), dyn_base);
    }
    (map, size, dyn_base)
}

/// Parameters in order, their offsets and sizes by name, and the buffer's size.
type ParamLayout = (Vec<Param>, HashMap<String, (u32, u32)>, u32);

fn param_layout(f: &Function) -> Result<ParamLayout, ParseError> {
    let mut params = Vec::new();
    let mut map = HashMap::new();
    let mut off = 0u32;
    for p in &f.params {
        let elem = type_size(&p.ty).ok_or((
            f.line,
            format!("parameter `{}`: unknown type `.{}`", p.name, p.ty),
        ))?;
        let size = elem * p.count;
        off = align_up(off, p.align.unwrap_or(elem));
        map.insert(p.name.clone(), (off, size));
        params.push(Param {
            name: p.name.clone(),
            ty: p.ty.clone(),
            offset: off,
            size,
        });
        off += size;
    }
    Ok((params, map, off))
}

fn lower_entry(f: &Function, module_shared: &[VarDecl]) -> Result<Entry, ParseError> {
    let (params, pmap, param_bytes) = param_layout(f)?;
    let (shared, shared_static, shared_dyn_base) = shared_layout(f, module_shared);
    let mut cx = Cx {
        scopes: vec![HashMap::new()],
        nregs: SPECIAL_REGS,
        shared,
        params: pmap,
    };
    let mut insts: Vec<Inst> = Vec::new();
    let mut labels = HashMap::new();
    let mut fixups = Vec::new();
    for s in &f.body {
        match s {
            Stmt::Reg { ty, names, line } => {
                if type_size(ty).is_none() {
                    return Err((*line, format!("unknown register type `.{ty}`")));
                }
                for (n, count) in names {
                    match count {
                        Some(c) => (0..*c).for_each(|i| cx.declare(format!("{n}{i}"))),
                        None => cx.declare(n.clone()),
                    }
                }
            }
            Stmt::Shared(_) => {}
            Stmt::Label(l, line) => {
                if labels.insert(l.clone(), insts.len() as u32).is_some() {
                    return Err((*line, format!("label `{l}` defined twice")));
                }
            }
            Stmt::Open => cx.scopes.push(HashMap::new()),
            Stmt::Close => {
                cx.scopes.pop();
            }
            Stmt::Inst(i) => {
                let guard = match &i.guard {
                    Some((neg, p)) => Some((cx.reg(p).map_err(|e| (i.line, e))?, *neg)),
                    None => None,
                };
                let op = decode(&cx, i).map_err(|e| (i.line, format!("`{}`: {e}", i.opcode)))?;
                if let (Op::Bra { .. }, Some(Operand::Name(l))) = (&op, i.operands.first()) {
                    fixups.push((insts.len(), l.clone(), i.line));
                }
                insts.push(Inst {
                    op,
                    guard,
                    line: i.line,
                });
            }
        }
    }
    for (at, label, line) in fixups {
        let t = *labels
            .get(&label)
            .ok_or((line, format!("unknown label `{label}`")))?;
        if let Op::Bra { target, .. } = &mut insts[at].op {
            *target = t;
        }
    }
    // Falling off the end of the body ends the thread, as `ret` would.
    insts.push(Inst {
        op: Op::Exit,
        guard: None,
        line: f.line,
    });
    Ok(Entry {
        name: f.name.clone(),
        params,
        param_bytes,
        nregs: cx.nregs,
        insts,
        shared_static,
        shared_dyn_base,
    })
}

/// Integer type of a type name, if it is one (`.b` counts as unsigned).
pub(crate) fn int_ty(name: &str) -> Option<IntTy> {
    let (signed, bits) = match name {
        "u8" | "b8" => (false, 8),
        "u16" | "b16" => (false, 16),
        "u32" | "b32" => (false, 32),
        "u64" | "b64" => (false, 64),
        "s8" => (true, 8),
        "s16" => (true, 16),
        "s32" => (true, 32),
        "s64" => (true, 64),
        _ => return None,
    };
    Some(IntTy { bits, signed })
}

/// Value type of a type name.
pub(crate) fn ty(name: &str) -> Option<Ty> {
    Some(match name {
        "f16" => Ty::F16,
        "bf16" => Ty::Bf16,
        "f32" => Ty::F32,
        "f64" => Ty::F64,
        "pred" => Ty::Pred,
        n => Ty::Int(int_ty(n)?),
    })
}
