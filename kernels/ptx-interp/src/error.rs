//! Errors: one [`Error`] for every failure of the device API, and [`Fault`], what a kernel
//! did wrong, located by kernel, source line, instruction, block and thread.

use std::fmt;

/// A failure of the device API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The PTX text does not parse or uses a construct the interpreter does not load.
    #[error("PTX module `{module}`, line {line}: {message}")]
    Parse {
        /// The module's name (given to `load_module`).
        module: String,
        /// 1-based source line.
        line: u32,
        /// What is wrong.
        message: String,
    },
    /// A launch named an entry the module does not have.
    #[error("module `{module}` has no entry `{entry}` (it has: {available})")]
    NoEntry {
        /// The module's name.
        module: String,
        /// The entry asked for.
        entry: String,
        /// The entries it has, comma-separated.
        available: String,
    },
    /// The entry contains an instruction the interpreter does not execute; nothing ran.
    #[error(
        "kernel `{kernel}`, line {line}: `{text}` is not implemented by the interpreter: {reason}"
    )]
    Unimplemented {
        /// The entry.
        kernel: String,
        /// 1-based source line.
        line: u32,
        /// The source line.
        text: String,
        /// Which instruction or modifier.
        reason: String,
    },
    /// The launch itself is invalid (dimensions, shared memory, arguments); nothing ran.
    #[error("launch of `{kernel}`: {reason}")]
    Launch {
        /// The entry.
        kernel: String,
        /// What is wrong.
        reason: String,
    },
    /// A kernel fault: the launch stopped at the first one. Memory written before it stays
    /// written, as on a device.
    #[error("{0}")]
    Fault(Box<Fault>),
    /// A host-side memory operation was invalid (unknown pointer, out of bounds, ...).
    #[error("device memory: {0}")]
    Memory(String),
}

/// What a kernel did wrong, where.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    /// The entry.
    pub kernel: String,
    /// 1-based source line of the instruction.
    pub line: u32,
    /// The source line.
    pub text: String,
    /// Block index (x, y, z).
    pub block: [u32; 3],
    /// Thread index within the block (x, y, z) of the (first) faulting thread.
    pub thread: [u32; 3],
    /// What happened.
    pub kind: FaultKind,
}

/// A memory access's direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A load.
    Read,
    /// A store.
    Write,
}

/// A data hazard between two threads of one block between barriers (compute-sanitizer's
/// racecheck classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hazard {
    /// Read after another thread's write.
    ReadAfterWrite,
    /// Write after another thread's read.
    WriteAfterRead,
    /// Write after another thread's write.
    WriteAfterWrite,
}

/// The kinds of kernel fault.
#[derive(Clone, Debug, PartialEq)]
pub enum FaultKind {
    /// An access outside every allocation (global) or outside the block's shared memory.
    OutOfBounds {
        /// `global`, `shared` or `param`.
        space: &'static str,
        /// The address.
        addr: u64,
        /// Bytes accessed.
        size: u32,
        /// Read or write.
        access: Access,
        /// The nearest allocation, or the shared size.
        detail: String,
    },
    /// An address not aligned to the access size.
    Misaligned {
        /// `global` or `shared`.
        space: &'static str,
        /// The address.
        addr: u64,
        /// The required alignment.
        align: u32,
    },
    /// A read of memory never written (shared memory: never written by this block).
    Uninitialized {
        /// `global` or `shared`.
        space: &'static str,
        /// The first uninitialised byte.
        addr: u64,
    },
    /// Two threads of one block touch the same shared byte between barriers, at least one
    /// writing (including a pending `cp.async` destination).
    SharedRace {
        /// Which hazard.
        hazard: Hazard,
        /// The shared-space address.
        addr: u64,
        /// The other thread's linear index in the block, if one thread.
        other_thread: Option<u32>,
        /// The other access's source line.
        other_line: Option<u32>,
    },
    /// Two blocks of one launch touch the same global bytes, one of them writing: the
    /// result depends on the order blocks run in.
    BlockRace {
        /// The address.
        addr: u64,
        /// This access.
        access: Access,
        /// The block (linear index) that wrote it earlier in this launch.
        other_block: u32,
    },
    /// `ld.global.nc` (read-only for the kernel's lifetime) of memory this launch writes.
    NonCoherentRead {
        /// The address.
        addr: u64,
    },
    /// A barrier that not every thread of the block reaches, or that lanes of one warp
    /// reach at different instructions.
    Barrier(String),
    /// A warp-synchronous instruction (`shfl.sync`, `ldmatrix`, `mma`) whose lanes are not
    /// all there.
    WarpSync(String),
    /// `bra.uni` whose lanes went different ways.
    DivergentUniformBranch,
    /// Integer division or remainder by zero.
    DivideByZero,
    /// The instruction budget of the launch ran out (a likely endless loop).
    StepLimit(u64),
    /// A runtime form the interpreter does not execute (e.g. a barrier thread count).
    Unsupported(String),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [bx, by, bz] = self.block;
        let [tx, ty, tz] = self.thread;
        write!(
            f,
            "kernel `{}`, line {} `{}`, block ({bx},{by},{bz}) thread ({tx},{ty},{tz}): {}",
            self.kernel, self.line, self.text, self.kind
        )
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultKind::OutOfBounds {
                space,
                addr,
                size,
                access,
                detail,
            } => {
                let a = if *access == Access::Read {
                    "read"
                } else {
                    "write"
                };
                write!(
                    f,
                    "out-of-bounds {space} {a} of {size} bytes at {addr:#x} ({detail})"
                )
            }
            FaultKind::Misaligned { space, addr, align } => {
                write!(
                    f,
                    "misaligned {space} access at {addr:#x} (needs {align}-byte alignment)"
                )
            }
            FaultKind::Uninitialized { space, addr } => {
                write!(f, "read of uninitialised {space} memory at {addr:#x}")
            }
            FaultKind::SharedRace {
                hazard,
                addr,
                other_thread,
                other_line,
            } => {
                let who = match other_thread {
                    Some(t) => format!("thread {t}"),
                    None => "several threads".to_string(),
                };
                let at = other_line.map_or(String::new(), |l| format!(" at line {l}"));
                write!(
                    f,
                    "shared-memory race ({hazard:?}) at {addr:#x} with {who}{at}, no barrier between"
                )
            }
            FaultKind::BlockRace {
                addr,
                access,
                other_block,
            } => write!(
                f,
                "global {} at {addr:#x} of bytes block {other_block} wrote in this launch: the result depends on block order",
                if *access == Access::Read {
                    "read"
                } else {
                    "write"
                }
            ),
            FaultKind::NonCoherentRead { addr } => {
                write!(
                    f,
                    "ld.global.nc at {addr:#x} reads memory this launch writes (the .nc path is read-only)"
                )
            }
            FaultKind::Barrier(s) => write!(f, "barrier: {s}"),
            FaultKind::WarpSync(s) => write!(f, "warp-synchronous instruction: {s}"),
            FaultKind::DivergentUniformBranch => {
                write!(f, "bra.uni diverged (its lanes took different ways)")
            }
            FaultKind::DivideByZero => write!(f, "integer division by zero"),
            FaultKind::StepLimit(n) => write!(
                f,
                "instruction budget of {n} warp steps exhausted (endless loop?)"
            ),
            FaultKind::Unsupported(s) => write!(f, "not supported: {s}"),
        }
    }
}
