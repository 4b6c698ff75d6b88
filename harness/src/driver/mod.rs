//! One step driver for `simulate` and `train`: the loop that drives `rolloutpipe-core`.
//!
//! Both the discrete-event simulator and real runs hold one or more `Scheduler`s and a set of
//! workers (rollout engines, verifiers, a trainer). This module owns every call into the core
//! and the order they come in; the workers ([`Workers`]) only carry out what the core decided
//! and say what happened. One round of the loop:
//!
//! 1. rollout side, on the rolling step's core: allocation decisions, draws, aborts,
//!    admissions (while the workers have a free slot);
//! 2. trainer side, on the training step's core: dispatches, then, when the trainer is idle,
//!    the optimizer step or else the next micro-batch;
//! 3. step done, when the trainer is idle and the core says so;
//! 4. wait for the next events and report each to the core ([`Report`]).
//!
//! The simulator implements [`Workers`] with its virtual clock and event queue, `train` with
//! its transport and an `Instant`. What differs between them for real (the simulator's
//! SGLang engine model, routing, multiplexing and migration; train's least-loaded engine
//! pick, its multiplexing of the KL reference pass (`train::mux`), one-step-off's buffered
//! batch) stays in the implementations.
pub mod metrics;
pub mod mode;
pub mod plan;

use anyhow::{Result, anyhow};
use rolloutpipe_core::{
    Admission, Allocated, Completion, Dispatch, GroupId, MicroBatch, OptimizerStep, Plan,
    PolicyVersion, RequestId, Scheduler, StepId, StepSummary, Tick,
};

/// What became of a cancel the driver asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancel {
    /// The request is gone already (cancelled synchronously, or its engine is lost): the driver
    /// acknowledges it to the core at once.
    Done,
    /// The engine will confirm with [`Report::AbortAcked`].
    Sent,
}

/// How trainer work the driver handed over went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Started; its end comes back as a [`Report`].
    Started,
    /// Done already (buffered for later): the driver reports it to the core at once.
    Done,
}

/// What happened, reported to the core by the driver.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Report {
    /// A step begins with this plan (the core of `step` must be free).
    Begin {
        /// The step.
        step: u64,
        /// The weights version its rollout uses.
        version: PolicyVersion,
        /// Its plan.
        plan: Plan,
    },
    /// A request generated `tokens` tokens with weights `version`.
    Generated {
        /// The request.
        id: RequestId,
        /// The weights that generated it.
        version: PolicyVersion,
        /// Response tokens.
        tokens: u32,
    },
    /// A generated request's reward.
    Scored {
        /// The request.
        id: RequestId,
        /// Its reward.
        reward: f32,
    },
    /// An engine confirmed an abort.
    AbortAcked {
        /// The request.
        id: RequestId,
    },
    /// The request's engine is gone: it waits for another with the same id.
    Preempted {
        /// The request.
        id: RequestId,
    },
    /// The request failed on weights `version`.
    Failed {
        /// The request.
        id: RequestId,
        /// The weights it ran with.
        version: PolicyVersion,
    },
    /// The trainer consumed the micro-batch it was given for `step`.
    MicroBatchConsumed {
        /// The step.
        step: u64,
    },
    /// The trainer finished the optimizer step it was given for `step`.
    OptimizerStepDone {
        /// The step.
        step: u64,
    },
}

/// The workers' side of a run: the actions the core's decisions turn into, and the events that
/// come back. Every method that receives a `Scheduler` gets it read-only: the state changes are
/// the driver's.
pub trait Workers {
    /// Where an admitted request goes (an engine, or a router that binds it at submission).
    type Slot;

    /// Time now.
    fn now(&self) -> Tick;
    /// The step whose rollout is under way, if any.
    fn rolling(&self) -> Option<u64>;
    /// The step whose groups the trainer takes, if any.
    fn training(&self) -> Option<u64>;
    /// The allocation policy the core asks (`poll_allocation_with`).
    fn allocator(&self) -> &crate::alloc::Allocator;

