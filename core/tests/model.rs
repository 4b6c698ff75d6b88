//! State-machine test: random plans and event sequences (invalid ones included) drive the real
//! scheduler and a small reference model written here with plain `Vec`s and linear scans. After
//! every event the two must agree on the result (the exact error value or completion variant),
//! every group's state, every request's state, the waiting queue and the counters, and these
//! invariants must hold: no group lost or dispatched twice; only complete trainable groups
//! dispatched; dispatch order equals materialization order; one policy version per step; slots in
//! use never exceed capacity; under `Frontier`, no non-frontier request admitted while a frontier
//! request waits; conservation.
//!
//! Liveness: after the random events, a driver that only answers the core's `poll_*` decisions
//! (and finishes what it was given, as an engine eventually does) must bring the step to `Done`
//! within a bound. Storage is tight (GCAP x RCAP below what many generated plans need), so
//! capacity refusals are reached. Cases: `PROPTEST_CASES` (default 256; CI sets 10,000 in
//! scripts/ci.d/core.sh). Failing cases are persisted in
//! `core/tests/model.proptest-regressions` (committed) and replayed first on every run.

use proptest::prelude::*;
use rolloutpipe_core::*;

const GCAP: usize = 12;
const RCAP: usize = 32;

type R = RequestState;

#[derive(Clone, Debug)]
struct MGroup {
    state: GroupState,
    /// (state, attempt) per sample.
    reqs: Vec<(R, u8)>,
    rewards: Vec<f32>,
}

/// The reference model: the same protocol, written for clarity instead of speed.
#[derive(Clone, Debug, Default)]
struct Model {
    plan: Option<Plan>,
    step: u64,
    active: bool,
    done: bool,
    groups: Vec<MGroup>,
    queue: Vec<(u32, u16)>,
    aborts: Vec<(u32, u16)>,
    ready: Vec<u32>,
    materialized: Vec<u32>,
    dispatched: Vec<u32>,
    slots: u32,
    /// Request records in use: every drawn group's samples. The core's storage may hold holes
    /// left by relocated groups, but compacts them away before it would refuse an extension.
    req_used: u32,
    released: u32,
    /// Lengths of the released micro-batches, in order.
    mb_lens: Vec<u32>,
    mb_released: u32,
    mb_consumed: u32,
    since_opt: u32,
    opt_done: u32,
    opt_announced: bool,
    is_final: bool,
    exhausted: bool,
    outstanding: u32,
    /// Scored groups awaiting an allocation decision, oldest first.
    held: Vec<u32>,
    samples: u64,
}

