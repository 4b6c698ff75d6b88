//! One phase of a training run (a step's rollout and training; for one-step-off, step k's
//! rollout beside step k-1's training) as the step driver's [`Workers`]: the core's decisions
//! become messages to the engine, verifier and trainer workers, and their events come back as
//! driver reports. Every call into the core is the driver's (`crate::driver`).
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::bail;
use rolloutpipe_backends::AccumStats;
use rolloutpipe_core::{
    Admission, Allocated, Allocation, Completion, Dispatch, GroupId, GroupState, MicroBatch,
    OptimizerStep, PolicyVersion, RequestError, RequestId, Scheduler, SkipReason, StepSummary,
    Tick,
};

use super::ctx::{Ctx, PID_GROUPS};
use super::steps::Pending;
use crate::driver::metrics::Occupancy;
use crate::driver::{Cancel, Report, Work, Workers};
use crate::tasks::Problem;
use crate::train::msg::{Add, EngineCmd, Event, GroupBatch, Moved, Sample, TrainCmd, VerifyJob};

/// What the trainer is doing for the scheduler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Busy {
    Idle,
    /// A micro-batch of the core's current step.
    CoreMb,
    /// The core's optimizer step.
    CoreOpt,
    /// One-step-off: a micro-batch of the previous step's batch, then an optimizer step?
    PrevMb {
        ends_opt: bool,
    },
    /// One-step-off: the previous batch's optimizer step.
    PrevOpt,
}

/// Training results of one step's batch.
#[derive(Debug, Default, Clone)]
pub(crate) struct TrainAgg {
    pub(crate) accum: AccumStats,
    pub(crate) loss_sum: f64,
    pub(crate) opt_steps: u32,
    pub(crate) grad_norm: f64,
    pub(crate) busy_s: f64,
    pub(crate) last_mb_s: f64,
    pub(crate) end: Option<Instant>,
}

impl TrainAgg {
    pub(super) fn on_mb(&mut self, s: f64) {
        self.busy_s += s;
        self.last_mb_s = s;
    }
    pub(super) fn on_opt(
        &mut self,
        accum: &AccumStats,
        norm: f64,
        grad_norm: f64,
        s: f64,
        end: Instant,
    ) {
        self.accum.merge(accum);
        self.loss_sum += accum.loss_sum / norm;
        self.opt_steps += 1;
        self.grad_norm = grad_norm;
        self.busy_s += s;
        self.last_mb_s += s;
        self.end = Some(end);
    }
}

/// A drawn prompt and its responses so far.
pub(crate) struct GroupRec {
    /// The problem's index in the training pool (for eviction).
    pub(super) index: usize,
    pub(super) prompt: Arc<Vec<u32>>,
    pub(super) problem: Arc<Problem>,
    pub(super) samples: Vec<Option<Sample>>,
}

/// The rollout of one step, as seen from the scheduler thread.
pub(crate) struct Rollout {
    pub(super) step: u64,
    pub(super) version: PolicyVersion,
    pub(super) start: Instant,
    pub(super) groups: HashMap<GroupId, GroupRec>,
    pub(super) inflight: HashMap<RequestId, (u16, Instant)>,
    pub(super) generated: HashMap<RequestId, Sample>,
    pub(super) rewards: (f64, u64, u64),
    pub(super) tokens: u64,
    pub(super) spans: Vec<(u16, f64, f64)>,
    /// When each trainable group materialized, s after the start.
    pub(super) group_done: Vec<f64>,
    /// Groups the allocation policy extended.
    pub(super) extended: u32,
}

/// One phase: the rollout of step `k` (when `rollout_this`) and the trainer's work.
pub(super) struct Phase<'a, 'c> {
    pub(super) ctx: &'a mut Ctx<'c>,
    pub(super) k: u64,
    pub(super) one_off: bool,
    pub(super) rollout_this: bool,
    pub(super) ro: Rollout,
    /// Training of this step's batch (on-policy modes).
    pub(super) cur: TrainAgg,
    /// One-step-off: training of the previous step's batch.
    pub(super) prev: TrainAgg,
    /// One-step-off: this step's micro-batches, consumed by the core at once and trained in
    /// the next phase, each with whether an optimizer step follows it.
    pub(super) buffer: Vec<(Vec<GroupBatch>, bool)>,
    /// One-step-off: the previous step's buffered micro-batches still to train.
    pub(super) pending: &'a mut Pending,
    pub(super) busy: Busy,
    /// Groups in dispatch order.
    pub(super) dispatched: Vec<GroupBatch>,
    /// The core said the step is done.
    pub(super) core_done: bool,
    /// Requests held by the engines over the rollout (slot occupancy).
    pub(super) occupancy: Occupancy,
    /// Rewarded samples waiting for the core's answer.
    pub(super) scoring: HashMap<RequestId, (Sample, bool)>,
    /// Tail multiplexing: per dispatched group, its reference pass on an engine.
    pub(super) mux: Vec<super::mux::MuxPass>,
    /// Dispatched groups before this index are in a micro-batch the trainer was given.
    pub(super) started_upto: usize,
    /// Groups whose multiplexed reference log-probs the trainer used.
    pub(super) mux_groups: u32,
    /// Engine seconds spent on multiplexed reference passes (used or late).
    pub(super) mux_s: f64,
    /// Long-tail migration: exported states and counts.
    pub(super) mig: super::migrate::Migration,
}

