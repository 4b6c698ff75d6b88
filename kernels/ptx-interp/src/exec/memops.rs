//! Loads, stores and `cp.async` per lane, through the global, shared and parameter spaces.

use crate::error::{Access, FaultKind};
use crate::exec::Block;
use crate::exec::alu::sext;
use crate::exec::warp::{Copy, Warp, for_lanes};
use crate::ir::{Addr, Reg, Space, Src};
use crate::mem::Who;

/// Generic addresses in `[SHARED_WINDOW, SHARED_WINDOW + 2^32)` are shared memory
/// (`cvta.shared` adds it, `cvta.to.shared` removes it); all others are global.
pub(crate) const SHARED_WINDOW: u64 = 0x1000_0000_0000;

/// A resolved location.
#[derive(Clone, Copy)]
enum Loc {
    Global(u64),
    Shared(u64),
    Param(u64),
}

fn locate(space: Space, a: u64) -> Loc {
    match space {
        Space::Global => Loc::Global(a),
        Space::Shared => Loc::Shared(a),
        Space::Param => Loc::Param(a),
        Space::Generic if (SHARED_WINDOW..SHARED_WINDOW + (1 << 32)).contains(&a) => {
            Loc::Shared(a - SHARED_WINDOW)
        }
        Space::Generic => Loc::Global(a),
    }
}

fn addr_of(w: &Warp, a: Addr, lane: usize) -> u64 {
    let base = a.base.map_or(0, |r| w.regs[(r as usize) << 5 | lane]);
    base.wrapping_add(a.off as u64)
}

/// Access sizes are powers of two (1 to 16 bytes, vectors of 2 or 4).
fn aligned(loc: Loc, len: u64) -> Result<(), FaultKind> {
    let (space, a) = match loc {
        Loc::Global(a) => ("global", a),
        Loc::Shared(a) => ("shared", a),
        Loc::Param(a) => ("param", a),
    };
    if a & (len - 1) != 0 {
        return Err(FaultKind::Misaligned {
            space,
            addr: a,
            align: len as u32,
        });
    }
    Ok(())
}

