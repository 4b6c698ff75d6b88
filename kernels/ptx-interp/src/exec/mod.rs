//! Running a launch: blocks one after another in linear order, inside a block its warps in
//! order, each until it exits or waits at a barrier; a barrier releases when every thread of
//! the block waits at one. Everything is deterministic: the same launch gives the same bits
//! and the same first fault.

mod alu;
mod memops;
mod shared;
mod sync;
mod warp;

pub(crate) use memops::SHARED_WINDOW;

use crate::error::{Fault, FaultKind};
use crate::ir::{Entry, Op, SPECIALS, Src};
use crate::mem::Global;
use shared::Shared;
use warp::{Group, Wait, Warp, lanes_str};

/// Everything a launch needs besides memory.
pub(crate) struct LaunchSpec<'a> {
    pub entry: &'a Entry,
    pub lines: &'a [String],
    pub params: Vec<u8>,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub dyn_shared: u32,
    /// This launch's shadow stamp (see `mem`).
    pub stamp: u32,
    /// Warp instructions the launch may execute before it is stopped.
    pub max_steps: u64,
}

/// Counts of one launch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// Warp instructions executed (one per instruction per group of lanes).
    pub warp_steps: u64,
    /// Blocks run.
    pub blocks: u64,
    /// The most warp instructions any one warp executed: on a GPU, where warps run side by
    /// side, the length of the launch's critical path (in instructions).
    pub max_warp_steps: u64,
}

/// The running block.
pub(crate) struct Block<'a> {
    spec: &'a LaunchSpec<'a>,
    global: &'a mut Global,
    shared: Shared,
    idx: [u32; 3],
    /// Linear block index.
    lin: u32,
    steps: u64,
    max_warp_steps: u64,
    /// Warps of the previous block, reused (register files are the big allocation).
    pool: Vec<Warp>,
}

type R<T> = Result<T, Box<Fault>>;

/// Runs every block of a launch.
pub(crate) fn run(spec: &LaunchSpec, global: &mut Global) -> R<LaunchStats> {
    let shared_bytes = (spec.entry.shared_dyn_base + spec.dyn_shared).max(spec.entry.shared_static);
    let mut b = Block {
        spec,
        global,
        shared: Shared::new(shared_bytes as usize),
        idx: [0; 3],
        lin: 0,
        steps: 0,
        max_warp_steps: 0,
        pool: Vec::new(),
    };
    let [gx, gy, gz] = spec.grid;
    let mut blocks = 0;
    for z in 0..gz {
        for y in 0..gy {
            for x in 0..gx {
                b.idx = [x, y, z];
                b.run_block()?;
                b.lin += 1;
                blocks += 1;
            }
        }
    }
    Ok(LaunchStats {
        warp_steps: b.steps,
        blocks,
        max_warp_steps: b.max_warp_steps,
    })
}

