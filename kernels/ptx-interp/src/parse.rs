//! PTX text to a syntax tree: module directives, shared variables, `.entry` functions with
//! their parameters, register declarations, labels, scopes and instructions. Instructions stay
//! textual here (`opcode` with its modifiers, operands); `lower` gives them meaning.

use crate::lex::{Tok, Token, lex};

/// A parse error: line and message.
pub(crate) type ParseError = (u32, String);

/// A parsed module.
#[derive(Debug, Default)]
pub(crate) struct Module {
    /// Module-scope `.shared` variables (static and `.extern`).
    pub shared: Vec<VarDecl>,
    /// The `.entry` functions in source order.
    pub entries: Vec<Function>,
}

/// A `.shared` variable.
#[derive(Clone, Debug)]
pub(crate) struct VarDecl {
    pub name: String,
    /// Bytes per element (from the type: `.b8` = 1, `.f32` = 4, ...).
    pub elem_size: u32,
    pub align: u32,
    /// Element count; `None` for `.extern` arrays declared `[]` (dynamic shared memory).
    pub count: Option<u64>,
}

/// A kernel parameter.
#[derive(Clone, Debug)]
pub(crate) struct ParamDecl {
    pub name: String,
    /// The declared type without its dot: `u64`, `u32`, `f32`, `b8` (with `count` for arrays).
    pub ty: String,
    pub align: Option<u32>,
    pub count: u32,
}

/// An `.entry` function.
#[derive(Debug)]
pub(crate) struct Function {
    pub name: String,
    pub params: Vec<ParamDecl>,
    pub body: Vec<Stmt>,
    pub line: u32,
}

/// One statement of a function body.
#[derive(Debug)]
pub(crate) enum Stmt {
    /// `.reg .ty %a, %b<4>;`: names with an optional count (`%b<4>` = `%b0`..`%b3`).
    Reg {
        ty: String,
        names: Vec<(String, Option<u32>)>,
        line: u32,
    },
    /// A function-scope `.shared` variable.
    Shared(VarDecl),
    /// `NAME:`
    Label(String, u32),
    /// `{`: a nested scope (registers declared inside are local to it).
    Open,
    /// `}`
    Close,
    /// An instruction.
    Inst(InstAst),
}

/// An instruction as written.
#[derive(Clone, Debug)]
pub(crate) struct InstAst {
    /// Guard predicate: (negated, register name).
    pub guard: Option<(bool, String)>,
    /// The opcode with its modifiers, e.g. `ld.global.nc.v4.f32`.
    pub opcode: String,
    pub operands: Vec<Operand>,
    pub line: u32,
}

/// An operand as written.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Operand {
    /// A register, special register or symbol name.
    Name(String),
    /// `!%p`: a negated predicate (setp's `c`, selp-like uses).
    Not(String),
    /// An integer literal.
    Int(i128),
    /// f32 bits.
    F32(u32),
    /// f64 bits.
    F64(u64),
    /// `[base + offset]` or `[offset]`.
    Addr { base: Option<String>, offset: i64 },
    /// `{a, b, ...}`.
    Vector(Vec<Operand>),
    /// `%d|%p`: a value and a predicate destination (shfl, setp's pair).
    Pair(String, String),
    /// `_`: a sink.
    Sink,
}

struct Parser {
    toks: Vec<Token>,
    pos: usize,
}

/// Parses a whole module.
pub(crate) fn parse(src: &str) -> Result<Module, ParseError> {
    let mut p = Parser {
        toks: lex(src)?,
        pos: 0,
    };
    let mut m = Module::default();
    while p.pos < p.toks.len() {
        p.module_item(&mut m)?;
    }
    Ok(m)
}