impl<'a, 'c> Phase<'a, 'c> {
    /// Phase `k`, starting now with the engines at `version`.
    pub(super) fn new(
        ctx: &'a mut Ctx<'c>,
        k: u64,
        version: PolicyVersion,
        rollout_this: bool,
        pending: &'a mut Pending,
    ) -> Self {
        let one_off = ctx.cfg.run.mode.stale();
        let occupancy = Occupancy::start(ctx.now().0);
        Self {
            ctx,
            k,
            one_off,
            rollout_this,
            ro: Rollout {
                step: k,
                version,
                start: Instant::now(),
                groups: HashMap::new(),
                inflight: HashMap::new(),
                generated: HashMap::new(),
                rewards: (0.0, 0, 0),
                tokens: 0,
                spans: Vec::new(),
                group_done: Vec::new(),
                extended: 0,
            },
            cur: TrainAgg::default(),
            prev: TrainAgg::default(),
            buffer: Vec::new(),
            pending,
            busy: Busy::Idle,
            dispatched: Vec::new(),
            core_done: false,
            occupancy,
            scoring: HashMap::new(),
            mux: Vec::new(),
            started_upto: 0,
            mux_groups: 0,
            mux_s: 0.0,
            mig: Default::default(),
        }
    }

    /// A request left engine `e` (generated, aborted or lost).
    pub(super) fn released(&mut self, e: usize) {
        self.ctx.engine_running(e, -1);
        self.occupancy.change(self.ctx.now().0, -1);
    }

    /// Micro-batch `mb`'s groups, in dispatch order.
    fn groups_of(&self, mb: MicroBatch) -> anyhow::Result<Vec<GroupBatch>> {
        let (a, b) = (mb.first_seq as usize, (mb.first_seq + mb.len) as usize);
        match self.dispatched.get(a..b) {
            Some(g) => Ok(g.to_vec()),
            None => bail!("micro-batch {} beyond the dispatched groups", mb.index),
        }
    }
}

impl Workers for Phase<'_, '_> {
    /// An engine index.
    type Slot = usize;

    fn now(&self) -> Tick {
        self.ctx.now()
    }

    fn rolling(&self) -> Option<u64> {
        self.rollout_this.then_some(self.k)
    }

    fn training(&self) -> Option<u64> {
        self.rollout_this.then_some(self.k)
    }

    fn allocator(&self) -> &crate::alloc::Allocator {
        &self.ctx.allocator
    }

    /// Room for an extension's samples, or the eviction of a solved prompt (Pilot-Commit's
    /// p = 1) from later epochs.
    fn allocated(&mut self, sched: &Scheduler<'_>, _step: u64, a: Allocated) -> anyhow::Result<()> {
        let ro = &mut self.ro;
        match a.applied {
            Allocation::Extend(_) => {
                ro.extended += 1;
                let target = sched.group(a.group).map_or(0, |info| info.target as usize);
                if let Some(g) = ro.groups.get_mut(&a.group) {
                    g.samples.resize(target, None);
                }
            }
            Allocation::Skip(SkipReason::Solved) if self.ctx.cfg.alloc.evict_solved => {
                if let Some(g) = ro.groups.get(&a.group) {
                    self.ctx.evicted.insert(g.index);
                }
            }
            Allocation::Commit
                if sched.group(a.group).is_some_and(|g| {
                    matches!(g.state, GroupState::Trainable | GroupState::Dispatched)
                }) =>
            {
                // A held group completes when it is committed, not at its last reward.
                ro.group_done.push(ro.start.elapsed().as_secs_f64());
            }
            _ => {}
        }
        Ok(())
    }

    fn drawn(
        &mut self,
        sched: &Scheduler<'_>,
        _step: u64,
        first: GroupId,
        n: u32,
    ) -> anyhow::Result<()> {
        for i in 0..n {
            let (index, problem, prompt) = self.ctx.data.draw_unevicted(&self.ctx.evicted);
            self.ctx.measured.prompt_tokens.push(prompt.len() as u32);
            let g = GroupId(first.0 + i);
            let size = sched.group(g).map_or(0, |info| info.target as usize);
            self.ro.groups.insert(
                g,
                GroupRec {
                    index,
                    prompt,
                    problem,
                    samples: vec![None; size],
                },
            );
        }
        Ok(())
    }

