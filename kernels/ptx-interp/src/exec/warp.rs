//! A warp: 32 lanes with one register file (`regs[reg * 32 + lane]`, 64 bits per register)
//! and groups of lanes that share a program counter. Lanes that branch apart become separate
//! groups; the group with the lowest program counter runs first and groups that reach the
//! same instruction merge again, which reconverges structured code at its join points.
//! Warp-synchronous instructions wait until every lane they name has arrived.

use crate::ir::{Reg, Src};

/// Why a group is not running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// It runs.
    No,
    /// At a warp-synchronous instruction, for lanes not yet there.
    Sync,
    /// At `bar.sync`, for the rest of the block.
    Barrier,
}

/// Lanes at one program counter.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Group {
    pub pc: u32,
    pub mask: u32,
    pub wait: Wait,
}

/// One `cp.async` copy in flight: its lane, commit group, destination and data.
pub(crate) struct Copy {
    pub lane: u8,
    pub group: u32,
    pub dst: u64,
    pub len: u8,
    pub data: [u8; 16],
    pub pc: u32,
}

/// A warp's state.
pub(crate) struct Warp {
    /// Index of the warp in its block.
    pub id: u32,
    pub regs: Vec<u64>,
    pub groups: Vec<Group>,
    /// Lanes that exist (a partial last warp has fewer) and have not exited.
    pub live: u32,
    /// Lanes that exist.
    pub exists: u32,
    /// Per lane: the commit group its next `cp.async` joins.
    pub cp_group: [u32; 32],
    pub copies: Vec<Copy>,
    /// Instructions this warp executed.
    pub steps: u64,
}

impl Warp {
    pub(crate) fn new(id: u32, nregs: u32, exists: u32) -> Warp {
        Warp {
            id,
            regs: vec![0; nregs as usize * 32],
            groups: vec![Group {
                pc: 0,
                mask: exists,
                wait: Wait::No,
            }],
            live: exists,
            exists,
            cp_group: [0; 32],
            copies: Vec::new(),
            steps: 0,
        }
    }

    /// Makes the warp new again for another block (its register file is reused).
    pub(crate) fn reset(&mut self, id: u32, nregs: u32, exists: u32) {
        self.id = id;
        self.regs.clear();
        self.regs.resize(nregs as usize * 32, 0);
        self.groups.clear();
        self.groups.push(Group {
            pc: 0,
            mask: exists,
            wait: Wait::No,
        });
        self.live = exists;
        self.exists = exists;
        self.cp_group = [0; 32];
        self.copies.clear();
        self.steps = 0;
    }

    /// The register (or immediate) `s` in `lane`.
    #[inline(always)]
    pub(crate) fn get(&self, s: Src, lane: usize) -> u64 {
        match s {
            Src::R(r) => self.regs[(r as usize) << 5 | lane],
            Src::I(v) => v,
        }
    }

    #[inline(always)]
    pub(crate) fn set(&mut self, d: Reg, lane: usize, v: u64) {
        self.regs[(d as usize) << 5 | lane] = v;
    }

    /// The runnable group with the lowest program counter.
    pub(crate) fn pick(&self) -> Option<usize> {
        if self.groups.len() == 1 {
            return (self.groups[0].wait == Wait::No).then_some(0);
        }
        (0..self.groups.len())
            .filter(|&i| self.groups[i].wait == Wait::No)
            .min_by_key(|&i| self.groups[i].pc)
    }

    /// Merges group `g` into any other group at the same program counter.
    pub(crate) fn merge(&mut self, g: usize) {
        if self.groups.len() == 1 {
            return;
        }
        let pc = self.groups[g].pc;
        if let Some(o) = (0..self.groups.len()).find(|&o| o != g && self.groups[o].pc == pc) {
            let both_barrier =
                self.groups[o].wait == Wait::Barrier && self.groups[g].wait == Wait::Barrier;
            self.groups[o].mask |= self.groups[g].mask;
            self.groups[o].wait = if both_barrier {
                Wait::Barrier
            } else {
                Wait::No
            };
            self.groups.swap_remove(g);
        }
    }

    /// Lanes of `mask` whose guard predicate `(reg, negated)` holds.
    #[inline(always)]
    pub(crate) fn guarded(&self, mask: u32, guard: Option<(Reg, bool)>) -> u32 {
        let Some((p, neg)) = guard else { return mask };
        let mut out = 0;
        let base = (p as usize) << 5;
        for_lanes(mask, |l| {
            if (self.regs[base | l] & 1 != 0) != neg {
                out |= 1 << l;
            }
        });
        out
    }
}

/// Calls `f` for every set bit of `mask`, lowest first.
#[inline(always)]
pub(crate) fn for_lanes(mut mask: u32, mut f: impl FnMut(usize)) {
    while mask != 0 {
        f(mask.trailing_zeros() as usize);
        mask &= mask - 1;
    }
}

/// The lane numbers set in `mask`, for messages.
pub(crate) fn lanes_str(mask: u32) -> String {
    let v: Vec<String> = (0..32)
        .filter(|l| mask >> l & 1 != 0)
        .map(|l| l.to_string())
        .collect();
    v.join(",")
}