impl Parser {
    fn line(&self) -> u32 {
        self.toks
            .get(self.pos)
            .or(self.toks.last())
            .map_or(0, |t| t.line)
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.tok)
    }

    fn next(&mut self) -> Result<Tok, ParseError> {
        let t = self
            .toks
            .get(self.pos)
            .ok_or((self.line(), "unexpected end of file".to_string()))?;
        self.pos += 1;
        Ok(t.tok.clone())
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T, ParseError> {
        Err((self.line(), msg.into()))
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char) -> Result<(), ParseError> {
        if self.eat(c) {
            Ok(())
        } else {
            self.err(format!("expected `{c}`, found {:?}", self.peek()))
        }
    }

    fn ident(&mut self) -> Result<String, ParseError> {
        match self.next()? {
            Tok::Ident(s) => Ok(s),
            t => {
                self.pos -= 1;
                self.err(format!("expected a name, found {t:?}"))
            }
        }
    }

    fn int(&mut self) -> Result<i128, ParseError> {
        let neg = self.eat('-');
        match self.next()? {
            Tok::Int(v) => Ok(if neg { -v } else { v }),
            t => {
                self.pos -= 1;
                self.err(format!("expected an integer, found {t:?}"))
            }
        }
    }

    /// Skips to the end of the current `;`-terminated statement.
    fn skip_statement(&mut self) -> Result<(), ParseError> {
        while !self.eat(';') {
            self.next()?;
        }
        Ok(())
    }

    fn module_item(&mut self, m: &mut Module) -> Result<(), ParseError> {
        let line = self.line();
        let word = self.ident()?;
        match word.as_str() {
            ".version" | ".target" | ".address_size" => {
                // `.version 8.0` lexes as a float; `.target sm_80, debug` as names.
                while !matches!(self.peek(), Some(Tok::Ident(s)) if s.starts_with('.'))
                    && self.pos < self.toks.len()
                {
                    self.next()?;
                }
                Ok(())
            }
            ".visible" | ".weak" => self.module_item(m),
            ".extern" => {
                let space = self.ident()?;
                if space != ".shared" {
                    return Err((
                        line,
                        format!(
                            "`.extern {space}` is not supported (only `.extern .shared` arrays)"
                        ),
                    ));
                }
                let v = self.var_decl(line)?;
                m.shared.push(v);
                Ok(())
            }
            ".shared" => {
                let v = self.var_decl(line)?;
                m.shared.push(v);
                Ok(())
            }
            ".entry" => {
                let f = self.function(line)?;
                m.entries.push(f);
                Ok(())
            }
            other => Err((line, format!("module directive `{other}` is not supported"))),
        }
    }

    /// `[.align N] .ty name[count]? ;` after the state space.
    fn var_decl(&mut self, line: u32) -> Result<VarDecl, ParseError> {
        let mut align = 0;
        let mut ty = self.ident()?;
        if ty == ".align" {
            align = self.int()? as u32;
            ty = self.ident()?;
        }
        let elem_size = type_size(&ty).ok_or((line, format!("unknown type `{ty}`")))?;
        let name = self.ident()?;
        let mut count = Some(1);
        if self.eat('[') {
            count = if self.eat(']') {
                None
            } else {
                let n = self.int()?;
                self.expect(']')?;
                Some(n as u64)
            };
        }
        if self.eat('=') {
            return Err((
                line,
                format!("initialised shared variable `{name}` is not valid PTX"),
            ));
        }
        self.expect(';')?;
        Ok(VarDecl {
            name,
            elem_size,
            align: if align == 0 { elem_size } else { align },
            count,
        })
    }

    fn function(&mut self, line: u32) -> Result<Function, ParseError> {
        let name = self.ident()?;
        let mut params = Vec::new();
        if self.eat('(') {
            while !self.eat(')') {
                params.push(self.param()?);
                self.eat(',');
            }
        }
        // Performance directives (`.maxntid 256, 1, 1`, `.reqntid`, `.minnctapersm`) are
        // hints for ptxas; the launch's own block size is what executes.
        while let Some(Tok::Ident(d)) = self.peek() {
            if !d.starts_with('.') {
                break;
            }
            self.next()?;
            while matches!(self.peek(), Some(Tok::Int(_)) | Some(Tok::Punct(','))) {
                self.next()?;
            }
        }
        self.expect('{')?;
        let mut body = Vec::new();
        let mut depth = 1;
        while depth > 0 {
            let s = self.statement()?;
            match s {
                Stmt::Open => depth += 1,
                Stmt::Close => depth -= 1,
                _ => {}
            }
            if depth > 0 {
                body.push(s);
            }
        }
        Ok(Function {
            name,
            params,
            body,
            line,
        })
    }

    fn param(&mut self) -> Result<ParamDecl, ParseError> {
        let space = self.ident()?;
        if space != ".param" {
            return self.err(format!("expected `.param`, found `{space}`"));
        }
        let mut align = None;
        let mut ty = self.ident()?;
        if ty == ".align" {
            align = Some(self.int()? as u32);
            ty = self.ident()?;
        }
        let name = self.ident()?;
        let mut count = 1;
        if self.eat('[') {
            count = self.int()? as u32;
            self.expect(']')?;
        }
        Ok(ParamDecl {
            name,
            ty: ty.trim_start_matches('.').to_string(),
            align,
            count,
        })
    }

    fn statement(&mut self) -> Result<Stmt, ParseError> {
        let line = self.line();
        if self.eat('{') {
            return Ok(Stmt::Open);
        }
        if self.eat('}') {
            return Ok(Stmt::Close);
        }
        let guard = if self.eat('@') {
            let neg = self.eat('!');
            Some((neg, self.ident()?))
        } else {
            None
        };
        let word = self.ident()?;
        if guard.is_none() && self.eat(':') {
            return Ok(Stmt::Label(word, line));
        }
        match word.as_str() {
            ".reg" => self.reg_decl(line),
            ".shared" => Ok(Stmt::Shared(self.var_decl(line)?)),
            // Hints and debug information with no effect on results.
            ".pragma" | ".loc" | ".file" => {
                self.skip_statement()?;
                self.statement()
            }
            w if w.starts_with('.') => Err((
                line,
                format!("directive `{w}` inside a function is not supported"),
            )),
            _ => self.instruction(guard, word, line).map(Stmt::Inst),
        }
    }

    fn reg_decl(&mut self, line: u32) -> Result<Stmt, ParseError> {
        let mut ty = self.ident()?;
        if ty.starts_with(".v") {
            return Err((
                line,
                format!("vector registers (`.reg {ty}`) are not supported"),
            ));
        }
        if ty == ".align" {
            self.int()?;
            ty = self.ident()?;
        }
        let mut names = Vec::new();
        loop {
            let name = self.ident()?;
            let count = if self.eat('<') {
                let n = self.int()? as u32;
                self.expect('>')?;
                Some(n)
            } else {
                None
            };
            names.push((name, count));
            if !self.eat(',') {
                break;
            }
        }
        self.expect(';')?;
        Ok(Stmt::Reg {
            ty: ty.trim_start_matches('.').to_string(),
            names,
            line,
        })
    }

    fn instruction(
        &mut self,
        guard: Option<(bool, String)>,
        opcode: String,
        line: u32,
    ) -> Result<InstAst, ParseError> {
        let mut operands = Vec::new();
        if !self.eat(';') {
            loop {
                operands.push(self.operand()?);
                if self.eat(';') {
                    break;
                }
                self.expect(',')?;
            }
        }
        Ok(InstAst {
            guard,
            opcode,
            operands,
            line,
        })
    }

    fn operand(&mut self) -> Result<Operand, ParseError> {
        if self.eat('[') {
            return self.address();
        }
        if self.eat('{') {
            let mut v = Vec::new();
            while !self.eat('}') {
                v.push(self.operand()?);
                self.eat(',');
            }
            return Ok(Operand::Vector(v));
        }
        if self.eat('!') {
            return Ok(Operand::Not(self.ident()?));
        }
        let neg = self.eat('-');
        match self.next()? {
            Tok::Int(v) => Ok(Operand::Int(if neg { -v } else { v })),
            Tok::F32(b) => Ok(Operand::F32(if neg { b ^ 0x8000_0000 } else { b })),
            Tok::F64(b) => Ok(Operand::F64(if neg { b ^ (1 << 63) } else { b })),
            Tok::Ident(s) if !neg => {
                if s == "_" {
                    return Ok(Operand::Sink);
                }
                if self.eat('|') {
                    return Ok(Operand::Pair(s, self.ident()?));
                }
                Ok(Operand::Name(s))
            }
            t => {
                self.pos -= 1;
                self.err(format!("unexpected operand {t:?}"))
            }
        }
    }

    /// After `[`: `name`, `name+imm`, `name+-imm`, `name-imm` or `imm`, then `]`.
    fn address(&mut self) -> Result<Operand, ParseError> {
        let base = match self.peek() {
            Some(Tok::Ident(_)) => Some(self.ident()?),
            _ => None,
        };
        // `int` folds a leading `-`, so `+-8` and `-8` read alike.
        let has_offset =
            base.is_none() || self.eat('+') || matches!(self.peek(), Some(Tok::Punct('-')));
        let offset = if has_offset { self.int()? as i64 } else { 0 };
        self.expect(']')?;
        Ok(Operand::Addr { base, offset })
    }
}