    fn cancel(&mut self, _step: u64, id: RequestId) -> anyhow::Result<Cancel> {
        match self.ro.inflight.get(&id) {
            Some(&(e, _)) if self.ctx.engines[e as usize].live => {
                let _ = self.ctx.engines[e as usize].tx.send(EngineCmd::Cancel(id));
                Ok(Cancel::Sent)
            }
            _ => {
                // Its engine is gone: nothing runs it any more.
                self.ro.inflight.remove(&id);
                Ok(Cancel::Done)
            }
        }
    }

    /// The core picks the request; the harness only picks the least loaded live engine.
    fn free_slot(&mut self) -> Option<usize> {
        let s = self.ctx.cfg.rollout.slots;
        let engines = &self.ctx.engines;
        // An engine busy with a multiplexed pass would queue the request behind it.
        (0..engines.len())
            .filter(|&i| engines[i].live && engines[i].running < s)
            .min_by_key(|&i| (engines[i].running, engines[i].mux_busy))
    }

    fn submit(&mut self, _step: u64, e: usize, a: Admission) -> anyhow::Result<()> {
        let resume = self.take_resume(a.request);
        let Some(g) = self.ro.groups.get(&a.request.group) else {
            bail!("the core admitted {} of an undrawn group", a.request);
        };
        let cmd = match resume {
            Some(state) => EngineCmd::Resume(Box::new(Moved {
                rid: a.request,
                state,
            })),
            None => EngineCmd::Add(Add {
                rid: a.request,
                prompt: g.prompt.clone(),
                params: self.ctx.sampling(a.request),
            }),
        };
        if self.ctx.engines[e].tx.send(cmd).is_err() {
            return Err(self.ctx.worker_stopped(&format!("rollout engine {e}")));
        }
        self.ctx.engine_running(e, 1);
        self.occupancy.change(self.ctx.now().0, 1);
        self.ro
            .inflight
            .insert(a.request, (e as u16, Instant::now()));
        Ok(())
    }

    fn rollout_polled(&mut self, sched: &Scheduler<'_>, _step: u64) -> anyhow::Result<()> {
        self.prune_migrations(sched);
        if sched.is_batch_final() && !self.occupancy.stopped() {
            // Slot occupancy is over the rollout: from its start to the batch being final.
            self.occupancy.stop(self.ctx.now().0);
        }
        Ok(())
    }

    fn dispatched(
        &mut self,
        _sched: &Scheduler<'_>,
        _step: u64,
        d: Dispatch,
    ) -> anyhow::Result<()> {
        let Some(g) = self.ro.groups.get(&d.group) else {
            bail!("the core dispatched unknown group {}", d.group);
        };
        let samples: Option<Vec<Sample>> = g.samples.iter().cloned().collect();
        let Some(samples) = samples else {
            bail!("group {} was dispatched with samples missing", d.group);
        };
        let t = self.ctx.us(Instant::now());
        self.ctx.trace.instant(
            &format!("dispatch {}", d.group),
            "dispatch",
            PID_GROUPS,
            0,
            t,
        );
        self.dispatched.push(GroupBatch {
            step: self.ro.step,
            group: d.group,
            prompt: g.prompt.clone(),
            samples,
            ref_logprobs: None,
        });
        self.mux.push(super::mux::MuxPass::Free);
        Ok(())
    }

    /// One-step-off's core trainer is the buffer, always idle; otherwise the trainer worker.
    fn trainer_idle(&self) -> bool {
        self.one_off || self.busy == Busy::Idle
    }

    fn optimizer_step(&mut self, _step: u64, _o: OptimizerStep) -> anyhow::Result<Work> {
        if self.one_off {
            if let Some(last) = self.buffer.last_mut() {
                last.1 = true;
            }
            return Ok(Work::Done);
        }
        self.ctx.send_trainer(TrainCmd::OptStep)?;
        self.busy = Busy::CoreOpt;
        Ok(Work::Started)
    }

    fn micro_batch(&mut self, step: u64, mb: MicroBatch) -> anyhow::Result<Work> {
        let mut groups = self.groups_of(mb)?;
        self.take_mux(mb, &mut groups);
        if self.one_off {
            // Trained in the next phase, with the weights this rollout's successor uses.
            self.buffer.push((groups, false));
            return Ok(Work::Done);
        }
        self.ctx.record_trained(&groups, step);
        self.ctx.send_trainer(TrainCmd::MicroBatch(groups))?;
        self.busy = Busy::CoreMb;
        Ok(Work::Started)
    }