impl Block<'_> {
    fn threads(&self) -> u32 {
        self.spec.block.iter().product()
    }

    fn thread_xyz(&self, t: u32) -> [u32; 3] {
        let [bx, by, _] = self.spec.block;
        [t % bx, (t / bx) % by, t / (bx * by)]
    }

    /// A fault at instruction `pc` in thread `lane` of warp `warp`.
    fn fault(&self, pc: u32, warp: u32, lane: usize, kind: FaultKind) -> Box<Fault> {
        let line = self.spec.entry.insts.get(pc as usize).map_or(0, |i| i.line);
        let text = self
            .spec
            .lines
            .get(line as usize - 1)
            .map_or("", |s| s.trim())
            .to_string();
        Box::new(Fault {
            kernel: self.spec.entry.name.clone(),
            line,
            text,
            block: self.idx,
            thread: self.thread_xyz(warp * 32 + lane as u32),
            kind,
        })
    }

    /// Resets `w` as warp `w.id`'s start: lanes, special registers.
    fn init_warp(&self, w: &mut Warp) {
        let id = w.id;
        let n = self.threads();
        let exists = if (id + 1) * 32 <= n {
            u32::MAX
        } else {
            (1u32 << (n - id * 32)) - 1
        };
        w.reset(id, self.spec.entry.nregs, exists);
        let nwarps = n.div_ceil(32);
        let [bx, by, bz] = self.spec.block;
        let [gx, gy, gz] = self.spec.grid;
        for l in 0..32usize {
            let t = self.thread_xyz(id * 32 + l as u32);
            let lt = (1u64 << l) - 1;
            let vals = [
                t[0],
                t[1],
                t[2],
                bx,
                by,
                bz,
                self.idx[0],
                self.idx[1],
                self.idx[2],
                gx,
                gy,
                gz,
            ];
            for (r, v) in vals.into_iter().enumerate() {
                w.set(r as u32, l, v as u64);
            }
            let rest = [
                l as u64,
                id as u64,
                nwarps as u64,
                1 << l,
                lt | 1 << l,
                lt,
                !lt & 0xffff_ffff,
                !(lt | 1 << l) & 0xffff_ffff,
            ];
            for (k, v) in rest.into_iter().enumerate() {
                w.set((vals.len() + k) as u32, l, v);
            }
        }
        debug_assert_eq!(SPECIALS.len(), 20);
    }

    fn run_block(&mut self) -> R<()> {
        self.shared.begin_block();
        let mut warps = std::mem::take(&mut self.pool);
        let n = self.threads().div_ceil(32) as usize;
        warps.truncate(n);
        for i in 0..n {
            if i == warps.len() {
                warps.push(Warp::new(i as u32, 0, 0));
            }
            self.init_warp(&mut warps[i]);
        }
        let r = self.run_warps(&mut warps);
        self.pool = warps;
        r
    }

    fn run_warps(&mut self, warps: &mut [Warp]) -> R<()> {
        loop {
            for w in warps.iter_mut() {
                self.run_warp(w)?;
            }
            let waiting: Vec<usize> = (0..warps.len())
                .filter(|&i| !warps[i].groups.is_empty())
                .collect();
            let Some(&first) = waiting.first() else {
                self.max_warp_steps = warps
                    .iter()
                    .map(|w| w.steps)
                    .fold(self.max_warp_steps, u64::max);
                return Ok(());
            };
            // Every warp with lanes left waits at a barrier (run_warp returns only then).
            let pc = warps[first].groups[0].pc;
            let gone: Vec<u32> = warps
                .iter()
                .flat_map(|w| {
                    (0..32)
                        .filter(move |l| (w.exists & !w.live) >> l & 1 != 0)
                        .map(move |l| w.id * 32 + l)
                })
                .collect();
            if let Some(&t) = gone.first() {
                let msg = format!(
                    "{} thread(s) of the block exited without reaching it (thread {t} first)",
                    gone.len()
                );
                return Err(self.fault(
                    pc,
                    warps[first].id,
                    warps[first].groups[0].mask.trailing_zeros() as usize,
                    FaultKind::Barrier(msg),
                ));
            }
            if let Op::Bar { count: Some(c) } = self.spec.entry.insts[pc as usize].op {
                let n = match c {
                    Src::I(v) => v,
                    Src::R(r) => warps[first].regs[(r as usize) << 5],
                };
                if n != self.threads() as u64 {
                    return Err(self.fault(
                        pc,
                        warps[first].id,
                        0,
                        FaultKind::Unsupported(format!(
                            "bar.sync with a thread count ({n}) other than the block's"
                        )),
                    ));
                }
            }
            self.shared.barrier();
            for w in warps.iter_mut() {
                w.groups[0].pc += 1;
                w.groups[0].wait = Wait::No;
            }
        }
    }

    /// Runs warp `w` until it has exited or waits at a barrier.
    fn run_warp(&mut self, w: &mut Warp) -> R<()> {
        let insts = &self.spec.entry.insts;
        loop {
            let Some(g) = w.pick() else {
                return self.settle(w);
            };
            let Group { pc, mask, .. } = w.groups[g];
            self.steps += 1;
            w.steps += 1;
            if self.steps > self.spec.max_steps {
                return Err(self.fault(
                    pc,
                    w.id,
                    mask.trailing_zeros() as usize,
                    FaultKind::StepLimit(self.spec.max_steps),
                ));
            }
            let inst = &insts[pc as usize];
            let exec = w.guarded(mask, inst.guard);
            match inst.op {
                Op::Bra { .. } | Op::Exit => self.control(w, g, exec)?,
                Op::Bar { .. } => {
                    if exec != mask {
                        let msg = format!(
                            "lanes {} of warp {} skip it through their guard predicate",
                            lanes_str(mask & !exec),
                            w.id
                        );
                        return Err(self.fault(
                            pc,
                            w.id,
                            (mask & !exec).trailing_zeros() as usize,
                            FaultKind::Barrier(msg),
                        ));
                    }
                    w.groups[g].wait = Wait::Barrier;
                    w.merge(g);
                }
                Op::Shfl { .. } | Op::Ldmatrix { .. } | Op::Mma { .. } | Op::WarpBar { .. } => {
                    self.warp_sync(w, g, exec)?
                }
                _ => {
                    self.exec(w, pc, exec)
                        .map_err(|(l, k)| self.fault(pc, w.id, l, k))?;
                    w.groups[g].pc = pc + 1;
                    w.merge(g);
                }
            }
        }
    }

    /// `bra` and `exit` for group `g` (lanes `exec` take the branch or leave): splits the
    /// group where its lanes part and merges groups that meet.
    fn control(&mut self, w: &mut Warp, g: usize, exec: u32) -> R<()> {
        let Group { pc, mask, .. } = w.groups[g];
        let lane0 = mask.trailing_zeros() as usize;
        match self.spec.entry.insts[pc as usize].op {
            Op::Bra { target, uni } => {
                let rest = mask & !exec;
                if exec != 0 && rest != 0 {
                    if uni {
                        return Err(self.fault(pc, w.id, lane0, FaultKind::DivergentUniformBranch));
                    }
                    w.groups[g].mask = rest;
                    w.groups[g].pc = pc + 1;
                    w.groups.push(Group {
                        pc: target,
                        mask: exec,
                        wait: Wait::No,
                    });
                    // The new group first: merging it never moves group g.
                    w.merge(w.groups.len() - 1);
                } else {
                    w.groups[g].pc = if exec != 0 { target } else { pc + 1 };
                }
                w.merge(g);
            }
            Op::Exit => {
                w.live &= !exec;
                w.copies.retain(|c| exec >> c.lane & 1 == 0);
                let rest = mask & !exec;
                if rest == 0 {
                    w.groups.swap_remove(g);
                } else {
                    w.groups[g].mask = rest;
                    w.groups[g].pc = pc + 1;
                    w.merge(g);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A warp-synchronous instruction for group `g`: runs it when every lane it names is in
    /// the group, parks the group until they arrive, or faults.
    fn warp_sync(&mut self, w: &mut Warp, g: usize, exec: u32) -> R<()> {
        let Group { pc, mask, .. } = w.groups[g];
        let op = &self.spec.entry.insts[pc as usize].op;
        let lane0 = mask.trailing_zeros() as usize;
        let need = match *op {
            Op::Shfl { mask: m, .. } | Op::WarpBar { mask: m } => {
                let mm = w.get(m, exec.trailing_zeros() as usize & 31) as u32;
                if exec & !mm != 0 {
                    let msg = format!(
                        "lanes {} execute it outside its membermask {mm:#x}",
                        lanes_str(exec & !mm)
                    );
                    return Err(self.fault(pc, w.id, lane0, FaultKind::WarpSync(msg)));
                }
                mm
            }
            _ => w.live,
        };
        if need & !w.live != 0 {
            let msg = format!(
                "it needs lanes {} of warp {}, which have exited or do not exist",
                sync::missing(need, w.live),
                w.id
            );
            return Err(self.fault(pc, w.id, lane0, FaultKind::WarpSync(msg)));
        }
        if need & !mask != 0 {
            w.groups[g].wait = Wait::Sync;
            return Ok(());
        }
        if need & !exec != 0 {
            let msg = format!(
                "lanes {} skip it through their guard predicate",
                sync::missing(need, exec)
            );
            return Err(self.fault(pc, w.id, lane0, FaultKind::WarpSync(msg)));
        }
        let r = match *op {
            Op::Shfl {
                mode,
                d,
                p,
                a,
                b,
                c,
                ..
            } => sync::shfl(w, exec, mode, d, p, a, b, c),
            Op::Ldmatrix { n, trans, d, addr } => self.ldmatrix(w, exec, pc, n, trans, d, addr),
            Op::Mma { bf16, d, a, b, c } => {
                sync::mma(w, bf16, d, a, b, c);
                Ok(())
            }
            Op::WarpBar { .. } => {
                self.shared.warp_barrier(w.id);
                Ok(())
            }
            _ => Ok(()),
        };
        r.map_err(|(l, k)| self.fault(pc, w.id, l, k))?;
        w.groups[g].pc = pc + 1;
        w.merge(g);
        Ok(())
    }

    /// No group of `w` can run: fine when all have exited or all lanes wait at one barrier.
    fn settle(&self, w: &Warp) -> R<()> {
        if let Some(s) = w.groups.iter().find(|g| g.wait == Wait::Sync) {
            let mut elsewhere: Vec<String> = w
                .groups
                .iter()
                .filter(|o| o.pc != s.pc)
                .map(|o| {
                    format!(
                        "lanes {} at line {}",
                        lanes_str(o.mask),
                        self.spec.entry.insts[o.pc as usize].line
                    )
                })
                .collect();
            let exited = w.exists & !w.live;
            if exited != 0 {
                elsewhere.push(format!("lanes {} exited", lanes_str(exited)));
            }
            let msg = format!(
                "lanes {} wait for the rest of the warp, which never arrives ({})",
                lanes_str(s.mask),
                elsewhere.join("; ")
            );
            return Err(self.fault(
                s.pc,
                w.id,
                s.mask.trailing_zeros() as usize,
                FaultKind::WarpSync(msg),
            ));
        }
        if w.groups.len() > 1 {
            let at: Vec<String> = w
                .groups
                .iter()
                .map(|o| {
                    format!(
                        "lanes {} at line {}",
                        lanes_str(o.mask),
                        self.spec.entry.insts[o.pc as usize].line
                    )
                })
                .collect();
            let g = w.groups[0];
            return Err(self.fault(
                g.pc,
                w.id,
                g.mask.trailing_zeros() as usize,
                FaultKind::Barrier(format!(
                    "one warp waits at different barriers: {}",
                    at.join("; ")
                )),
            ));
        }
        Ok(())
    }

    /// Every other instruction, on the lanes of `exec`.
    fn exec(&mut self, w: &mut Warp, pc: u32, exec: u32) -> Result<(), (usize, FaultKind)> {
        let op = &self.spec.entry.insts[pc as usize].op;
        if alu::alu(w, op, exec)? {
            return Ok(());
        }
        match *op {
            Op::Ld {
                space,
                bytes,
                n,
                d,
                addr,
                sext,
                nc,
            } => self.ld(w, exec, pc, space, bytes, n, d, addr, sext, nc),
            Op::St {
                space,
                bytes,
                n,
                a,
                addr,
            } => self.st(w, exec, pc, space, bytes, n, a, addr),
            Op::CpAsync {
                dst,
                src,
                size,
                src_size,
            } => self.cp_async(w, exec, pc, dst, src, size, src_size),
            Op::CpCommit => {
                memops::cp_commit(w, exec);
                Ok(())
            }
            Op::CpWait(n) => {
                self.cp_wait(w, exec, n);
                Ok(())
            }
            Op::CvtaShared { d, a, to_generic } => {
                warp::for_lanes(exec, |l| {
                    let v = w.get(a, l);
                    w.set(
                        d,
                        l,
                        if to_generic {
                            v.wrapping_add(SHARED_WINDOW)
                        } else {
                            v.wrapping_sub(SHARED_WINDOW)
                        },
                    );
                });
                Ok(())
            }
            Op::Unimplemented(ref s) => Err((
                exec.trailing_zeros() as usize & 31,
                FaultKind::Unsupported(s.clone()),
            )),
            _ => Ok(()),
        }
    }
}