/// Bytes of a scalar type name (`.b8`, `.u32`, `.f16x2`, `.pred`, ...).
pub(crate) fn type_size(ty: &str) -> Option<u32> {
    Some(match ty.trim_start_matches('.') {
        "b8" | "u8" | "s8" | "pred" => 1,
        "b16" | "u16" | "s16" | "f16" | "bf16" => 2,
        "b32" | "u32" | "s32" | "f32" | "f16x2" | "bf16x2" => 4,
        "b64" | "u64" | "s64" | "f64" => 8,
        "b128" => 16,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: &str = r#"
.version 8.0
.target sm_80
.address_size 64
.shared .align 16 .f32 red[4];
.extern .shared .align 16 .b8 dyn[];
.visible .entry k(
    .param .u64 p_out,
    .param .u32 p_n
)
.maxntid 256, 1, 1
{
    .reg .pred %p<2>;
    .reg .b32 %r<4>, %x;
    ld.param.u32 %r1, [p_n];
    @!%p1 bra DONE;
    shfl.sync.down.b32 %r2|%p1, %r1, 16, 31, -1;
    { .reg .b32 %t; mov.b64 {%r1, %t}, %rd1; }
    ld.global.f32 %f1, [%rd4+-8];
DONE:
    ret;
}
"#;

    #[test]
    fn parses_module_items_and_statements() {
        let m = parse(SRC).unwrap();
        assert_eq!(m.shared.len(), 2);
        assert_eq!(m.shared[0].count, Some(4));
        assert_eq!(m.shared[1].count, None);
        let f = &m.entries[0];
        assert_eq!(f.name, "k");
        assert_eq!(f.params.len(), 2);
        assert_eq!(f.params[1].ty, "u32");
        let insts: Vec<&InstAst> = f
            .body
            .iter()
            .filter_map(|s| if let Stmt::Inst(i) = s { Some(i) } else { None })
            .collect();
        assert_eq!(insts[1].guard, Some((true, "%p1".to_string())));
        assert_eq!(
            insts[2].operands[0],
            Operand::Pair("%r2".into(), "%p1".into())
        );
        assert_eq!(insts[2].operands[4], Operand::Int(-1));
        assert_eq!(
            insts[4].operands[1],
            Operand::Addr {
                base: Some("%rd4".into()),
                offset: -8
            }
        );
        assert!(
            f.body
                .iter()
                .any(|s| matches!(s, Stmt::Label(l, _) if l == "DONE"))
        );
        assert!(matches!(
            f.body.iter().filter(|s| matches!(s, Stmt::Open)).count(),
            1
        ));
    }

    #[test]
    fn unsupported_directives_are_errors_with_lines() {
        let e = parse(".version 8.0\n.global .u32 g;\n").unwrap_err();
        assert_eq!(e.0, 2);
        assert!(e.1.contains(".global"));
        let e = parse(".entry k() {\n .local .u32 x;\n}").unwrap_err();
        assert_eq!(e.0, 2);
    }
}
