//! The launch ABI of the PTX kernels: for every `.entry`, the kinds of its parameters in
//! order, and the packing of host values into them.
//!
//! `kernels/ptx/<op>.ptx` declares each entry's parameters (`.param .u64 p_out, ...`); the
//! host must push exactly that many values of exactly those widths, or the kernel reads
//! garbage. The table here is the host's copy of those lists; a test parses every PTX file
//! and compares, so a kernel whose signature changes fails on the CPU, not on a GPU.
//! [`pack`] checks a launch's values against the table before anything reaches the driver.
//!
//! This module needs no device and compiles without the `cuda` feature.

use crate::error::{BackendError, Result};

/// The kind of one kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// `.u64`: a device address.
    Ptr,
    /// `.u32`: a count, size, index or flag.
    U32,
    /// `.f32`: a scalar.
    F32,
}

/// One kernel argument value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device address (0 only where the kernel documents it as "skip").
    Ptr(u64),
    /// An unsigned 32-bit value.
    U32(u32),
    /// A 32-bit float.
    F32(f32),
}

impl Arg {
    /// The parameter kind this value fills.
    pub fn kind(&self) -> ArgKind {
        match self {
            Arg::Ptr(_) => ArgKind::Ptr,
            Arg::U32(_) => ArgKind::U32,
            Arg::F32(_) => ArgKind::F32,
        }
    }

    /// A size or index as a `.u32` parameter; `what` names it in the error when it does not
    /// fit in 32 bits (the kernels index with 32-bit counts).
    pub fn count(n: usize, what: &str) -> Result<Arg> {
        u32::try_from(n).map(Arg::U32).map_err(|_| {
            BackendError::invalid(what, format!("{n} exceeds the kernels' 32-bit range"))
        })
    }
}

use ArgKind::{F32, Ptr, U32};

/// Every PTX entry and its parameter kinds, in declaration order.
pub const SIGNATURES: &[(&str, &[ArgKind])] = &[
    ("embedding_fwd", &[Ptr, Ptr, Ptr, U32, U32, U32]),
    ("embedding_bwd", &[Ptr, Ptr, Ptr, U32, U32, U32]),
    ("rmsnorm_fwd", &[Ptr, Ptr, Ptr, Ptr, U32, U32, F32]),
    ("rmsnorm_bwd", &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32]),
    ("rmsnorm_bwd_dw", &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32]),
    ("matmul_fwd", &[Ptr, Ptr, Ptr, U32, U32, U32]),
    (
        "matmul_fwd_f32",
        &[Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, U32, U32],
    ),
    ("matmul_fwd_cast", &[Ptr, Ptr, U32]),
    ("matmul_bwd_dx", &[Ptr, Ptr, Ptr, U32, U32, U32]),
    ("matmul_bwd_dw", &[Ptr, Ptr, Ptr, U32, U32, U32]),
    ("rope_fwd", &[Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32]),
    ("rope_bwd", &[Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32]),
    (
        "attention_fwd",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, F32],
    ),
    (
        "attention_bwd_dq",
        &[
            Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, F32,
        ],
    ),
    (
        "attention_bwd_dkv",
        &[
            Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, F32,
        ],
    ),
    ("swiglu_fwd", &[Ptr, Ptr, Ptr, U32]),
    ("swiglu_bwd", &[Ptr, Ptr, Ptr, Ptr, Ptr, U32]),
    ("residual_fwd", &[Ptr, Ptr, Ptr, U32]),
    ("logprob_fwd", &[Ptr, Ptr, Ptr, U32, U32, U32, U32, F32]),
    ("logprob_fwd_finish", &[Ptr, Ptr, Ptr, Ptr, U32]),
    (
        "logprob_bwd",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, F32],
    ),
    (
        "grpo_loss_fwd",
        &[
            Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, F32, F32, F32,
        ],
    ),
    (
        "grpo_loss_bwd",
        &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, F32, F32, F32],
    ),
    (
        "adamw_step",
        &[
            Ptr, Ptr, Ptr, Ptr, U32, F32, F32, F32, F32, F32, F32, F32, F32,
        ],
    ),
    ("grad_norm", &[Ptr, Ptr, U32, U32]),
    ("grad_norm_reduce", &[Ptr, Ptr, U32]),
    ("sample", &[Ptr, Ptr, Ptr, Ptr, U32, U32]),
];

/// The parameter kinds of `entry`, or `None` for a name that is not a PTX entry.
pub fn signature(entry: &str) -> Option<&'static [ArgKind]> {
    SIGNATURES
        .iter()
        .find(|(name, _)| *name == entry)
        .map(|(_, s)| *s)
}