    fn consumed(&mut self, _step: u64, mb: MicroBatch) -> anyhow::Result<()> {
        if self.one_off
            && let Some(last) = self.buffer.last_mut()
        {
            last.1 = mb.ends_optimizer_step;
        }
        Ok(())
    }

    /// One-step-off: the trainer worker takes the previous step's buffered micro-batches.
    /// Migration: a long request moves to a light engine. Multiplexing: idle engines take
    /// reference passes.
    fn polled(&mut self, admissible: bool) -> anyhow::Result<()> {
        if !admissible {
            self.migrate()?;
            self.multiplex()?;
        }
        if self.one_off
            && self.busy == Busy::Idle
            && let Some((groups, ends_opt)) = self.pending.pop_front()
        {
            self.ctx.record_trained(&groups, self.k.saturating_sub(1));
            self.ctx.send_trainer(TrainCmd::MicroBatch(groups))?;
            self.busy = Busy::PrevMb { ends_opt };
        }
        Ok(())
    }

    fn step_done(&mut self, _step: u64, _summary: StepSummary) -> anyhow::Result<()> {
        self.core_done = true;
        Ok(())
    }

    /// A late multiplexed pass is waited for: its engine would finish it before the weight
    /// sync anyway, and its event belongs to this phase.
    fn finished(&self) -> bool {
        (!self.rollout_this || self.core_done)
            && self.busy == Busy::Idle
            && self.pending.is_empty()
            && !self.ctx.engines.iter().any(|e| e.mux_busy || e.migrating)
    }

    fn wait(&mut self, reports: &mut Vec<Report>) -> anyhow::Result<bool> {
        match self.ctx.recv()? {
            None => {}
            Some(Event::Trainer {
                reply,
                started,
                ended,
            }) => self.on_trainer(reply, started, ended, reports)?,
            Some(ev) => self.on_event(ev, reports)?,
        }
        Ok(true)
    }

    fn generated(
        &mut self,
        _sched: &Scheduler<'_>,
        rid: RequestId,
        answer: Result<Completion, RequestError>,
    ) -> anyhow::Result<()> {
        match answer {
            Ok(Completion::Accepted { .. }) => {
                let Some(g) = self.ro.groups.get(&rid.group) else {
                    bail!("generated {rid} of an unknown group");
                };
                let Some(s) = self.ro.generated.get(&rid) else {
                    bail!("generated {rid} without its sample");
                };
                let job = VerifyJob {
                    rid,
                    problem: g.problem.clone(),
                    tokens: s.tokens.clone(),
                };
                if let Some(v) = &self.ctx.verify {
                    v.send(job)
                        .map_err(|_| anyhow::anyhow!("the verifiers stopped"))?;
                }
            }
            // Discarded: the group ended while it ran.
            Ok(_) => {
                self.ro.generated.remove(&rid);
            }
            Err(e) => {
                self.ro.generated.remove(&rid);
                tracing::warn!(%rid, "completion rejected: {e}");
            }
        }
        Ok(())
    }

    fn scored(
        &mut self,
        sched: &Scheduler<'_>,
        rid: RequestId,
        reward: f32,
        answer: Result<Completion, RequestError>,
    ) -> anyhow::Result<()> {
        let Some((mut s, correct)) = self.scoring.remove(&rid) else {
            bail!("a reward for {rid} the driver did not report");
        };
        let state = match answer {
            Ok(Completion::Accepted { group_state }) => group_state,
            // Discarded: the group ended while the verifier ran (aborted or filtered).
            Ok(_) => return Ok(()),
            Err(e) => {
                tracing::debug!(%rid, "reward dropped: {e}");
                return Ok(());
            }
        };
        let ro = &mut self.ro;
        ro.rewards.0 += reward as f64;
        ro.rewards.1 += 1;
        ro.rewards.2 += correct as u64;
        s.reward = reward;
        s.correct = correct;
        if let Some(g) = ro.groups.get_mut(&rid.group)
            && let Some(slot) = g.samples.get_mut(rid.sample as usize)
        {
            *slot = Some(s);
        }
        if state.is_incomplete() {
            return Ok(());
        }
        let trainable = matches!(state, GroupState::Trainable | GroupState::Dispatched);
        if trainable {
            ro.group_done.push(ro.start.elapsed().as_secs_f64());
        }
        if let Some(info) = sched.group(rid.group) {
            let now = self.ctx.now().0 as f64;
            let (a, b) = (
                info.drawn_at.0 as f64,
                info.ended_at.map(|t| t.0 as f64).unwrap_or(now),
            );
            self.ctx.trace.async_span(
                &format!("{}", rid.group),
                if trainable { "group" } else { "filtered" },
                PID_GROUPS,
                0,
                ((ro.step) << 32) | rid.group.0 as u64,
                a,
                b,
                serde_json::json!({"state": state.to_string()}),
            );
        }
        Ok(())
    }
}