    /// The core applied an allocation decision for a held group.
    fn allocated(&mut self, sched: &Scheduler<'_>, step: u64, a: Allocated) -> Result<()>;
    /// The core numbered `n` new prompts from `first`: draw them.
    fn drawn(&mut self, sched: &Scheduler<'_>, step: u64, first: GroupId, n: u32) -> Result<()>;
    /// Cancel in-flight request `id`.
    fn cancel(&mut self, step: u64, id: RequestId) -> Result<Cancel>;
    /// Requests are waiting to be admitted: bring the engines' state up to date.
    fn prepare_admission(&mut self) {}
    /// A place for one more request, `None` when none can take one now.
    fn free_slot(&mut self) -> Option<Self::Slot>;
    /// Send the admitted request to `slot`.
    fn submit(&mut self, step: u64, slot: Self::Slot, a: Admission) -> Result<()>;
    /// The rollout side's polls of this round are done.
    fn rollout_polled(&mut self, sched: &Scheduler<'_>, step: u64) -> Result<()> {
        let _ = (sched, step);
        Ok(())
    }

    /// The core handed group `d` to the trainer's FIFO.
    fn dispatched(&mut self, sched: &Scheduler<'_>, step: u64, d: Dispatch) -> Result<()>;
    /// The trainer can take core work now.
    fn trainer_idle(&self) -> bool;
    /// Step the optimizer for `step`.
    fn optimizer_step(&mut self, step: u64, o: OptimizerStep) -> Result<Work>;
    /// Train micro-batch `mb` of `step`.
    fn micro_batch(&mut self, step: u64, mb: MicroBatch) -> Result<Work>;
    /// The trainer side's polls are done; `admissible` is whether the rolling core still has
    /// requests waiting to be admitted.
    fn polled(&mut self, admissible: bool) -> Result<()> {
        let _ = admissible;
        Ok(())
    }
    /// The core says `step` is done (the trainer is idle). May be called again for the same
    /// step while the workers still have work of their own.
    fn step_done(&mut self, step: u64, summary: StepSummary) -> Result<()>;

    /// The run (or this phase of it) is over.
    fn finished(&self) -> bool;
    /// Waits for what happens next and appends it to `reports`; `false` when nothing ever
    /// will (the run stalled).
    fn wait(&mut self, reports: &mut Vec<Report>) -> Result<bool>;
    /// The core's answer to a [`Report::Generated`].
    fn generated(
        &mut self,
        sched: &Scheduler<'_>,
        id: RequestId,
        answer: Result<Completion, rolloutpipe_core::RequestError>,
    ) -> Result<()>;
    /// The core's answer to a [`Report::Scored`].
    fn scored(
        &mut self,
        sched: &Scheduler<'_>,
        id: RequestId,
        reward: f32,
        answer: Result<Completion, rolloutpipe_core::RequestError>,
    ) -> Result<()>;
    /// The core consumed a micro-batch of `step` (its answer says whether it ended an
    /// optimizer step).
    fn consumed(&mut self, step: u64, mb: MicroBatch) -> Result<()> {
        let _ = (step, mb);
        Ok(())
    }
    /// The core began `step`.
    fn began(&mut self, step: u64) -> Result<()> {
        let _ = step;
        Ok(())
    }
}

/// The core that holds `step`: steps take the cores in turn (two for one-step-off in the
/// simulator, which trains step k while step k+1 rolls out).
fn core<'a, 's>(cores: &'a mut [Scheduler<'s>], step: u64) -> &'a mut Scheduler<'s> {
    let n = cores.len() as u64;
    &mut cores[(step % n) as usize]
}

/// Runs rounds until `w` is finished: poll, then wait and report. `cores` must not be empty.
pub fn drive<W: Workers>(cores: &mut [Scheduler<'_>], w: &mut W) -> Result<()> {
    anyhow::ensure!(!cores.is_empty(), "the driver needs a core");
    let mut reports = Vec::new();
    loop {
        poll(cores, w)?;
        if w.finished() {
            return Ok(());
        }
        if !w.wait(&mut reports)? {
            return Ok(());
        }
        for r in reports.drain(..) {
            report(cores, w, r)?;
        }
    }
}

/// One round of decisions, in the driver's fixed order (see the module's documentation).
pub fn poll<W: Workers>(cores: &mut [Scheduler<'_>], w: &mut W) -> Result<()> {
    let mut admissible = false;
    if let Some(step) = w.rolling() {
        let now = w.now();
        let sched = core(cores, step);
        rollout_side(sched, w, step, now)?;
        admissible = sched.view().pending_requests() > 0;
    }
    if let Some(step) = w.training() {
        trainer_side(core(cores, step), w, step)?;
    }
    w.polled(admissible)?;
    if let Some(step) = w.training()
        && w.trainer_idle()
        && let Some(summary) = core(cores, step).poll_step_done()
    {
        w.step_done(step, summary)?;
    }
    Ok(())
}

fn rollout_side<W: Workers>(
    sched: &mut Scheduler<'_>,
    w: &mut W,
    step: u64,
    now: Tick,
) -> Result<()> {
    // Allocation decisions first: a committed or skipped group may call for a draw or end the
    // batch (aborts), an extended one for admissions.
    while let Some(a) = sched.poll_allocation_with(now, w.allocator()) {
        w.allocated(sched, step, a)?;
    }
    while let Some(n) = sched.poll_draw(now) {
        let first = sched
            .on_prompts_drawn(now, n)
            .map_err(|e| anyhow!("step {step}: draw: {e}"))?;
        w.drawn(sched, step, first, n)?;
    }
    while let Some(id) = sched.poll_abort(now) {
        if w.cancel(step, id)? == Cancel::Done {
            sched
                .on_abort_acked(now, id)
                .map_err(|e| anyhow!("{id}: abort ack: {e}"))?;
        }
    }
    if sched.view().pending_requests() > 0 {
        w.prepare_admission();
        while let Some(slot) = w.free_slot() {
            let Some(a) = sched.poll_admit(now) else {
                break;
            };
            w.submit(step, slot, a)?;
        }
    }
    w.rollout_polled(sched, step)
}

fn trainer_side<W: Workers>(sched: &mut Scheduler<'_>, w: &mut W, step: u64) -> Result<()> {
    let now = w.now();
    while let Some(d) = sched.poll_dispatch(now) {
        w.dispatched(sched, step, d)?;
    }
    // Work the trainer finishes at once (buffered) is reported at once, and the next asked.
    while w.trainer_idle() {
        let now = w.now();
        if let Some(o) = sched.poll_optimizer_step(now) {
            if w.optimizer_step(step, o)? == Work::Done {
                sched
                    .on_optimizer_step_done(now)
                    .map_err(|e| anyhow!("step {step}: optimizer step: {e}"))?;
                continue;
            }
        } else if let Some(mb) = sched.poll_micro_batch(now)
            && w.micro_batch(step, mb)? == Work::Done
        {
            let c = sched
                .on_micro_batch_consumed(now)
                .map_err(|e| anyhow!("step {step}: micro-batch consumed: {e}"))?;
            w.consumed(step, c)?;
            continue;
        }
        break;
    }
    Ok(())
}

/// Reports one event to the core of its step and hands the core's answer back to `w`.
pub fn report<W: Workers>(cores: &mut [Scheduler<'_>], w: &mut W, r: Report) -> Result<()> {
    let now = w.now();
    match r {
        Report::Begin {
            step,
            version,
            plan,
        } => {
            core(cores, step)
                .begin_step(now, StepId(step), version, plan)
                .map_err(|e| anyhow!("step {step}: begin_step: {e}"))?;
            w.began(step)
        }
        Report::Generated {
            id,
            version,
            tokens,
        } => {
            let sched = core(cores, id.step.0);
            let answer = sched.on_request_generated(now, id, version, tokens);
            w.generated(sched, id, answer)
        }
        Report::Scored { id, reward } => {
            let sched = core(cores, id.step.0);
            if sched.step().map(|(s, _)| s) != Some(id.step) {
                // The step is over and its core reused; the core would refuse it.
                return Ok(());
            }
            let answer = sched.on_reward(now, id, reward);
            w.scored(sched, id, reward, answer)
        }
        Report::AbortAcked { id } => core(cores, id.step.0)
            .on_abort_acked(now, id)
            .map_err(|e| anyhow!("{id}: abort ack: {e}")),
        Report::Preempted { id } => core(cores, id.step.0)
            .on_request_preempted(now, id)
            .map(drop)
            .map_err(|e| anyhow!("preemption of {id}: {e}")),
        Report::Failed { id, version } => core(cores, id.step.0)
            .on_request_failed(now, id, version)
            .map(drop)
            .map_err(|e| anyhow!("failure of {id}: {e}")),
        Report::MicroBatchConsumed { step } => {
            let c = core(cores, step)
                .on_micro_batch_consumed(now)
                .map_err(|e| anyhow!("step {step}: micro-batch consumed: {e}"))?;
            w.consumed(step, c)
        }
        Report::OptimizerStepDone { step } => core(cores, step)
            .on_optimizer_step_done(now)
            .map_err(|e| anyhow!("step {step}: optimizer step: {e}")),
    }
}