impl Block<'_> {
    fn who(&self) -> Who {
        Who {
            stamp: self.spec.stamp,
            block: self.lin,
        }
    }

    fn read(
        &mut self,
        loc: Loc,
        out: &mut [u8],
        tid: u16,
        pc: u32,
        nc: bool,
    ) -> Result<(), FaultKind> {
        match loc {
            Loc::Global(a) => self.global.load(a, out, self.who(), nc),
            Loc::Shared(a) => {
                let insts = &self.spec.entry.insts;
                self.shared
                    .read(a, out, tid, pc, &|p| insts[p as usize].line)
            }
            Loc::Param(a) => {
                let p = &self.spec.params;
                let end = a
                    .checked_add(out.len() as u64)
                    .filter(|&e| e <= p.len() as u64);
                let Some(end) = end else {
                    return Err(FaultKind::OutOfBounds {
                        space: "param",
                        addr: a,
                        size: out.len() as u32,
                        access: Access::Read,
                        detail: format!("the parameters take {} bytes", p.len()),
                    });
                };
                out.copy_from_slice(&p[a as usize..end as usize]);
                Ok(())
            }
        }
    }

    fn write(&mut self, loc: Loc, bytes: &[u8], tid: u16, pc: u32) -> Result<(), FaultKind> {
        match loc {
            Loc::Global(a) => self.global.store(a, bytes, self.who()),
            Loc::Shared(a) => {
                let insts = &self.spec.entry.insts;
                self.shared
                    .write(a, bytes, tid, pc, &|p| insts[p as usize].line)
            }
            Loc::Param(_) => Err(FaultKind::Unsupported("stores to the param space".into())),
        }
    }

    /// `ld`: `n` elements of `bytes` each from one aligned access per lane.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ld(
        &mut self,
        w: &mut Warp,
        mask: u32,
        pc: u32,
        space: Space,
        bytes: u8,
        n: u8,
        d: [Reg; 4],
        addr: Addr,
        sext_: bool,
        nc: bool,
    ) -> Result<(), (usize, FaultKind)> {
        let len = bytes as usize * n as usize;
        let mut m = mask;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            let loc = locate(space, addr_of(w, addr, l));
            let mut buf = [0u8; 16];
            aligned(loc, len as u64)
                .and_then(|_| {
                    self.read(loc, &mut buf[..len], (w.id * 32 + l as u32) as u16, pc, nc)
                })
                .map_err(|k| (l, k))?;
            for (k, &dk) in d.iter().enumerate().take(n as usize) {
                let v = element(&buf, k, bytes);
                w.set(dk, l, if sext_ { sext(v, bytes * 8) as u64 } else { v });
            }
        }
        Ok(())
    }

    /// `st`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn st(
        &mut self,
        w: &mut Warp,
        mask: u32,
        pc: u32,
        space: Space,
        bytes: u8,
        n: u8,
        a: [Src; 4],
        addr: Addr,
    ) -> Result<(), (usize, FaultKind)> {
        let len = bytes as usize * n as usize;
        let mut m = mask;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            let loc = locate(space, addr_of(w, addr, l));
            let mut buf = [0u8; 16];
            for (k, &ak) in a.iter().enumerate().take(n as usize) {
                put_element(&mut buf, k, bytes, w.get(ak, l));
            }
            aligned(loc, len as u64)
                .and_then(|_| self.write(loc, &buf[..len], (w.id * 32 + l as u32) as u16, pc))
                .map_err(|k| (l, k))?;
        }
        Ok(())
    }

    /// `cp.async`: reads `src-size` bytes now (zero-filling the rest) and marks the shared
    /// destination in flight until a `cp.async.wait_group` of the lane completes it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cp_async(
        &mut self,
        w: &mut Warp,
        mask: u32,
        pc: u32,
        dst: Addr,
        src: Addr,
        size: u8,
        src_size: Option<Src>,
    ) -> Result<(), (usize, FaultKind)> {
        let mut m = mask;
        while m != 0 {
            let l = m.trailing_zeros() as usize;
            m &= m - 1;
            let tid = (w.id * 32 + l as u32) as u16;
            let n = src_size.map_or(size as u64, |s| w.get(s, l) as u32 as u64);
            if n > size as u64 {
                return Err((
                    l,
                    FaultKind::Unsupported(format!("cp.async src-size {n} above cp-size {size}")),
                ));
            }
            let (d, s) = (
                locate(Space::Shared, addr_of(w, dst, l)),
                locate(Space::Global, addr_of(w, src, l)),
            );
            let mut data = [0u8; 16];
            let step = || -> Result<u64, FaultKind> {
                aligned(d, size as u64)?;
                aligned(s, size as u64)?;
                Ok(match d {
                    Loc::Shared(a) => a,
                    _ => 0,
                })
            };
            let da = step().map_err(|k| (l, k))?;
            if n > 0 {
                self.read(s, &mut data[..n as usize], tid, pc, false)
                    .map_err(|k| (l, k))?;
            }
            let insts = &self.spec.entry.insts;
            self.shared
                .begin_async(da, size as usize, tid, pc, &|p| insts[p as usize].line)
                .map_err(|k| (l, k))?;
            w.copies.push(Copy {
                lane: l as u8,
                group: w.cp_group[l],
                dst: da,
                len: size,
                data,
                pc,
            });
        }
        Ok(())
    }

    /// `cp.async.wait_group n` for the lanes of `mask`: completes every committed group of
    /// theirs except the `n` most recent.
    pub(crate) fn cp_wait(&mut self, w: &mut Warp, mask: u32, n: u32) {
        let groups = w.cp_group;
        let done = |c: &Copy| mask >> c.lane & 1 != 0 && c.group + n < groups[c.lane as usize];
        for c in w.copies.iter().filter(|c| done(c)) {
            self.shared.end_async(
                c.dst,
                &c.data[..c.len as usize],
                w.id as u16 * 32 + c.lane as u16,
                c.pc,
            );
        }
        w.copies.retain(|c| !done(c));
    }
}

/// `cp.async.commit_group` for the lanes of `mask`.
pub(crate) fn cp_commit(w: &mut Warp, mask: u32) {
    for_lanes(mask, |l| w.cp_group[l] += 1);
}

/// Element `k` of `bytes` bytes (1, 2, 4 or 8) of a little-endian buffer, zero-extended.
#[inline(always)]
fn element(buf: &[u8; 16], k: usize, bytes: u8) -> u64 {
    let at = k * bytes as usize;
    match bytes {
        1 => buf[at] as u64,
        2 => u16::from_le_bytes([buf[at], buf[at + 1]]) as u64,
        4 => u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as u64,
        _ => u64::from_le_bytes(buf[at..at + 8].try_into().unwrap_or([0; 8])),
    }
}

/// Writes the low `bytes` bytes of `v` as element `k` of a little-endian buffer.
#[inline(always)]
fn put_element(buf: &mut [u8; 16], k: usize, bytes: u8, v: u64) {
    let at = k * bytes as usize;
    match bytes {
        1 => buf[at] = v as u8,
        2 => buf[at..at + 2].copy_from_slice(&(v as u16).to_le_bytes()),
        4 => buf[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes()),
        _ => buf[at..at + 8].copy_from_slice(&v.to_le_bytes()),
    }
}