/// Checks `args` against `entry`'s signature: the count and every kind must match, and a
/// null address is refused (no kernel may be handed one, except `logprob_bwd`'s optional
/// bf16 output, argument 1, which the kernel documents as "0 = skip").
pub fn pack(entry: &str, args: &[Arg]) -> Result<()> {
    let sig = signature(entry).ok_or_else(|| {
        BackendError::Device(format!("`{entry}` is not an entry of the PTX kernels"))
    })?;
    if sig.len() != args.len() {
        return Err(BackendError::Device(format!(
            "`{entry}` takes {} arguments, the launch passed {}",
            sig.len(),
            args.len()
        )));
    }
    for (i, (k, a)) in sig.iter().zip(args).enumerate() {
        if a.kind() != *k {
            return Err(BackendError::Device(format!(
                "`{entry}` argument {i} is {k:?}, the launch passed {a:?}"
            )));
        }
        if *a == Arg::Ptr(0) && !(entry == "logprob_bwd" && i == 1) {
            return Err(BackendError::Device(format!(
                "`{entry}` argument {i} is a null device address"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rolloutpipe_kernels::Kernel;

    /// `(entry, kinds)` of every `.entry` in a PTX source, parsed from its declaration.
    fn parse_entries(src: &str) -> Vec<(String, Vec<ArgKind>)> {
        let mut out = Vec::new();
        let mut rest = src;
        while let Some(at) = rest.find(".entry ") {
            let after = &rest[at + ".entry ".len()..];
            let open = after.find('(').expect("entry has a parameter list");
            let close = after.find(')').expect("parameter list closes");
            let name = after[..open].trim().to_string();
            let kinds = after[open + 1..close]
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    if p.starts_with(".param .u64") {
                        Ptr
                    } else if p.starts_with(".param .u32") {
                        U32
                    } else if p.starts_with(".param .f32") {
                        F32
                    } else {
                        panic!("{name}: unexpected parameter `{p}`")
                    }
                })
                .collect();
            out.push((name, kinds));
            rest = &after[close..];
        }
        out
    }

    #[test]
    fn table_matches_every_ptx_declaration() {
        let mut seen = 0;
        for k in Kernel::CUDA {
            let parsed = parse_entries(k.ptx().unwrap_or_default());
            let names: Vec<&str> = parsed.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, k.ptx_entry_points(), "{}", k.name());
            for (name, kinds) in parsed {
                let sig = signature(&name).unwrap_or_else(|| panic!("{name} not in SIGNATURES"));
                assert_eq!(sig, kinds.as_slice(), "{name}");
                seen += 1;
            }
        }
        assert_eq!(
            seen,
            SIGNATURES.len(),
            "SIGNATURES lists an entry no file has"
        );
    }

    #[test]
    fn pack_refuses_wrong_count_kind_and_null() {
        let ok = [Arg::Ptr(8), Arg::Ptr(16), Arg::Ptr(24), Arg::U32(3)];
        assert!(pack("residual_fwd", &ok).is_ok());
        let e = pack("residual_fwd", &ok[..3]).unwrap_err().to_string();
        assert!(e.contains("takes 4 arguments, the launch passed 3"), "{e}");
        let e = pack("residual_fwd", &[ok[0], ok[1], ok[2], Arg::F32(3.0)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("argument 3 is U32"), "{e}");
        let e = pack("residual_fwd", &[Arg::Ptr(0), ok[1], ok[2], ok[3]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("null device address"), "{e}");
        assert!(pack("no_such_kernel", &ok).is_err());
        // logprob_bwd's bf16 copy may be skipped with a null address, and only that one.
        let lp = |bf16| {
            [
                Arg::Ptr(8),
                Arg::Ptr(bf16),
                Arg::Ptr(8),
                Arg::Ptr(8),
                Arg::Ptr(8),
                Arg::U32(1),
                Arg::U32(1),
                Arg::U32(0),
                Arg::F32(1.0),
            ]
        };
        assert!(pack("logprob_bwd", &lp(0)).is_ok());
        let mut bad = lp(8);
        bad[2] = Arg::Ptr(0);
        assert!(pack("logprob_bwd", &bad).is_err());
    }

    #[test]
    fn count_refuses_values_past_u32() {
        assert_eq!(Arg::count(7, "n").unwrap(), Arg::U32(7));
        let e = Arg::count(1 << 33, "rows").unwrap_err().to_string();
        assert!(e.contains("rows") && e.contains("32-bit"), "{e}");
    }
}
