//! A block's shared memory with a racecheck-style shadow: for every byte, the last writer
//! and reader (thread, barrier epoch, instruction) and whether a `cp.async` is in flight to
//! it. Epochs count barriers over the whole launch, so a byte written by an earlier block
//! reads as uninitialised without clearing anything between blocks.

use crate::error::{Access, FaultKind, Hazard};

/// Several threads read the byte in this epoch.
const MANY: u16 = u16::MAX;

#[derive(Clone, Copy, Default)]
struct Cell {
    w_epoch: u32,
    r_epoch: u32,
    /// The accessing warp's `bar.warp.sync` count at the access.
    w_wep: u32,
    r_wep: u32,
    w_pc: u32,
    r_pc: u32,
    w_tid: u16,
    r_tid: u16,
    /// 1 + the thread whose `cp.async` targets the byte, 0 when none is in flight.
    pending: u16,
}

/// Shared memory of the running block.
pub(crate) struct Shared {
    pub data: Vec<u8>,
    cells: Vec<Cell>,
    /// The current barrier epoch.
    epoch: u32,
    /// The epoch the running block started in: older writes belong to earlier blocks.
    start: u32,
    /// Per warp of the block: its `bar.warp.sync` count, which orders its own lanes.
    warp_epochs: Vec<u32>,
}

impl Shared {
    pub(crate) fn new(bytes: usize) -> Shared {
        Shared {
            data: vec![0; bytes],
            cells: vec![Cell::default(); bytes],
            epoch: 0,
            start: 1,
            warp_epochs: vec![0; 32],
        }
    }

    /// A new block starts: nothing in its shared memory is initialised.
    pub(crate) fn begin_block(&mut self) {
        self.epoch += 1;
        self.start = self.epoch;
        self.warp_epochs.fill(0);
        for c in &mut self.cells {
            c.pending = 0;
        }
    }

    /// A barrier completed.
    pub(crate) fn barrier(&mut self) {
        self.epoch += 1;
    }

    /// Warp `w` executed `bar.warp.sync`.
    pub(crate) fn warp_barrier(&mut self, w: u32) {
        self.warp_epochs[w as usize] += 1;
    }

    /// Whether an earlier access (epoch, thread, warp count) and one by `tid` now conflict:
    /// same barrier epoch, another thread, and not two lanes of one warp separated by a
    /// `bar.warp.sync`.
    fn conflicts(&self, epoch: u32, other: u16, wep: u32, tid: u16) -> bool {
        Self::conflicts_in(self.epoch, &self.warp_epochs, epoch, other, wep, tid)
    }

    fn conflicts_in(
        now: u32,
        warp_epochs: &[u32],
        epoch: u32,
        other: u16,
        wep: u32,
        tid: u16,
    ) -> bool {
        if epoch != now || other == tid {
            return false;
        }
        let same_warp = other != MANY && other / 32 == tid / 32;
        !(same_warp && wep < warp_epochs[(tid / 32) as usize])
    }

    fn range(&self, addr: u64, len: usize, access: Access) -> Result<usize, FaultKind> {
        if addr
            .checked_add(len as u64)
            .is_none_or(|end| end > self.data.len() as u64)
        {
            return Err(FaultKind::OutOfBounds {
                space: "shared",
                addr,
                size: len as u32,
                access,
                detail: format!("the block has {} bytes of shared memory", self.data.len()),
            });
        }
        Ok(addr as usize)
    }

    fn race(
        hazard: Hazard,
        addr: usize,
        tid: u16,
        pc: u32,
        line: &dyn Fn(u32) -> u32,
    ) -> FaultKind {
        let other_thread = (tid != MANY).then_some(tid as u32);
        FaultKind::SharedRace {
            hazard,
            addr: addr as u64,
            other_thread,
            other_line: other_thread.map(|_| line(pc)),
        }
    }