/// The core's SplitMix64, re-stated: the shuffled submission order is defined by it.
fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Model {
    fn plan(&self) -> Plan {
        self.plan.expect("model has a plan")
    }
    fn count(&self, f: impl Fn(GroupState) -> bool) -> u32 {
        self.groups.iter().filter(|g| f(g.state)).count() as u32
    }
    fn filled(&self) -> u32 {
        self.count(|s| s.is_trainable())
    }
    /// A group's size in the plan's micro-batch unit (the model knows groups and samples).
    fn units(&self, g: u32) -> u64 {
        match self.plan().micro_batch_unit {
            MicroBatchUnit::Groups => 1,
            MicroBatchUnit::Samples => self.groups[g as usize].reqs.len() as u64,
            other => unreachable!("the model does not know {other:?}"),
        }
    }
    /// Whether a micro-batch of `acc` units ending at the `end`-th group of the batch is cut.
    fn cut(&self, acc: u64, end: usize) -> bool {
        let p = self.plan();
        acc >= p.micro_batch as u64 || (end as u32).is_multiple_of(p.batch_groups / p.opt_steps)
    }
    fn trained(&self) -> u32 {
        self.count(|s| s == GroupState::Trained)
    }
    fn incomplete(&self) -> Vec<u32> {
        (0..self.groups.len() as u32)
            .filter(|&g| self.groups[g as usize].state.is_incomplete())
            .collect()
    }

    /// Prompts the sample budget still allows.
    fn budget_prompts(&self) -> u32 {
        let p = self.plan();
        if p.sample_budget == 0 {
            return u32::MAX;
        }
        ((p.sample_budget as u64).saturating_sub(self.samples) / p.group_size as u64) as u32
    }

    fn draws_closed(&self) -> bool {
        self.is_final
            || self.exhausted
            || self.groups.len() as u32 >= self.plan().max_groups
            || self.budget_prompts() == 0
    }

    fn begin(&mut self, step: u64, plan: Plan) -> Result<(), BeginError> {
        if self.active {
            return Err(BeginError::StepInProgress {
                step: StepId(self.step),
            });
        }
        if self.plan.is_some() && step <= self.step {
            return Err(BeginError::StaleStep {
                last: StepId(self.step),
                given: StepId(step),
            });
        }
        plan.validate().map_err(BeginError::Plan)?;
        if plan.max_groups as usize > GCAP {
            return Err(BeginError::Plan(PlanError::GroupCapacity {
                needed: plan.max_groups,
                capacity: GCAP as u32,
            }));
        }
        let needed = plan.max_groups as u64 * plan.group_size as u64;
        if needed > RCAP as u64 {
            return Err(BeginError::Plan(PlanError::RequestCapacity {
                needed,
                capacity: RCAP as u32,
            }));
        }
        *self = Model {
            plan: Some(plan),
            step,
            active: true,
            ..Model::default()
        };
        Ok(())
    }

    fn draw(&mut self, n: u32) -> Result<GroupId, DrawError> {
        let g = self.plan.map_or(1, |p| p.group_size);
        self.draw_with(n, g)
    }

    fn draw_with(&mut self, n: u32, samples: u16) -> Result<GroupId, DrawError> {
        if !self.active {
            return Err(DrawError::NoActiveStep);
        }
        let p = self.plan();
        let drawn = self.groups.len() as u32;
        if self.is_final || self.exhausted {
            return Err(DrawError::DrawsClosed);
        }
        if n == 0 {
            return Err(DrawError::ZeroCount);
        }
        if drawn + n > p.max_groups {
            return Err(DrawError::MaxGroups {
                drawn,
                requested: n,
                max_groups: p.max_groups,
            });
        }
        let g_size = samples as u32;
        if drawn as usize + n as usize > GCAP {
            return Err(DrawError::GroupsFull { requested: n });
        }
        if samples == 0 {
            return Err(DrawError::ZeroSamples);
        }
        if samples > p.group_size {
            return Err(DrawError::SamplesAboveGroupSize {
                samples,
                group_size: p.group_size,
            });
        }
        if p.sample_budget != 0 && self.samples + n as u64 * samples as u64 > p.sample_budget as u64
        {
            return Err(DrawError::SampleBudget { requested: n });
        }
        if (self.req_used + n * g_size) as usize > RCAP {
            return Err(DrawError::RequestsFull { requested: n });
        }
        for _ in 0..n {
            self.groups.push(MGroup {
                state: GroupState::Queued,
                reqs: vec![(R::Pending, 0); g_size as usize],
                rewards: vec![f32::NAN; g_size as usize],
            });
        }
        self.req_used += n * g_size;
        let total = n * g_size;
        self.samples += total as u64;
        let at = |k: u32| (drawn + k / g_size, (k % g_size) as u16);
        match p.admission.submit_order() {
            SubmitOrder::GroupMajor => self.queue.extend((0..total).map(at)),
            SubmitOrder::Interleaved => {
                for s in 0..g_size {
                    for i in 0..n {
                        self.queue.push((drawn + i, s as u16));
                    }
                }
            }
            SubmitOrder::Shuffled { seed } => {
                // A Fisher-Yates permutation of the batch's requests in group-major order.
                let mut x =
                    seed ^ self.step.wrapping_mul(0xA076_1D64_78BD_642F) ^ ((drawn as u64) << 32);
                let mut perm: Vec<u32> = (0..total).collect();
                for k in (1..total).rev() {
                    let j = ((splitmix(&mut x) as u128 * (k + 1) as u128) >> 64) as usize;
                    perm.swap(k as usize, j);
                }
                self.queue.extend(perm.into_iter().map(at));
            }
            other => unreachable!("the model does not know {other:?}"),
        }
        self.outstanding = self.outstanding.saturating_sub(n);
        Ok(GroupId(drawn))
    }

    fn poll_draw(&mut self) -> Option<u32> {
        let p = self.plan?;
        if !self.active || self.is_final || self.exhausted {
            return None;
        }
        let have = self.filled() + self.incomplete().len() as u32 + self.outstanding;
        if have >= p.batch_groups + p.draw_ahead {
            return None;
        }
        let room = p
            .max_groups
            .saturating_sub(self.groups.len() as u32)
            .saturating_sub(self.outstanding);
        let budget = self.budget_prompts().saturating_sub(self.outstanding);
        let n = p.draw_batch.min(room).min(budget);
        if n == 0 {
            return None;
        }
        self.outstanding += n;
        Some(n)
    }

    fn frontier(&self) -> Vec<u32> {
        let p = self.plan();
        let (width, ppm) = match p.admission {
            AdmissionPolicy::Frontier {
                width,
                expected_filter_ppm,
                ..
            } => (width, expected_filter_ppm),
            _ => (0, 0),
        };
        let filled = self.filled();
        if self.is_final || filled >= p.batch_groups {
            return Vec::new();
        }
        let remaining = p.batch_groups - filled;
        let need = match p.dispatch {
            DispatchPolicy::Pipelined => {
                // Replay the micro-batch cuts over the filled groups (materialization order is
                // dispatch order) for the open micro-batch's units; a group still to come counts
                // its initial G samples.
                let mut acc = 0;
                for (i, &g) in self.materialized.iter().enumerate() {
                    acc += self.units(g);
                    if self.cut(acc, i + 1) {
                        acc = 0;
                    }
                }
                let per_opt = p.batch_groups / p.opt_steps;
                let lacking = (p.micro_batch as u64).saturating_sub(acc).max(1);
                let per_group = match p.micro_batch_unit {
                    MicroBatchUnit::Samples => p.group_size as u64,
                    _ => 1,
                };
                (lacking.div_ceil(per_group) as u32)
                    .min(per_opt - filled % per_opt)
                    .min(remaining)
            }
            DispatchPolicy::Sync => remaining,
            other => unreachable!("the model does not know {other:?}"),
        } as u64;
        let n = (need * 1_000_000).div_ceil(1_000_000 - ppm as u64) as usize + width as usize;
        self.incomplete().into_iter().take(n).collect()
    }

    fn admit(&mut self) -> Option<(u32, u16)> {
        let p = self.plan?;
        if !self.active || self.slots >= p.slots || self.queue.is_empty() {
            return None;
        }
        let pending = |m: &Model, g: u32| {
            m.groups[g as usize]
                .reqs
                .iter()
                .position(|r| r.0 == R::Pending)
        };
        let choice = match p.admission {
            AdmissionPolicy::Fifo { .. } => self.queue[0],
            AdmissionPolicy::Frontier { .. } => self
                .frontier()
                .into_iter()
                .find_map(|g| pending(self, g).map(|s| (g, s as u16)))
                .unwrap_or(self.queue[0]),
            other => unreachable!("the model does not know {other:?}"),
        };
        self.queue.retain(|&x| x != choice);
        let g = &mut self.groups[choice.0 as usize];
        g.reqs[choice.1 as usize].0 = R::InFlight;
        if g.state == GroupState::Queued {
            g.state = GroupState::Generating;
        }
        self.slots += 1;
        Some(choice)
    }

    /// Validates an id like the core does (same checks, same order).
    fn lookup(&self, id: RequestId) -> Result<(u32, u16), RequestError> {
        if self.plan.is_none() {
            return Err(RequestError::NoActiveStep);
        }
        if id.step.0 != self.step {
            return Err(RequestError::OtherStep {
                current: StepId(self.step),
                given: id.step,
            });
        }
        let g = self
            .groups
            .get(id.group.0 as usize)
            .ok_or(RequestError::UnknownGroup { group: id.group })?;
        let r = g
            .reqs
            .get(id.sample as usize)
            .ok_or(RequestError::UnknownSample {
                group: id.group,
                sample: id.sample,
                target: g.reqs.len() as u16,
            })?;
        if r.1 != id.attempt {
            return Err(RequestError::StaleAttempt {
                current: r.1,
                given: id.attempt,
            });
        }
        Ok((id.group.0, id.sample))
    }

    fn version(&self, v: u64) -> Result<(), RequestError> {
        if v == self.step {
            Ok(())
        } else {
            Err(RequestError::WrongVersion {
                expected: PolicyVersion(self.step),
                given: PolicyVersion(v),
            })
        }
    }

    fn end(&mut self, g: u32, state: GroupState) {
        for s in 0..self.groups[g as usize].reqs.len() {
            let r = &mut self.groups[g as usize].reqs[s];
            match r.0 {
                R::Pending => {
                    r.0 = R::Cancelled;
                    self.queue.retain(|&x| x != (g, s as u16));
                }
                R::InFlight => {
                    r.0 = R::AbortPending;
                    self.aborts.push((g, s as u16));
                }
                R::Generated => r.0 = R::Dropped,
                _ => {}
            }
        }
        self.held.retain(|&h| h != g);
        self.groups[g as usize].state = state;
        if state == GroupState::Trainable {
            self.ready.push(g);
            self.materialized.push(g);
            if self.filled() >= self.plan().batch_groups {
                self.make_final();
            }
        }
    }

    fn make_final(&mut self) {
        self.is_final = true;
        self.outstanding = 0;
        for g in self.incomplete() {
            self.end(g, GroupState::Aborted);
        }
    }

    fn after(&mut self) {
        if !self.active {
            return;
        }
        if !self.is_final && self.incomplete().is_empty() && self.draws_closed() {
            self.make_final();
        }
        if self.is_final && self.trained() == self.filled() && !self.opt_due() && self.slots == 0 {
            self.active = false;
            self.done = true;
        }
    }

    fn opt_due(&self) -> bool {
        let p = self.plan();
        self.since_opt > 0
            && (self.since_opt >= p.batch_groups / p.opt_steps
                || (self.is_final && self.trained() == self.filled()))
    }

    fn generated(&mut self, (g, s): (u32, u16)) {
        self.slots -= 1;
        let grp = &mut self.groups[g as usize];
        grp.reqs[s as usize].0 = R::Generated;
        if grp
            .reqs
            .iter()
            .all(|r| matches!(r.0, R::Generated | R::Rewarded))
        {
            grp.state = GroupState::Materializing;
        }
    }

    fn reward(&mut self, (g, s): (u32, u16), x: f32) {
        let grp = &mut self.groups[g as usize];
        grp.reqs[s as usize].0 = R::Rewarded;
        grp.rewards[s as usize] = x;
        if !x.is_finite() {
            self.end(g, GroupState::Filtered(FilterReason::NonFiniteReward));
        } else if grp.reqs.iter().all(|r| r.0 == R::Rewarded) {
            if self.plan().hold_scored {
                self.held.push(g);
            } else {
                self.commit(g);
            }
        }
    }

    fn commit(&mut self, g: u32) {
        let grp = &self.groups[g as usize];
        {
            let n = grp.rewards.len() as f64;
            let mean = grp.rewards.iter().map(|&r| r as f64).sum::<f64>() / n;
            let var = grp
                .rewards
                .iter()
                .map(|&r| (r as f64 - mean).powi(2))
                .sum::<f64>()
                / n;
            let st = if var <= 1e-12 {
                GroupState::Filtered(FilterReason::ZeroVariance)
            } else {
                GroupState::Trainable
            };
            self.end(g, st);
        }
    }

    /// A request being aborted stopped (acked, failed or finished), ending in `then`.
    fn stop_aborting(&mut self, (g, s): (u32, u16), then: R) {
        self.groups[g as usize].reqs[s as usize].0 = then;
        self.aborts.retain(|&x| x != (g, s));
        self.slots -= 1;
        self.after();
    }

    fn state_of(&self, gs: (u32, u16)) -> R {
        self.groups[gs.0 as usize].reqs[gs.1 as usize].0
    }

    fn finish(
        &mut self,
        id: RequestId,
        v: u64,
        split: bool,
        x: f32,
    ) -> Result<Completion, RequestError> {
        let gs = self.lookup(id)?;
        self.version(v)?;
        match self.state_of(gs) {
            R::InFlight => {
                self.generated(gs);
                if !split {
                    self.reward(gs, x);
                }
                self.after();
                Ok(Completion::Accepted {
                    group_state: self.groups[gs.0 as usize].state,
                })
            }
            R::AbortPending | R::AbortSent => {
                self.stop_aborting(gs, if split { R::Dropped } else { R::Cancelled });
                Ok(Completion::Discarded)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    fn on_reward(&mut self, id: RequestId, x: f32) -> Result<Completion, RequestError> {
        let gs = self.lookup(id)?;
        match self.state_of(gs) {
            R::Generated => {
                self.reward(gs, x);
                self.after();
                Ok(Completion::Accepted {
                    group_state: self.groups[gs.0 as usize].state,
                })
            }
            R::Dropped => {
                self.groups[gs.0 as usize].reqs[gs.1 as usize].0 = R::Cancelled;
                Ok(Completion::Discarded)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    fn fail(&mut self, id: RequestId, v: u64) -> Result<Failure, RequestError> {
        let gs = self.lookup(id)?;
        self.version(v)?;
        match self.state_of(gs) {
            R::InFlight => {
                self.slots -= 1;
                let max = self.plan().max_attempts;
                let r = &mut self.groups[gs.0 as usize].reqs[gs.1 as usize];
                let out = if r.1 as u32 + 1 >= max as u32 {
                    r.0 = R::Cancelled;
                    self.end(gs.0, GroupState::Filtered(FilterReason::AttemptsExhausted));
                    Failure::GroupFiltered
                } else {
                    *r = (R::Pending, r.1 + 1);
                    self.queue.push(gs);
                    Failure::Retried { attempt: r.1 }
                };
                self.after();
                Ok(out)
            }
            R::AbortPending | R::AbortSent => {
                self.stop_aborting(gs, R::Cancelled);
                Ok(Failure::AbortAcked)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// Refused admission, preemption or migration: back to the front, same attempt.
    fn requeue(&mut self, id: RequestId) -> Result<Failure, RequestError> {
        let gs = self.lookup(id)?;
        match self.state_of(gs) {
            R::InFlight => {
                self.slots -= 1;
                let r = &mut self.groups[gs.0 as usize].reqs[gs.1 as usize];
                r.0 = R::Pending;
                let attempt = r.1;
                self.queue.insert(0, gs);
                self.after();
                Ok(Failure::Retried { attempt })
            }
            R::AbortPending | R::AbortSent => {
                self.stop_aborting(gs, R::Cancelled);
                Ok(Failure::AbortAcked)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    fn ack(&mut self, id: RequestId) -> Result<(), RequestError> {
        let gs = self.lookup(id)?;
        match self.state_of(gs) {
            R::AbortPending | R::AbortSent => {
                self.stop_aborting(gs, R::Cancelled);
                Ok(())
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    fn poll_abort(&mut self) -> Option<(u32, u16)> {
        if self.aborts.is_empty() {
            return None;
        }
        let (g, s) = self.aborts.remove(0);
        self.groups[g as usize].reqs[s as usize].0 = R::AbortSent;
        Some((g, s))
    }

    fn dispatch(&mut self) -> Option<u32> {
        if !self.active || self.ready.is_empty() {
            return None;
        }
        if self.plan().dispatch == DispatchPolicy::Sync && !self.is_final {
            return None;
        }
        let g = self.ready.remove(0);
        assert_eq!(
            self.groups[g as usize].state,
            GroupState::Trainable,
            "only complete trainable groups are dispatched"
        );
        self.groups[g as usize].state = GroupState::Dispatched;
        self.dispatched.push(g);
        Some(g)
    }

    fn micro_batch(&mut self) -> Option<(u32, u32)> {
        if !self.active {
            return None;
        }
        let avail = self.dispatched.len() as u32 - self.released;
        let mut acc = 0;
        let mut cut = None;
        for i in self.released as usize..self.dispatched.len() {
            acc += self.units(self.dispatched[i]);
            if self.cut(acc, i + 1) {
                cut = Some(i as u32 + 1 - self.released);
                break;
            }
        }
        let len = if let Some(len) = cut {
            len
        } else if self.is_final && avail > 0 && self.count(|s| s == GroupState::Trainable) == 0 {
            avail
        } else {
            return None;
        };
        self.mb_lens.push(len);
        let first = self.released;
        self.released += len;
        self.mb_released += 1;
        Some((first, len))
    }

    fn consume(&mut self) -> Result<(u32, u32), TrainError> {
        if !self.active {
            return Err(TrainError::NoActiveStep);
        }
        if self.opt_due() {
            return Err(TrainError::OptimizerStepPending);
        }
        if self.mb_consumed == self.mb_released {
            return Err(TrainError::NoMicroBatchReleased);
        }
        let first: u32 = self.mb_lens[..self.mb_consumed as usize].iter().sum();
        let len = self.mb_lens[self.mb_consumed as usize];
        for seq in first..first + len {
            let g = self.dispatched[seq as usize];
            self.groups[g as usize].state = GroupState::Trained;
        }
        self.mb_consumed += 1;
        self.since_opt += len;
        self.after();
        Ok((first, len))
    }

    fn poll_opt(&mut self) -> Option<u32> {
        if !self.active || self.opt_announced || !self.opt_due() {
            return None;
        }
        self.opt_announced = true;
        Some(self.opt_done)
    }

    fn opt_done(&mut self) -> Result<(), TrainError> {
        if !self.active {
            return Err(TrainError::NoActiveStep);
        }
        if !self.opt_due() {
            return Err(TrainError::NoOptimizerStepDue);
        }
        self.since_opt = 0;
        self.opt_done += 1;
        self.opt_announced = false;
        self.after();
        Ok(())
    }

    fn exhaust(&mut self) -> Result<(), DrawError> {
        if !self.active {
            return Err(DrawError::NoActiveStep);
        }
        self.exhausted = true;
        self.outstanding = 0;
        self.after();
        Ok(())
    }

    fn set_slots(&mut self, n: u32) -> Result<(), SlotsError> {
        if !self.active {
            return Err(SlotsError::NoActiveStep);
        }
        if n == 0 {
            return Err(SlotsError::ZeroSlots);
        }
        self.plan.as_mut().expect("active").slots = n;
        Ok(())
    }

    fn extend(&mut self, g: u32, extra: u16) -> Result<(), ExtendError> {
        if !self.active {
            return Err(ExtendError::NoActiveStep);
        }
        let req_used = self.req_used;
        let drawn = self.groups.len();
        let p = self.plan();
        let (is_final, exhausted, samples) = (self.is_final, self.exhausted, self.samples);
        let grp = self
            .groups
            .get_mut(g as usize)
            .ok_or(ExtendError::UnknownGroup { group: GroupId(g) })?;
        if !grp.state.is_incomplete() {
            return Err(ExtendError::NotExtendable { state: grp.state });
        }
        if extra == 0 {
            return Err(ExtendError::ZeroExtra);
        }
        if p.sample_budget != 0 && samples + extra as u64 > p.sample_budget as u64 {
            return Err(ExtendError::SampleBudget { extra });
        }
        let target = grp.reqs.len() as u32;
        // Storage for the prompts the step may still draw stays reserved.
        let closed = is_final
            || exhausted
            || drawn as u32 >= p.max_groups
            || (p.sample_budget != 0
                && (p.sample_budget as u64).saturating_sub(samples) < p.group_size as u64);
        let reserved = if closed {
            0
        } else {
            (p.max_groups as usize).saturating_sub(drawn) * p.group_size as usize
        };
        if (req_used + extra as u32) as usize + reserved > RCAP {
            return Err(ExtendError::RequestsFull { extra });
        }
        for _ in 0..extra {
            grp.reqs.push((R::Pending, 0));
            grp.rewards.push(f32::NAN);
        }
        if grp.state == GroupState::Materializing {
            grp.state = GroupState::Generating;
        }
        self.req_used += extra as u32;
        for s in target..target + extra as u32 {
            self.queue.push((g, s as u16));
        }
        self.samples += extra as u64;
        self.held.retain(|&h| h != g);
        Ok(())
    }

    /// The oldest held group, with `decision` applied (an extension that does not fit commits).
    fn allocate(&mut self, decision: Allocation) -> Option<Allocated> {
        if self.held.is_empty() {
            return None;
        }
        let g = self.held.remove(0);
        let applied = match decision {
            Allocation::Extend(n) if n > 0 && self.extend(g, n).is_ok() => decision,
            Allocation::Skip(r) => {
                self.end(g, GroupState::Filtered(FilterReason::Skipped(r)));
                decision
            }
            _ => {
                self.commit(g);
                Allocation::Commit
            }
        };
        self.after();
        Some(Allocated {
            group: GroupId(g),
            decided: decision,
            applied,
        })
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    PollDraw,
    Draw(u32),
    /// Draw with this many initial samples per prompt (may exceed G: refused).
    DrawWith(u32, u16),
    Admit,
    Finish(usize, f32),
    Generate(usize),
    Reward(usize, f32),
    Fail(usize),
    Refuse(usize),
    Preempt(usize),
    PollAbort,
    Ack(usize),
    Dispatch,
    MicroBatch,
    Consume,
    PollOpt,
    OptDone,
    Exhaust,
    Extend(u32, u16),
    SetSlots(u32),
    /// Decide the oldest held group: 0 commit, 1 extend by the count, 2 skip, 3 the
    /// statistics-driven `UpTo4` policy.
    Allocate(u8, u16),
    Replay(usize, u8),
    WrongVersion(usize),
    NextStep,
}

fn reward() -> impl Strategy<Value = f32> {
    prop_oneof![4 => Just(0.0f32), 4 => Just(1.0f32), 1 => Just(0.5f32), 1 => Just(f32::NAN)]
}

fn op() -> impl Strategy<Value = Op> {
    let k = 0usize..8;
    prop_oneof![
        4 => Just(Op::PollDraw),
        1 => (0u32..3).prop_map(Op::Draw),
        1 => (0u32..3, 0u16..6).prop_map(|(n, k)| Op::DrawWith(n, k)),
        8 => Just(Op::Admit),
        6 => (k.clone(), reward()).prop_map(|(k, r)| Op::Finish(k, r)),
        2 => k.clone().prop_map(Op::Generate),
        2 => (k.clone(), reward()).prop_map(|(k, r)| Op::Reward(k, r)),
        1 => k.clone().prop_map(Op::Fail),
        1 => k.clone().prop_map(Op::Refuse),
        1 => k.clone().prop_map(Op::Preempt),
        2 => Just(Op::PollAbort),
        2 => k.clone().prop_map(Op::Ack),
        3 => Just(Op::Dispatch),
        3 => Just(Op::MicroBatch),
        3 => Just(Op::Consume),
        2 => Just(Op::PollOpt),
        1 => Just(Op::OptDone),
        1 => Just(Op::Exhaust),
        1 => (0u32..10, 0u16..3).prop_map(|(g, e)| Op::Extend(g, e)),
        1 => (0u32..5).prop_map(Op::SetSlots),
        3 => (0u8..4, 0u16..3).prop_map(|(k, n)| Op::Allocate(k, n)),
        1 => (k.clone(), 0u8..6).prop_map(|(k, w)| Op::Replay(k, w)),
        1 => k.prop_map(Op::WrongVersion),
        1 => Just(Op::NextStep),
    ]
}

fn order() -> impl Strategy<Value = SubmitOrder> {
    prop_oneof![
        Just(SubmitOrder::GroupMajor),
        Just(SubmitOrder::Interleaved),
        any::<u64>().prop_map(|seed| SubmitOrder::Shuffled { seed }),
    ]
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        (1u32..=6, 1u16..=4, 0usize..4, 0usize..4, 1u32..=8, 1u8..=3),
        (0u32..=6, 1u32..=4, 0u32..=2, 0u8..3, order(), any::<bool>()),
        (
            any::<bool>(),
            prop_oneof![2 => Just(0u32), 1 => 1u32..=40],
            prop_oneof![2 => Just(0u32), 1 => 1u32..=12],
        ),
    )
        .prop_map(
            |(
                (b, g, oi, mi, slots, attempts),
                (extra, draw_batch, ahead, adm, order, sync),
                (hold, budget, samples_mb),
            )| {
                let mut p = Plan::new(b, g);
                let opts: Vec<u32> = (1..=b).filter(|d| b % d == 0).collect();
                p.opt_steps = opts[oi % opts.len()];
                let mbs: Vec<u32> = (1..=b / p.opt_steps)
                    .filter(|d| (b / p.opt_steps).is_multiple_of(*d))
                    .collect();
                p.micro_batch = mbs[mi % mbs.len()];
                if samples_mb > 0 {
                    // Micro-batches of at least this many samples, cut at group boundaries.
                    p.micro_batch_unit = MicroBatchUnit::Samples;
                    p.micro_batch = samples_mb;
                }
                p.slots = slots;
                p.max_attempts = attempts;
                p.max_groups = b + extra;
                p.draw_batch = draw_batch;
                p.draw_ahead = ahead;
                p.admission = match adm {
                    0 => AdmissionPolicy::Fifo { order },
                    1 => AdmissionPolicy::Frontier {
                        width: 0,
                        expected_filter_ppm: 0,
                        fallback: order,
                    },
                    _ => AdmissionPolicy::Frontier {
                        width: 1,
                        expected_filter_ppm: 250_000,
                        fallback: order,
                    },
                };
                p.dispatch = if sync {
                    DispatchPolicy::Sync
                } else {
                    DispatchPolicy::Pipelined
                };
                p.hold_scored = hold;
                p.sample_budget = budget;
                p
            },
        )
}

/// A policy that returns one fixed decision.
struct Decide(Allocation);

impl Allocate for Decide {
    fn decide(&self, _: &View<'_, '_>, _: GroupId) -> Allocation {
        self.0
    }
}

/// Extends a held group by one sample until it has four rewards (reads the view's statistics).
struct UpTo4;

impl Allocate for UpTo4 {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        match v.reward_stats(g) {
            Some(st) if st.count < 4 => Allocation::Extend(1),
            _ => Allocation::Commit,
        }
    }
}

fn pick(list: &mut Vec<RequestId>, k: usize) -> Option<RequestId> {
    (!list.is_empty()).then(|| list.remove(k % list.len()))
}

/// The test driver's record of the step: what it was handed and has not answered yet.
#[derive(Default)]
struct Track {
    in_flight: Vec<RequestId>,
    generated: Vec<RequestId>,
    aborts: Vec<RequestId>,
    history: Vec<RequestId>,
}

/// Applies one op to the scheduler and the model and compares the results exactly.
fn apply(
    s: &mut Scheduler<'_>,
    m: &mut Model,
    tr: &mut Track,
    step: &mut u64,
    plans: &mut impl Iterator<Item = Plan>,
    now: Tick,
    op: Op,
) -> Result<(), TestCaseError> {
    let v = PolicyVersion(*step);
    let st = *step;
    let rid = |(g, k): (u32, u16), m: &Model| RequestId {
        step: StepId(st),
        group: GroupId(g),
        sample: k,
        attempt: m.groups[g as usize].reqs[k as usize].1,
    };
    match op {
        Op::PollDraw => {
            let n = s.poll_draw(now);
            prop_assert_eq!(n, m.poll_draw());
            if let Some(n) = n {
                let r = s.on_prompts_drawn(now, n);
                prop_assert!(r.is_ok(), "a draw poll_draw asked for was refused: {:?}", r);
                prop_assert_eq!(r, m.draw(n));
            }
        }
        Op::Draw(n) => prop_assert_eq!(s.on_prompts_drawn(now, n), m.draw(n)),
        Op::DrawWith(n, k) => {
            prop_assert_eq!(s.on_prompts_drawn_with(now, n, k), m.draw_with(n, k))
        }
        Op::Admit => {
            let frontier = if m.active { m.frontier() } else { Vec::new() };
            let frontier_waits = m.active
                && matches!(m.plan().admission, AdmissionPolicy::Frontier { .. })
                && frontier
                    .iter()
                    .any(|&g| m.groups[g as usize].reqs.iter().any(|r| r.0 == R::Pending));
            let a = s.poll_admit(now);
            let expect = m.admit();
            prop_assert_eq!(a.map(|a| (a.request.group.0, a.request.sample)), expect);
            if let Some(a) = a {
                prop_assert_eq!(a.request, rid(expect.unwrap(), m));
                prop_assert_eq!(a.version, v, "one policy version per step");
                if frontier_waits {
                    prop_assert!(
                        frontier.contains(&a.request.group.0),
                        "non-frontier admitted while frontier waits"
                    );
                }
                tr.in_flight.push(a.request);
                tr.history.push(a.request);
            }
        }
        Op::Finish(k, x) => {
            if let Some(id) = pick(&mut tr.in_flight, k) {
                prop_assert_eq!(
                    s.on_request_finished(now, id, v, 1, x),
                    m.finish(id, st, false, x)
                );
            }
        }
        Op::Generate(k) => {
            if let Some(id) = pick(&mut tr.in_flight, k) {
                let r = s.on_request_generated(now, id, v, 1);
                prop_assert_eq!(r, m.finish(id, st, true, 0.0));
                if r.is_ok() {
                    // Accepted or discarded: a reward may follow either way.
                    tr.generated.push(id);
                }
            }
        }
        Op::Reward(k, x) => {
            if let Some(id) = pick(&mut tr.generated, k) {
                prop_assert_eq!(s.on_reward(now, id, x), m.on_reward(id, x));
            }
        }
        Op::Fail(k) => {
            if let Some(id) = pick(&mut tr.in_flight, k) {
                prop_assert_eq!(s.on_request_failed(now, id, v), m.fail(id, st));
            }
        }
        Op::Refuse(k) => {
            if let Some(id) = pick(&mut tr.in_flight, k) {
                prop_assert_eq!(s.on_admission_refused(now, id), m.requeue(id));
            }
        }
        Op::Preempt(k) => {
            if let Some(id) = pick(&mut tr.in_flight, k) {
                prop_assert_eq!(s.on_request_preempted(now, id), m.requeue(id));
            }
        }
        Op::PollAbort => {
            let got = s.poll_abort(now);
            let want = m.poll_abort().map(|gs| rid(gs, m));
            prop_assert_eq!(got, want);
            if let Some(r) = got {
                tr.aborts.push(r);
            }
        }
        Op::Ack(k) => {
            if let Some(id) = pick(&mut tr.aborts, k) {
                prop_assert_eq!(s.on_abort_acked(now, id), m.ack(id));
            }
        }
        Op::Dispatch => {
            let d = s.poll_dispatch(now);
            prop_assert_eq!(d.map(|d| d.group.0), m.dispatch());
            if let Some(d) = d {
                prop_assert_eq!(d.seq as usize + 1, m.dispatched.len());
            }
        }
        Op::MicroBatch => {
            prop_assert_eq!(
                s.poll_micro_batch(now).map(|b| (b.first_seq, b.len)),
                m.micro_batch()
            );
        }
        Op::Consume => {
            prop_assert_eq!(
                s.on_micro_batch_consumed(now).map(|b| (b.first_seq, b.len)),
                m.consume()
            );
        }
        Op::PollOpt => {
            prop_assert_eq!(s.poll_optimizer_step(now).map(|o| o.index), m.poll_opt());
        }
        Op::OptDone => prop_assert_eq!(s.on_optimizer_step_done(now), m.opt_done()),
        Op::Exhaust => prop_assert_eq!(s.on_data_exhausted(now), m.exhaust()),
        Op::Extend(g, e) => {
            prop_assert_eq!(s.extend_group(now, GroupId(g), e), m.extend(g, e));
        }
        Op::SetSlots(n) => prop_assert_eq!(s.set_slots(now, n), m.set_slots(n)),
        Op::Allocate(kind, n) => {
            let decision = match kind {
                0 => Allocation::Commit,
                1 => Allocation::Extend(n),
                2 => Allocation::Skip(if n % 2 == 0 {
                    SkipReason::TooEasy
                } else {
                    SkipReason::TooHard
                }),
                _ => match m.held.first() {
                    Some(&g) if m.groups[g as usize].reqs.len() < 4 => Allocation::Extend(1),
                    _ => Allocation::Commit,
                },
            };
            let got = if kind == 3 {
                s.poll_allocation_with(now, &UpTo4)
            } else {
                s.poll_allocation_with(now, &Decide(decision))
            };
            prop_assert_eq!(got, m.allocate(decision));
        }
        Op::Replay(k, which) => {
            if !tr.history.is_empty() {
                let id = tr.history[k % tr.history.len()];
                match which {
                    0 => prop_assert_eq!(
                        s.on_request_finished(now, id, v, 1, 1.0),
                        m.finish(id, st, false, 1.0)
                    ),
                    1 => prop_assert_eq!(s.on_request_failed(now, id, v), m.fail(id, st)),
                    2 => prop_assert_eq!(s.on_abort_acked(now, id), m.ack(id)),
                    3 => prop_assert_eq!(s.on_admission_refused(now, id), m.requeue(id)),
                    4 => prop_assert_eq!(
                        s.on_request_generated(now, id, v, 1),
                        m.finish(id, st, true, 0.0)
                    ),
                    _ => prop_assert_eq!(s.on_reward(now, id, 0.0), m.on_reward(id, 0.0)),
                }
            }
        }
        Op::WrongVersion(k) => {
            if !tr.in_flight.is_empty() {
                let id = tr.in_flight[k % tr.in_flight.len()];
                let before = *s.counters();
                let wrong = PolicyVersion(st + 1);
                let want = m.lookup(id).and_then(|_| m.version(st + 1));
                prop_assert_eq!(
                    s.on_request_finished(now, id, wrong, 1, 1.0),
                    want.map(|_| Completion::Discarded)
                );
                prop_assert_eq!(before, *s.counters());
            }
        }
        Op::NextStep => {
            let p = plans.next().expect("cycled");
            let r = s.begin_step(now, StepId(st + 1), PolicyVersion(st + 1), p);
            prop_assert_eq!(r, m.begin(st + 1, p));
            if r.is_ok() {
                *step += 1;
                *tr = Track::default();
            }
        }
    }
    check(s, m)
}

/// Answers the core's decisions until the step is done: draw what `poll_draw` asks, admit, finish
/// every running request (rewards alternate within a group, so groups can become trainable),
/// reward every generated one, ack every abort, dispatch, train and apply optimizer steps. Every
/// event still goes through `apply`, so the model keeps being compared.
fn drive_to_done(
    s: &mut Scheduler<'_>,
    m: &mut Model,
    tr: &mut Track,
    step: &mut u64,
    plans: &mut impl Iterator<Item = Plan>,
    mut t: u64,
) -> Result<u32, TestCaseError> {
    // Each round ends at least one group or frees the slots it filled, so a step needs at most
    // a few rounds per group the plan can draw.
    let bound = 4 * (GCAP as u32 + 2);
    // The random events may have dropped ids from the driver's lists (an op picks an id even when
    // the event is refused). The environment still holds everything it was handed, which is what
    // the model records: rebuild the lists from it.
    let st = *step;
    let handed = |want: &[R]| -> Vec<RequestId> {
        let mut v = Vec::new();
        for (g, grp) in m.groups.iter().enumerate() {
            for (k, r) in grp.reqs.iter().enumerate() {
                if want.contains(&r.0) {
                    v.push(RequestId {
                        step: StepId(st),
                        group: GroupId(g as u32),
                        sample: k as u16,
                        attempt: r.1,
                    });
                }
            }
        }
        v
    };
    tr.in_flight = handed(&[R::InFlight, R::AbortSent]);
    tr.generated = handed(&[R::Generated, R::Dropped]);
    tr.aborts.clear();
    for round in 0..bound {
        if s.phase() != StepPhase::Active {
            return Ok(round);
        }
        macro_rules! run {
            ($op:expr, $t:expr) => {{
                *$t += 1;
                apply(s, m, tr, step, plans, Tick(*$t), $op)
            }};
        }
        run!(Op::PollDraw, &mut t)?;
        while !m.held.is_empty() {
            run!(Op::Allocate(3, 0), &mut t)?;
        }
        for _ in 0..RCAP {
            run!(Op::Admit, &mut t)?;
        }
        while !tr.generated.is_empty() {
            let id = tr.generated[0];
            run!(Op::Reward(0, (id.sample % 2) as f32), &mut t)?;
        }
        while let Some(&id) = tr.in_flight.first() {
            run!(
                Op::Finish(0, ((id.sample + id.group.0 as u16) % 2) as f32),
                &mut t
            )?;
        }
        loop {
            let before = tr.aborts.len();
            run!(Op::PollAbort, &mut t)?;
            if tr.aborts.len() == before {
                break;
            }
        }
        while !tr.aborts.is_empty() {
            run!(Op::Ack(0), &mut t)?;
        }
        for _ in 0..GCAP {
            run!(Op::Dispatch, &mut t)?;
        }
        // The trainer: an optimizer step handed out (now or by a random event) is applied
        // first; micro-batches handed out and not yet trained are trained before new ones.
        for _ in 0..2 * GCAP + 2 {
            run!(Op::PollOpt, &mut t)?;
            if m.opt_announced {
                run!(Op::OptDone, &mut t)?;
            }
            if m.mb_consumed == m.mb_released {
                run!(Op::MicroBatch, &mut t)?;
                if m.mb_consumed == m.mb_released {
                    break;
                }
            }
            run!(Op::Consume, &mut t)?;
        }
    }
    prop_assert_eq!(
        s.phase(),
        StepPhase::Done,
        "step not done after {} rounds of answering every decision: {:?}",
        bound,
        s.counters()
    );
    Ok(bound)
}

fn run_case(plans: Vec<Plan>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut gs = vec![GroupSlot::EMPTY; GCAP];
    let mut rs = vec![RequestSlot::EMPTY; RCAP];
    let mut s = Scheduler::new(&mut gs, &mut rs);
    let mut m = Model::default();
    let mut plans = plans.into_iter().cycle();
    let mut step = 0u64;
    // The first plan the storage accepts begins step 0 (refusals are compared on the way).
    let mut began = false;
    for _ in 0..4 {
        let p = plans.next().expect("at least one plan");
        let r = s.begin_step(Tick(0), StepId(step), PolicyVersion(step), p);
        prop_assert_eq!(r, m.begin(step, p));
        if r.is_ok() {
            began = true;
            break;
        }
    }
    if !began {
        return Ok(());
    }
    let mut tr = Track::default();
    let n = ops.len() as u64;
    for (t, op) in ops.into_iter().enumerate() {
        apply(
            &mut s,
            &mut m,
            &mut tr,
            &mut step,
            &mut plans,
            Tick(t as u64),
            op,
        )?;
    }
    // Liveness: whatever state the random events left, answering the decisions ends the step.
    // A failed begin_step leaves the earlier step in place; that one must end too.
    drive_to_done(&mut s, &mut m, &mut tr, &mut step, &mut plans, n)?;
    Ok(())
}

fn check(s: &Scheduler<'_>, m: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(s.audit(), Ok(()));
    let c = s.counters();
    prop_assert!(c.is_conserved(), "conservation");
    prop_assert_eq!(c.drawn as usize, m.groups.len(), "no group lost");
    for (g, mg) in m.groups.iter().enumerate() {
        let id = GroupId(g as u32);
        prop_assert_eq!(
            s.view().group_state(id),
            Some(mg.state),
            "group {} state",
            g
        );
        for (k, r) in mg.reqs.iter().enumerate() {
            prop_assert_eq!(s.request_state(id, k as u16), Some(*r), "g{}/s{}", g, k);
        }
    }
    let q: Vec<(u32, u16)> = s.view().queue().map(|r| (r.group.0, r.sample)).collect();
    prop_assert_eq!(q, m.queue.clone(), "waiting queue");
    prop_assert_eq!(s.slots_in_use(), m.slots);
    prop_assert_eq!(s.optimizer_step_due(), m.active && m.opt_due());
    prop_assert_eq!(s.phase() == StepPhase::Done, m.done, "step done");
    prop_assert!(
        m.materialized.starts_with(&m.dispatched),
        "dispatch order is materialization order"
    );
    let mut seen = m.dispatched.clone();
    seen.sort_unstable();
    seen.dedup();
    prop_assert_eq!(seen.len(), m.dispatched.len(), "no group dispatched twice");
    for (seq, &g) in m.dispatched.iter().enumerate() {
        prop_assert_eq!(s.dispatched_group(seq as u32), Some(GroupId(g)));
    }
    Ok(())
}

fn config() -> ProptestConfig {
    // `cargo test` stays fast at the default; CI raises PROPTEST_CASES (scripts/ci.d/core.sh).
    // Miri runs a couple of cases so the whole suite stays within minutes.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases: if cfg!(miri) { 2 } else { cases },
        // Persisted next to this file (tests/model.proptest-regressions) and replayed first.
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn scheduler_matches_the_reference_model_and_every_step_ends(
        plans in prop::collection::vec(plan(), 1..4),
        ops in prop::collection::vec(op(), 0..if cfg!(miri) { 25 } else { 300 }),
    ) {
        run_case(plans, ops)?;
    }
}
