//! Device (global) memory: allocations at 256-byte aligned addresses with unmapped gaps
//! between them, so that an access past one never lands in the next. Every 2-byte unit has a
//! shadow word: which launch wrote it last (0 = never, [`HOST`] = a host copy or memset) and
//! from which block, for the uninitialised-read, cross-block and `.nc` checks.

use crate::error::{Access, FaultKind};

/// Where the first allocation starts: far from small integers mistaken for pointers.
pub(crate) const GLOBAL_BASE: u64 = 0x7000_0000_0000;
/// Unmapped bytes left after every allocation.
const GUARD: u64 = 1 << 16;
/// The shadow stamp of host writes; launches stamp from 2 up.
pub(crate) const HOST: u32 = 1;

/// One allocation.
pub(crate) struct Alloc {
    pub base: u64,
    pub data: Vec<u8>,
    /// Per 2-byte unit: launch stamp << 32 | writing block.
    shadow: Vec<u64>,
}

/// What a kernel access is checked against.
#[derive(Clone, Copy)]
pub(crate) struct Who {
    /// This launch's stamp.
    pub stamp: u32,
    /// The accessing block's linear index.
    pub block: u32,
}

/// All allocations, ordered by address.
pub(crate) struct Global {
    allocs: Vec<Alloc>,
    next: u64,
    /// Index of the allocation hit last (accesses cluster).
    last: usize,
}

impl Global {
    pub(crate) fn new() -> Global {
        Global {
            allocs: Vec::new(),
            next: GLOBAL_BASE,
            last: 0,
        }
    }

    /// A new zero-length-safe allocation of `bytes` (uninitialised as far as kernels can
    /// tell, like `cuMemAlloc`).
    pub(crate) fn alloc(&mut self, bytes: usize) -> u64 {
        let base = self.next;
        self.next = (base + bytes as u64 + GUARD).div_ceil(256) * 256;
        self.allocs.push(Alloc {
            base,
            data: vec![0; bytes],
            shadow: vec![0; bytes.div_ceil(2)],
        });
        base
    }

    /// Frees the allocation starting at `base`.
    pub(crate) fn free(&mut self, base: u64) -> Result<(), String> {
        let i = self
            .allocs
            .binary_search_by_key(&base, |a| a.base)
            .map_err(|_| format!("free of {base:#x}, which is not the start of an allocation"))?;
        self.allocs.remove(i);
        self.last = 0;
        Ok(())
    }

    /// Bytes in use.
    pub(crate) fn used(&self) -> usize {
        self.allocs.iter().map(|a| a.data.len()).sum()
    }

    /// The allocation holding `[addr, addr + len)` whole, if any.
    fn find(&mut self, addr: u64, len: u64) -> Option<usize> {
        let hit = |a: &Alloc| a.base <= addr && addr + len <= a.base + a.data.len() as u64;
        if self.allocs.get(self.last).is_some_and(hit) {
            return Some(self.last);
        }
        let i = self
            .allocs
            .partition_point(|a| a.base <= addr)
            .checked_sub(1)?;
        hit(&self.allocs[i]).then(|| {
            self.last = i;
            i
        })
    }

    fn oob(&self, addr: u64, len: u64, access: Access) -> FaultKind {
        let i = self.allocs.partition_point(|a| a.base <= addr);
        let detail = match i.checked_sub(1).map(|j| &self.allocs[j]) {
            Some(a) if addr < a.base + a.data.len() as u64 + GUARD => {
                format!(
                    "{} bytes past the end of the {}-byte allocation at {:#x}",
                    addr + len - (a.base + a.data.len() as u64),
                    a.data.len(),
                    a.base
                )
            }
            _ => "no allocation there".to_string(),
        };
        FaultKind::OutOfBounds {
            space: "global",
            addr,
            size: len as u32,
            access,
            detail,
        }
    }

    /// Host access: the slice of `[addr, addr + len)`, marking it written by the host when
    /// `write`.
    pub(crate) fn host(&mut self, addr: u64, len: usize, write: bool) -> Result<&mut [u8], String> {
        let i = self.find(addr, len as u64).ok_or_else(|| {
            match self.oob(addr, len as u64, Access::Read) {
                FaultKind::OutOfBounds { detail, .. } => {
                    format!("{len} bytes at {addr:#x}: {detail}")
                }
                k => k.to_string(),
            }
        })?;
        let a = &mut self.allocs[i];
        let off = (addr - a.base) as usize;
        if write {
            for u in off / 2..(off + len).div_ceil(2) {
                a.shadow[u] = (HOST as u64) << 32;
            }
        }
        Ok(&mut a.data[off..off + len])
    }

    /// A kernel load of `len` bytes (at most 16) into `out`, checked.
    pub(crate) fn load(
        &mut self,
        addr: u64,
        out: &mut [u8],
        who: Who,
        nc: bool,
    ) -> Result<(), FaultKind> {
        let len = out.len() as u64;
        let i = self
            .find(addr, len)
            .ok_or_else(|| self.oob(addr, len, Access::Read))?;
        let a = &self.allocs[i];
        let off = (addr - a.base) as usize;
        for u in off / 2..(off + out.len()).div_ceil(2) {
            let s = a.shadow[u];
            let (stamp, block) = ((s >> 32) as u32, s as u32);
            if stamp == 0 {
                return Err(FaultKind::Uninitialized {
                    space: "global",
                    addr: a.base + 2 * u as u64,
                });
            }
            if stamp == who.stamp {
                if nc {
                    return Err(FaultKind::NonCoherentRead {
                        addr: a.base + 2 * u as u64,
                    });
                }
                if block != who.block {
                    return Err(FaultKind::BlockRace {
                        addr: a.base + 2 * u as u64,
                        access: Access::Read,
                        other_block: block,
                    });
                }
            }
        }
        copy_small(out, &a.data[off..off + out.len()]);
        Ok(())
    }

    /// A kernel store of `bytes`, checked.
    pub(crate) fn store(&mut self, addr: u64, bytes: &[u8], who: Who) -> Result<(), FaultKind> {
        let len = bytes.len() as u64;
        let i = self
            .find(addr, len)
            .ok_or_else(|| self.oob(addr, len, Access::Write))?;
        let a = &mut self.allocs[i];
        let off = (addr - a.base) as usize;
        let mine = (who.stamp as u64) << 32 | who.block as u64;
        for u in off / 2..(off + bytes.len()).div_ceil(2) {
            let s = a.shadow[u];
            if (s >> 32) as u32 == who.stamp && s != mine {
                return Err(FaultKind::BlockRace {
                    addr: a.base + 2 * u as u64,
                    access: Access::Write,
                    other_block: s as u32,
                });
            }
            a.shadow[u] = mine;
        }
        copy_small(&mut a.data[off..off + bytes.len()], bytes);
        Ok(())
    }
}

/// `dst.copy_from_slice(src)` for the access sizes (1 to 16 bytes) without a call to
/// `memmove`.
#[inline(always)]
pub(crate) fn copy_small(dst: &mut [u8], src: &[u8]) {
    match (dst.len(), src.len()) {
        (4, 4) => dst.copy_from_slice(&src[..4]),
        (8, 8) => dst.copy_from_slice(&src[..8]),
        (16, 16) => dst.copy_from_slice(&src[..16]),
        (2, 2) => dst.copy_from_slice(&src[..2]),
        _ => dst.iter_mut().zip(src).for_each(|(d, s)| *d = *s),
    }
}
