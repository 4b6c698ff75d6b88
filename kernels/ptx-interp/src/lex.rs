//! PTX tokens: identifiers (opcodes with their modifiers, `%registers`, `.directives`,
//! symbols), integer and floating-point literals, strings and punctuation, each with its line.

/// One token.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    /// An identifier, directive, register or opcode: `add.rn.f32`, `%r1`, `.reg`, `LOOP`.
    Ident(String),
    /// An integer literal, already negated when written with a leading `-` (the parser folds
    /// the sign).
    Int(i128),
    /// A floating-point literal as its bits: `0f3F800000` (f32) or `0d...` (f64); a decimal
    /// literal like `1.5` arrives as f64 bits.
    F32(u32),
    /// See [`Tok::F32`].
    F64(u64),
    /// A quoted string (`.pragma "nounroll"`).
    Str(String),
    /// Punctuation: one of `,;:{}[]()+-@!|<>=`.
    Punct(char),
}

/// A token and the 1-based source line it starts on.
#[derive(Clone, Debug)]
pub(crate) struct Token {
    pub tok: Tok,
    pub line: u32,
}

/// Splits PTX source into tokens; the error names the line and what was found.
pub(crate) fn lex(src: &str) -> Result<Vec<Token>, (u32, String)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut line) = (0usize, 1u32);
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let end = src[i + 2..]
                .find("*/")
                .ok_or((line, "unterminated comment".to_string()))?;
            line += src[i..i + 2 + end].matches('\n').count() as u32;
            i += end + 4;
        } else if c == b'"' {
            let end = src[i + 1..]
                .find('"')
                .ok_or((line, "unterminated string".to_string()))?;
            out.push(Token {
                tok: Tok::Str(src[i + 1..i + 1 + end].to_string()),
                line,
            });
            i += end + 2;
        } else if is_ident_start(c) {
            let start = i;
            i += 1;
            // `::` joins the parts of cache hints such as `.L2::128B`.
            while i < b.len() && (is_ident_char(b[i]) || b[i..].starts_with(b"::")) {
                i += if b[i] == b':' { 2 } else { 1 };
            }
            out.push(Token {
                tok: Tok::Ident(src[start..i].to_string()),
                line,
            });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.') {
                // An exponent sign belongs to a decimal float: `1e-5`.
                let exp_sign = (b[i] == b'e' || b[i] == b'E')
                    && i + 1 < b.len()
                    && (b[i + 1] == b'-' || b[i + 1] == b'+')
                    && !src[start..i].starts_with("0x");
                i += if exp_sign { 2 } else { 1 };
            }
            out.push(Token {
                tok: number(&src[start..i])
                    .ok_or_else(|| (line, format!("bad number `{}`", &src[start..i])))?,
                line,
            });
        } else if ",;:{}[]()+-@!|<>=".contains(c as char) {
            out.push(Token {
                tok: Tok::Punct(c as char),
                line,
            });
            i += 1;
        } else {
            return Err((line, format!("unexpected character `{}`", c as char)));
        }
    }
    Ok(out)
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.')
}

/// A literal: hex (`0x`), binary (`0b`), octal (leading `0`), decimal, each with an optional
/// `U` suffix; `0f`/`0d` hex floats; decimal floats.
fn number(s: &str) -> Option<Tok> {
    let body = s.strip_suffix(['U', 'u']).unwrap_or(s);
    let lower = body.to_ascii_lowercase();
    if let Some(h) = lower.strip_prefix("0f") {
        return (h.len() == 8)
            .then(|| u32::from_str_radix(h, 16).ok().map(Tok::F32))
            .flatten();
    }
    if let Some(h) = lower.strip_prefix("0d") {
        return (h.len() == 16)
            .then(|| u64::from_str_radix(h, 16).ok().map(Tok::F64))
            .flatten();
    }
    if let Some(h) = lower.strip_prefix("0x") {
        return u128::from_str_radix(h, 16)
            .ok()
            .and_then(|v| i128::try_from(v).ok())
            .map(Tok::Int);
    }
    if let Some(bits) = lower.strip_prefix("0b") {
        return i128::from_str_radix(bits, 2).ok().map(Tok::Int);
    }
    if lower.contains(['.', 'e']) {
        return lower.parse::<f64>().ok().map(|v| Tok::F64(v.to_bits()));
    }
    if lower.len() > 1 && lower.starts_with('0') {
        return i128::from_str_radix(&lower[1..], 8).ok().map(Tok::Int);
    }
    lower.parse::<i128>().ok().map(Tok::Int)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(s: &str) -> Vec<Tok> {
        lex(s).unwrap().into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn literals_and_idents() {
        assert_eq!(
            toks("add.rn.f32 %f3, %f1, 0f3F800000; // c\n"),
            vec![
                Tok::Ident("add.rn.f32".into()),
                Tok::Ident("%f3".into()),
                Tok::Punct(','),
                Tok::Ident("%f1".into()),
                Tok::Punct(','),
                Tok::F32(0x3F80_0000),
                Tok::Punct(';'),
            ]
        );
        assert_eq!(
            toks("0x10 010 0b11 7U 1.5"),
            vec![
                Tok::Int(16),
                Tok::Int(8),
                Tok::Int(3),
                Tok::Int(7),
                Tok::F64(1.5f64.to_bits())
            ]
        );
        assert_eq!(toks("0d3FF0000000000000"), vec![Tok::F64(1.0f64.to_bits())]);
    }

    #[test]
    fn lines_survive_block_comments() {
        let t = lex("/* a\n b */ mov.u32 %r1, %tid.x;\nret;").unwrap();
        assert_eq!(t[0].line, 2);
        assert_eq!(t.last().unwrap().line, 3);
        assert_eq!(t[3].tok, Tok::Ident("%tid.x".into()));
        assert_eq!(
            toks("cp.async.ca.shared.global.L2::128B"),
            vec![Tok::Ident("cp.async.ca.shared.global.L2::128B".into())]
        );
        assert_eq!(toks("L:"), vec![Tok::Ident("L".into()), Tok::Punct(':')]);
    }

    #[test]
    fn errors_name_the_line() {
        assert_eq!(lex("\n\n  #").unwrap_err().0, 3);
        assert!(lex("0f12").is_err());
    }
}
