//! The simulator as the step driver's `Workers`: each driver call becomes a timed action on
//! the engines, the verifier or the trainer model, and each popped event a report.
use anyhow::{Context, bail, ensure};
use rolloutpipe_core::{
    Admission, Allocated, Allocation, Completion, Dispatch, GroupId, GroupState, MicroBatch,
    OptimizerStep, PolicyVersion, RequestError, RequestId, Scheduler, StepSummary, Tick,
};

use super::{Ev, Ns, ReqStatus, RequestSpan, Routing, Sim, secs_to_ns, tick};
use crate::driver::{Cancel, Report, Work};

/// Where the simulator puts an admitted request: `None` binds it at submission through the
/// router (`config::Routing`), `Some(e)` runs it on engine `e` now (the central queue).
type Slot = Option<usize>;

impl crate::driver::Workers for Sim<'_> {
    type Slot = Slot;

    fn now(&self) -> Tick {
        tick(self.now)
    }

    fn rolling(&self) -> Option<u64> {
        self.rolling
    }

    fn training(&self) -> Option<u64> {
        self.training
    }

    fn allocator(&self) -> &crate::alloc::Allocator {
        &self.allocator
    }

    /// Allocation decisions (VIGOR's rounds, Pilot-Commit's verdicts): a round-2 request is
    /// admitted only now, after its group's round-1 rewards are all in.
    fn allocated(&mut self, sched: &Scheduler<'_>, step: u64, a: Allocated) -> anyhow::Result<()> {
        let state = sched.group(a.group).map(|g| g.state);
        if matches!(a.applied, Allocation::Extend(_)) {
            self.ctx(step).extended += 1;
        } else if matches!(state, Some(GroupState::Trainable | GroupState::Dispatched)) {
            // A held group completes when it is committed, not at its last reward.
            self.completed(step, a.group.0);
        }
        Ok(())
    }

    fn drawn(
        &mut self,
        _sched: &Scheduler<'_>,
        step: u64,
        first: GroupId,
        n: u32,
    ) -> anyhow::Result<()> {
        let c = &mut self.ctxs[step as usize];
        for i in 0..n {
            let g = c.workload.group(step, u64::from(first.0 + i));
            c.groups.push(g);
            c.completed.push(false);
            c.data_ready.push(Ns::MAX);
            c.logprob_ready.push(None);
            c.mb_started.push(false);
        }
        ensure!(
            c.groups.len() == (first.0 + n) as usize,
            "step {step}: core numbered groups out of draw order"
        );
        Ok(())
    }

    /// Aborts of surplus (or filtered) groups' in-flight requests take effect at once.
    fn cancel(&mut self, step: u64, id: RequestId) -> anyhow::Result<Cancel> {
        if let Some(key) = self.inflight.remove(&id) {
            let e = self.reqs[key].engine as usize;
            self.engines[e].advance_to(self.now);
            self.dirty[e] = true;
            let generated = self.engines[e].abort(key as u64);
            ensure!(
                generated.is_some(),
                "{id}: engine {e} did not hold an in-flight request"
            );
            self.reqs[key].status = ReqStatus::Aborted;
            let tokens = generated.unwrap_or(0);
            self.held_changed(e as u16, -1);
            let c = &mut self.ctxs[step as usize];
            c.tokens_generated += u64::from(tokens);
            if self.record {
                let r = self.reqs[key];
                self.rec.requests.push(RequestSpan {
                    step,
                    engine: r.engine,
                    group: id.group.0,
                    sample: id.sample,
                    start: r.start,
                    end: self.now,
                    tokens,
                    finished: false,
                });
            }
        }
        Ok(Cancel::Done)
    }

    fn prepare_admission(&mut self) {
        if self.cfg.rollout.routing != Routing::Central {
            return;
        }
        for e in 0..self.engines.len() {
            // Only engines with a free slot can take work; bring them to their next iteration
            // boundary so the KV check sees current occupancy.
            if self.engines[e].has_free_slot() {
                self.engines[e].advance_to(self.now);
                self.engines[e].admit_waiting();
                self.dirty[e] = true;
            }
        }
    }

    fn free_slot(&mut self) -> Option<Slot> {
        if self.cfg.rollout.routing != Routing::Central {
            // Bound at submission: Slime's semaphore (`plan.slots`, enforced by the core) lets a
            // request through, the router picks an engine at once, and the request waits in
            // that engine's queue until SGLang admits it.
            return Some(None);
        }
        // A central queue: the least-loaded engine that can run a request now takes it.
        (0..self.engines.len())
            .filter(|&e| self.engines[e].can_admit(self.prompt_tokens))
            .min_by_key(|&e| (self.engines[e].held(), e))
            .map(Some)
    }

    fn submit(&mut self, step: u64, slot: Slot, a: Admission) -> anyhow::Result<()> {
        match slot {
            None => {
                let e = self.route(step, a.request.group.0);
                self.place(step, e, a.request, a.version, false)
            }
            Some(e) => self.place(step, e, a.request, a.version, true),
        }
    }

    fn rollout_polled(&mut self, sched: &Scheduler<'_>, step: u64) -> anyhow::Result<()> {
        if sched.is_batch_final() && self.ctxs[step as usize].rollout_end.is_none() {
            self.rollout_ended(step);
        }
        if self.schedule.migrate && sched.view().pending_requests() == 0 {
            self.migrate(step);
        }
        Ok(())
    }

    fn dispatched(&mut self, sched: &Scheduler<'_>, step: u64, d: Dispatch) -> anyhow::Result<()> {
        let per_mtok = self.cfg.trainer.data_transfer_s_per_mtok;
        // Slime hands the batch over only after `abort` returned; CGP ships each group as it is
        // dispatched. Either way the data crosses one link, group after group.
        let mut from = self.link_free.max(self.now);
        if !self.schedule.mode.pipelined() && d.seq == 0 {
            from = from.max(self.now + secs_to_ns(self.cfg.rollout.abort_s));
        }
        let c = &mut self.ctxs[step as usize];
        ensure!(
            d.seq as usize == c.dispatched.len(),
            "step {step}: dispatch sequence skipped"
        );
        c.dispatched.push(d.group);
        let gi = d.group.0 as usize;
        // The trainer sees the group's final size, not every response drawn for it.
        let target = sched.group(d.group).map_or(0, |g| usize::from(g.target));
        c.groups[gi].samples.truncate(target);
        c.trained_samples += target as u64;
        let tokens = c.groups[gi].train_tokens();
        let ready = from + secs_to_ns(per_mtok * tokens as f64 * 1e-6);
        c.data_ready[gi] = ready;
        self.link_free = ready;
        Ok(())
    }

    fn trainer_idle(&self) -> bool {
        !self.trainer_busy
    }

    fn optimizer_step(&mut self, step: u64, _o: OptimizerStep) -> anyhow::Result<Work> {
        let dt = self.trainer_model.optimizer_ns();
        self.trainer_busy = true;
        let c = self.ctx(step);
        c.trainer_busy += dt;
        c.last_opt = dt;
        if self.record {
            self.rec
                .trainer
                .push((step, "optimizer".into(), self.now, self.now + dt));
        }
        self.queue.push(self.now + dt, Ev::OptimizerDone { step });
        Ok(Work::Started)
    }

    fn micro_batch(&mut self, step: u64, mb: MicroBatch) -> anyhow::Result<Work> {
        let now = self.now;
        let c = &mut self.ctxs[step as usize];
        let first = mb.first_seq as usize;
        let groups = c
            .dispatched
            .get(first..first + mb.len as usize)
            .with_context(|| {
                format!(
                    "step {step}: micro-batch {} beyond dispatched groups",
                    mb.index
                )
            })?
            .to_vec();
        // The micro-batch starts once its groups' data has arrived.
        let start = groups
            .iter()
            .map(|g| c.data_ready[g.0 as usize])
            .fold(now, Ns::max);
        let (mut tokens, mut precomputed) = (0u64, 0u64);
        for g in &groups {
            let gi = g.0 as usize;
            let t = c.groups[gi].train_tokens();
            tokens += t;
            // Log-probs an engine finished by now need no pass on the trainer; a pass still
            // running on an engine is wasted (the trainer computes it itself).
            if c.logprob_ready[gi].is_some_and(|at| at <= start) {
                precomputed += t;
            }
            c.mb_started[gi] = true;
        }
        let dt = self.trainer_model.micro_batch_ns_split(tokens, precomputed);
        c.trainer_busy += dt;
        c.last_mb = dt;
        self.trainer_busy = true;
        if self.record {
            self.rec
                .trainer
                .push((step, format!("mb {}", mb.index), start, start + dt));
        }
        self.queue.push(start + dt, Ev::MicroBatchDone { step });
        Ok(Work::Started)
    }

    /// Multiplexing, then every engine whose state changed schedules its next event.
    fn polled(&mut self, admissible: bool) -> anyhow::Result<()> {
        if self.schedule.multiplex && !admissible {
            self.multiplex();
        }
        for e in 0..self.engines.len() {
            if std::mem::take(&mut self.dirty[e]) {
                self.engines[e].admit_waiting();
                self.engines[e].prefill();
                if let Some((at, epoch)) = self.engines[e].schedule() {
                    self.queue.push(at, Ev::Boundary { engine: e, epoch });
                }
            }
        }
        Ok(())
    }

    fn step_done(&mut self, step: u64, summary: StepSummary) -> anyhow::Result<()> {
        self.step_end(step, summary)
    }

    fn finished(&self) -> bool {
        self.ctxs.len() as u64 == self.steps && self.ctxs.iter().all(|c| c.metrics.is_some())
    }

    fn wait(&mut self, reports: &mut Vec<Report>) -> anyhow::Result<bool> {
        let ev = loop {
            let Some((at, ev)) = self.queue.pop() else {
                return Ok(false);
            };
            ensure!(
                at >= self.now,
                "event queue went back in time ({at} < {})",
                self.now
            );
            self.now = at;
            self.events += 1;
            // An engine's event superseded by a later change to it: nothing happened, and no
            // decision round follows.
            match ev {
                Ev::Boundary { engine, epoch } if epoch != self.engines[engine].epoch() => {}
                ev => break ev,
            }
        };
        match ev {
            Ev::StartRollout { step } => {
                ensure!(
                    self.ctxs.len() as u64 == step,
                    "step {step} started out of order"
                );
                reports.push(Report::Begin {
                    step,
                    version: PolicyVersion(self.version(step)),
                    plan: self.plan(),
                });
            }
            Ev::StartTrain { step } => self.training = Some(step),
            Ev::Boundary { engine, .. } => {
                let out = self.engines[engine].on_event();
                self.dirty[engine] = true;
                for key in out.finished {
                    reports.push(self.finished_request(key as usize));
                }
            }
            Ev::Reward { key } => {
                let r = self.reqs[key];
                if r.status == ReqStatus::Generated {
                    self.reqs[key].status = ReqStatus::Done;
                    reports.push(Report::Scored {
                        id: r.id,
                        reward: r.reward,
                    });
                }
            }
            Ev::MuxDone => {}
            // The optimizer step is the core's decision (`poll_optimizer_step`): a batch that
            // turns final and short after its last micro-batch was consumed makes one due
            // without any micro-batch announcing it.
            Ev::MicroBatchDone { step } => {
                self.trainer_busy = false;
                reports.push(Report::MicroBatchConsumed { step });
            }
            Ev::OptimizerDone { step } => {
                self.trainer_busy = false;
                reports.push(Report::OptimizerStepDone { step });
            }
        }
        Ok(true)
    }

    fn began(&mut self, step: u64) -> anyhow::Result<()> {
        self.start_rollout(step)
    }

    fn generated(
        &mut self,
        _sched: &Scheduler<'_>,
        id: RequestId,
        answer: Result<Completion, RequestError>,
    ) -> anyhow::Result<()> {
        let key = self
            .generated_keys
            .pop_front()
            .with_context(|| format!("{id}: generated without a request"))?;
        match answer {
            Ok(Completion::Accepted { .. }) => {
                self.reqs[key].status = ReqStatus::Generated;
                self.queue
                    .push(self.now + self.verifier_ns, Ev::Reward { key });
            }
            // The request's group ended while it ran (an abort crossed the finish); the core
            // counted it and freed the slot.
            Ok(_) => self.reqs[key].status = ReqStatus::Done,
            Err(e) => bail!("{id}: generated: {e}"),
        }
        Ok(())
    }

    fn scored(
        &mut self,
        sched: &Scheduler<'_>,
        id: RequestId,
        _reward: f32,
        answer: Result<Completion, RequestError>,
    ) -> anyhow::Result<()> {
        match answer {
            Ok(Completion::Accepted { group_state }) => {
                if matches!(group_state, GroupState::Trainable | GroupState::Dispatched) {
                    self.completed(id.step.0, id.group.0);
                }
            }
            // Discarded: the group ended meanwhile (aborted as surplus or filtered).
            Ok(_) => {}
            Err(e) => {
                // A reward for a group that ended meanwhile (aborted as surplus) is refused by
                // the core; anything else is a simulator bug.
                let ended = sched
                    .group(id.group)
                    .is_some_and(|info| info.state.is_final());
                ensure!(ended, "{id}: reward refused for a live group: {e}");
            }
        }
        Ok(())
    }
}