    /// Thread `tid` at instruction `pc` reads `out.len()` bytes at `addr`; `line` maps an
    /// instruction index to its source line for the report.
    pub(crate) fn read(
        &mut self,
        addr: u64,
        out: &mut [u8],
        tid: u16,
        pc: u32,
        line: &dyn Fn(u32) -> u32,
    ) -> Result<(), FaultKind> {
        let a = self.range(addr, out.len(), Access::Read)?;
        let wep = self.warp_epochs[(tid / 32) as usize];
        for (k, c) in self.cells[a..a + out.len()].iter_mut().enumerate() {
            if c.pending != 0 {
                return Err(Self::race(
                    Hazard::ReadAfterWrite,
                    a + k,
                    c.pending - 1,
                    c.w_pc,
                    line,
                ));
            }
            if c.w_epoch < self.start {
                return Err(FaultKind::Uninitialized {
                    space: "shared",
                    addr: (a + k) as u64,
                });
            }
            if Self::conflicts_in(
                self.epoch,
                &self.warp_epochs,
                c.w_epoch,
                c.w_tid,
                c.w_wep,
                tid,
            ) {
                return Err(Self::race(
                    Hazard::ReadAfterWrite,
                    a + k,
                    c.w_tid,
                    c.w_pc,
                    line,
                ));
            }
            if Self::conflicts_in(
                self.epoch,
                &self.warp_epochs,
                c.r_epoch,
                c.r_tid,
                c.r_wep,
                tid,
            ) {
                c.r_tid = MANY;
            } else {
                (c.r_epoch, c.r_tid, c.r_pc, c.r_wep) = (self.epoch, tid, pc, wep);
            }
        }
        crate::mem::copy_small(out, &self.data[a..a + out.len()]);
        Ok(())
    }

    /// Thread `tid` at `pc` writes `bytes` at `addr`.
    pub(crate) fn write(
        &mut self,
        addr: u64,
        bytes: &[u8],
        tid: u16,
        pc: u32,
        line: &dyn Fn(u32) -> u32,
    ) -> Result<(), FaultKind> {
        let a = self.range(addr, bytes.len(), Access::Write)?;
        self.check_write(a, bytes.len(), tid, line)?;
        let wep = self.warp_epochs[(tid / 32) as usize];
        for c in &mut self.cells[a..a + bytes.len()] {
            (c.w_epoch, c.w_tid, c.w_pc, c.w_wep) = (self.epoch, tid, pc, wep);
        }
        crate::mem::copy_small(&mut self.data[a..a + bytes.len()], bytes);
        Ok(())
    }

    fn check_write(
        &self,
        a: usize,
        len: usize,
        tid: u16,
        line: &dyn Fn(u32) -> u32,
    ) -> Result<(), FaultKind> {
        for (k, c) in self.cells[a..a + len].iter().enumerate() {
            if c.pending != 0 {
                return Err(Self::race(
                    Hazard::WriteAfterWrite,
                    a + k,
                    c.pending - 1,
                    c.w_pc,
                    line,
                ));
            }
            if self.conflicts(c.w_epoch, c.w_tid, c.w_wep, tid) {
                return Err(Self::race(
                    Hazard::WriteAfterWrite,
                    a + k,
                    c.w_tid,
                    c.w_pc,
                    line,
                ));
            }
            if self.conflicts(c.r_epoch, c.r_tid, c.r_wep, tid) {
                return Err(Self::race(
                    Hazard::WriteAfterRead,
                    a + k,
                    c.r_tid,
                    c.r_pc,
                    line,
                ));
            }
        }
        Ok(())
    }

    /// A `cp.async` by `tid` at `pc` now targets `[addr, addr + len)`: any access before it
    /// completes is a race.
    pub(crate) fn begin_async(
        &mut self,
        addr: u64,
        len: usize,
        tid: u16,
        pc: u32,
        line: &dyn Fn(u32) -> u32,
    ) -> Result<(), FaultKind> {
        let a = self.range(addr, len, Access::Write)?;
        self.check_write(a, len, tid, line)?;
        for c in &mut self.cells[a..a + len] {
            c.pending = tid + 1;
            c.w_pc = pc;
        }
        Ok(())
    }

    /// The `cp.async` into `[addr, ..)` completes: the bytes land as a write by its thread.
    pub(crate) fn end_async(&mut self, addr: u64, bytes: &[u8], tid: u16, pc: u32) {
        let a = addr as usize;
        let wep = self.warp_epochs[(tid / 32) as usize];
        for c in &mut self.cells[a..a + bytes.len()] {
            c.pending = 0;
            (c.w_epoch, c.w_tid, c.w_pc, c.w_wep) = (self.epoch, tid, pc, wep);
        }
        self.data[a..a + bytes.len()].copy_from_slice(bytes);
    }
}
