//! State-machine test: random plans and event sequences (invalid ones included) drive the real
//! scheduler and a small reference model written here with plain `Vec`s and linear scans. After
//! every event the two must agree on the result, every group's state, the waiting queue and the
//! counters, and these invariants must hold: no group lost or dispatched twice; only complete
//! trainable groups dispatched; dispatch order equals materialization order; one policy version
//! per step; slots in use never exceed capacity; under `Frontier`, no non-frontier request
//! admitted while a frontier request waits; conservation.

use proptest::prelude::*;
use rolloutpipe_core::*;

const GCAP: usize = 16;
const RCAP: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq)]
enum MR {
    Pending,
    InFlight,
    Generated,
    Rewarded,
    /// Being aborted (`polled` once handed out by `poll_abort`).
    Aborting,
    Cancelled,
}

#[derive(Clone, Debug)]
struct MGroup {
    state: GroupState,
    reqs: Vec<(MR, u8)>,
    rewards: Vec<f32>,
    first: u32,
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
    req_used: u32,
    released: u32,
    mb_released: u32,
    mb_consumed: u32,
    since_opt: u32,
    is_final: bool,
    exhausted: bool,
    outstanding: u32,
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
    fn trained(&self) -> u32 {
        self.count(|s| s == GroupState::Trained)
    }
    fn incomplete(&self) -> Vec<u32> {
        (0..self.groups.len() as u32)
            .filter(|&g| self.groups[g as usize].state.is_incomplete())
            .collect()
    }

    fn begin(&mut self, step: u64, plan: Plan) -> bool {
        if self.active {
            return false;
        }
        if self.plan.is_some() && step <= self.step {
            return false;
        }
        if plan.validate().is_err()
            || plan.max_groups as usize > GCAP
            || plan.batch_groups as usize * plan.group_size as usize > RCAP
        {
            return false;
        }
        *self = Model {
            plan: Some(plan),
            step,
            active: true,
            ..Model::default()
        };
        true
    }

    fn draw(&mut self, n: u32) -> Result<u32, ()> {
        let p = self.plan.ok_or(())?;
        let drawn = self.groups.len() as u32;
        if !self.active || self.is_final || self.exhausted || n == 0 || drawn + n > p.max_groups {
            return Err(());
        }
        let g_size = p.group_size as u32;
        if drawn as usize + n as usize > GCAP || (self.req_used + n * g_size) as usize > RCAP {
            return Err(());
        }
        for i in 0..n {
            self.groups.push(MGroup {
                state: GroupState::Queued,
                reqs: vec![(MR::Pending, 0); g_size as usize],
                rewards: vec![f32::NAN; g_size as usize],
                first: self.req_used + i * g_size,
            });
        }
        self.req_used += n * g_size;
        match p.admission.submit_order() {
            SubmitOrder::Interleaved => {
                for s in 0..g_size {
                    for i in 0..n {
                        self.queue.push((drawn + i, s as u16));
                    }
                }
            }
            _ => {
                for i in 0..n {
                    for s in 0..g_size {
                        self.queue.push((drawn + i, s as u16));
                    }
                }
            }
        }
        self.outstanding = self.outstanding.saturating_sub(n);
        Ok(drawn)
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
        let n = p.draw_batch.min(room);
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
            DispatchPolicy::Pipelined => (p.micro_batch - filled % p.micro_batch).min(remaining),
            DispatchPolicy::Sync => remaining,
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
                .position(|r| r.0 == MR::Pending)
        };
        let choice = match p.admission {
            AdmissionPolicy::Fifo { .. } => self.queue[0],
            AdmissionPolicy::Frontier { .. } => self
                .frontier()
                .into_iter()
                .find_map(|g| pending(self, g).map(|s| (g, s as u16)))
                .unwrap_or(self.queue[0]),
        };
        self.queue.retain(|&x| x != choice);
        let g = &mut self.groups[choice.0 as usize];
        g.reqs[choice.1 as usize].0 = MR::InFlight;
        if g.state == GroupState::Queued {
            g.state = GroupState::Generating;
        }
        self.slots += 1;
        Some(choice)
    }

    /// Validates an id like the core does (same error order).
    fn lookup(&self, id: RequestId) -> Result<(u32, u16), ()> {
        if self.plan.is_none() || id.step.0 != self.step {
            return Err(());
        }
        let g = self.groups.get(id.group.0 as usize).ok_or(())?;
        let r = g.reqs.get(id.sample as usize).ok_or(())?;
        if r.1 != id.attempt {
            return Err(());
        }
        Ok((id.group.0, id.sample))
    }

    fn end(&mut self, g: u32, state: GroupState) {
        for s in 0..self.groups[g as usize].reqs.len() {
            let r = &mut self.groups[g as usize].reqs[s];
            match r.0 {
                MR::Pending => {
                    r.0 = MR::Cancelled;
                    self.queue.retain(|&x| x != (g, s as u16));
                }
                MR::InFlight => {
                    r.0 = MR::Aborting;
                    self.aborts.push((g, s as u16));
                }
                MR::Generated => r.0 = MR::Cancelled,
                _ => {}
            }
        }
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
        let p = self.plan();
        if !self.active {
            return;
        }
        if !self.is_final
            && self.incomplete().is_empty()
            && (self.exhausted || self.groups.len() as u32 >= p.max_groups)
        {
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
        grp.reqs[s as usize].0 = MR::Generated;
        if grp
            .reqs
            .iter()
            .all(|r| matches!(r.0, MR::Generated | MR::Rewarded))
        {
            grp.state = GroupState::Materializing;
        }
    }

    fn reward(&mut self, (g, s): (u32, u16), x: f32) {
        let grp = &mut self.groups[g as usize];
        grp.reqs[s as usize].0 = MR::Rewarded;
        grp.rewards[s as usize] = x;
        if !x.is_finite() {
            self.end(g, GroupState::Filtered(FilterReason::NonFiniteReward));
        } else if grp.reqs.iter().all(|r| r.0 == MR::Rewarded) {
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

    /// A request being aborted stopped (acked, failed or finished).
    fn stop_aborting(&mut self, (g, s): (u32, u16)) {
        self.groups[g as usize].reqs[s as usize].0 = MR::Cancelled;
        self.aborts.retain(|&x| x != (g, s));
        self.slots -= 1;
        self.after();
    }

    fn state_of(&self, gs: (u32, u16)) -> MR {
        self.groups[gs.0 as usize].reqs[gs.1 as usize].0
    }

    fn finish(&mut self, id: RequestId, v: u64, split: bool, x: f32) -> Result<(), ()> {
        let gs = self.lookup(id)?;
        if v != self.step {
            return Err(());
        }
        match self.state_of(gs) {
            MR::InFlight => {
                self.generated(gs);
                if !split {
                    self.reward(gs, x);
                }
                self.after();
                Ok(())
            }
            MR::Aborting => {
                self.stop_aborting(gs);
                Ok(())
            }
            _ => Err(()),
        }
    }

    fn on_reward(&mut self, id: RequestId, x: f32) -> Result<(), ()> {
        let gs = self.lookup(id)?;
        if self.state_of(gs) != MR::Generated {
            return Err(());
        }
        self.reward(gs, x);
        self.after();
        Ok(())
    }

    fn fail(&mut self, id: RequestId, v: u64) -> Result<(), ()> {
        let gs = self.lookup(id)?;
        if v != self.step {
            return Err(());
        }
        match self.state_of(gs) {
            MR::InFlight => {
                self.slots -= 1;
                let max = self.plan().max_attempts;
                let r = &mut self.groups[gs.0 as usize].reqs[gs.1 as usize];
                if r.1 as u32 + 1 >= max as u32 {
                    r.0 = MR::Cancelled;
                    self.end(gs.0, GroupState::Filtered(FilterReason::AttemptsExhausted));
                } else {
                    *r = (MR::Pending, r.1 + 1);
                    self.queue.push(gs);
                }
                self.after();
                Ok(())
            }
            MR::Aborting => {
                self.stop_aborting(gs);
                Ok(())
            }
            _ => Err(()),
        }
    }

    fn ack(&mut self, id: RequestId) -> Result<(), ()> {
        let gs = self.lookup(id)?;
        if self.state_of(gs) != MR::Aborting {
            return Err(());
        }
        self.stop_aborting(gs);
        Ok(())
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
        let m = self.plan().micro_batch;
        let avail = self.dispatched.len() as u32 - self.released;
        let len = if avail >= m {
            m
        } else if self.is_final && avail > 0 && self.count(|s| s == GroupState::Trainable) == 0 {
            avail
        } else {
            return None;
        };
        let first = self.released;
        self.released += len;
        self.mb_released += 1;
        Some((first, len))
    }

    fn consume(&mut self) -> Result<(u32, u32), ()> {
        if !self.active || self.opt_due() || self.mb_consumed == self.mb_released {
            return Err(());
        }
        let m = self.plan().micro_batch;
        let first = self.mb_consumed * m;
        let len = m.min(self.released - first);
        for seq in first..first + len {
            let g = self.dispatched[seq as usize];
            self.groups[g as usize].state = GroupState::Trained;
        }
        self.mb_consumed += 1;
        self.since_opt += len;
        self.after();
        Ok((first, len))
    }

    fn opt_done(&mut self) -> Result<(), ()> {
        if !self.active || !self.opt_due() {
            return Err(());
        }
        self.since_opt = 0;
        self.after();
        Ok(())
    }

    fn exhaust(&mut self) -> Result<(), ()> {
        if !self.active {
            return Err(());
        }
        self.exhausted = true;
        self.outstanding = 0;
        self.after();
        Ok(())
    }

    fn extend(&mut self, g: u32, extra: u16) -> Result<(), ()> {
        if !self.active {
            return Err(());
        }
        let req_used = self.req_used;
        let drawn = self.groups.len();
        let grp = self.groups.get_mut(g as usize).ok_or(())?;
        if !grp.state.is_incomplete() || extra == 0 {
            return Err(());
        }
        let target = grp.reqs.len() as u32;
        let at_tail = grp.first + target == req_used;
        let needed = if at_tail {
            extra as u32
        } else {
            target + extra as u32
        };
        // Storage for the prompts the step may still draw stays reserved.
        let p = self.plan.ok_or(())?;
        let reserved = if self.is_final || self.exhausted {
            0
        } else {
            (p.max_groups as usize).saturating_sub(drawn) * p.group_size as usize
        };
        if (req_used + needed) as usize + reserved > RCAP {
            return Err(());
        }
        if !at_tail {
            grp.first = req_used;
        }
        for _ in 0..extra {
            grp.reqs.push((MR::Pending, 0));
            grp.rewards.push(f32::NAN);
        }
        if grp.state == GroupState::Materializing {
            grp.state = GroupState::Generating;
        }
        self.req_used = grp.first + target + extra as u32;
        for s in target..target + extra as u32 {
            self.queue.push((g, s as u16));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    PollDraw,
    Draw(u32),
    Admit,
    Finish(usize, f32),
    Generate(usize),
    Reward(usize, f32),
    Fail(usize),
    PollAbort,
    Ack(usize),
    Dispatch,
    MicroBatch,
    Consume,
    OptDone,
    Exhaust,
    Extend(u32, u16),
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
        8 => Just(Op::Admit),
        6 => (k.clone(), reward()).prop_map(|(k, r)| Op::Finish(k, r)),
        2 => k.clone().prop_map(Op::Generate),
        2 => (k.clone(), reward()).prop_map(|(k, r)| Op::Reward(k, r)),
        1 => k.clone().prop_map(Op::Fail),
        2 => Just(Op::PollAbort),
        2 => k.clone().prop_map(Op::Ack),
        3 => Just(Op::Dispatch),
        3 => Just(Op::MicroBatch),
        3 => Just(Op::Consume),
        2 => Just(Op::OptDone),
        1 => Just(Op::Exhaust),
        1 => (0u32..10, 0u16..3).prop_map(|(g, e)| Op::Extend(g, e)),
        1 => (k.clone(), 0u8..4).prop_map(|(k, w)| Op::Replay(k, w)),
        1 => k.prop_map(Op::WrongVersion),
        1 => Just(Op::NextStep),
    ]
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        1u32..=6,
        1u16..=4,
        0usize..4,
        0usize..4,
        1u32..=8,
        1u8..=3,
        0u32..=6,
        1u32..=4,
        0u32..=2,
        0u8..6,
        any::<bool>(),
    )
        .prop_map(
            |(b, g, oi, mi, slots, attempts, extra, draw_batch, ahead, adm, sync)| {
                let mut p = Plan::new(b, g);
                let opts: Vec<u32> = (1..=b).filter(|d| b % d == 0).collect();
                p.opt_steps = opts[oi % opts.len()];
                let mbs: Vec<u32> = (1..=b / p.opt_steps)
                    .filter(|d| (b / p.opt_steps) % d == 0)
                    .collect();
                p.micro_batch = mbs[mi % mbs.len()];
                p.slots = slots;
                p.max_attempts = attempts;
                p.max_groups = b + extra;
                p.draw_batch = draw_batch;
                p.draw_ahead = ahead;
                let order = if adm % 2 == 0 {
                    SubmitOrder::GroupMajor
                } else {
                    SubmitOrder::Interleaved
                };
                p.admission = match adm / 2 {
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
                p
            },
        )
}

fn pick(list: &mut Vec<RequestId>, k: usize) -> Option<RequestId> {
    (!list.is_empty()).then(|| list.remove(k % list.len()))
}

fn run_case(plans: Vec<Plan>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut gs = vec![GroupSlot::EMPTY; GCAP];
    let mut rs = vec![RequestSlot::EMPTY; RCAP];
    let mut s = Scheduler::new(&mut gs, &mut rs);
    let mut m = Model::default();
    let mut plans = plans.into_iter().cycle();
    let mut step = 0u64;
    let p0 = plans.next().expect("at least one plan");
    prop_assert!(m.begin(step, p0));
    prop_assert!(
        s.begin_step(Tick(0), StepId(step), PolicyVersion(step), p0)
            .is_ok()
    );
    let (mut in_flight, mut generated, mut aborts, mut history) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (t, op) in ops.into_iter().enumerate() {
        let now = Tick(t as u64);
        let v = PolicyVersion(step);
        match op {
            Op::PollDraw => {
                let n = s.poll_draw(now);
                prop_assert_eq!(n, m.poll_draw());
                if let Some(n) = n {
                    prop_assert_eq!(s.on_prompts_drawn(now, n).map(|g| g.0).ok(), m.draw(n).ok());
                }
            }
            Op::Draw(n) => {
                prop_assert_eq!(s.on_prompts_drawn(now, n).map(|g| g.0).ok(), m.draw(n).ok())
            }
            Op::Admit => {
                let frontier_waits = matches!(m.plan().admission, AdmissionPolicy::Frontier { .. })
                    && m.frontier()
                        .iter()
                        .any(|&g| m.groups[g as usize].reqs.iter().any(|r| r.0 == MR::Pending));
                let frontier = m.frontier();
                let a = s.poll_admit(now);
                let expect = m.admit();
                prop_assert_eq!(a.map(|a| (a.request.group.0, a.request.sample)), expect);
                if let Some(a) = a {
                    prop_assert_eq!(a.version, v, "one policy version per step");
                    if frontier_waits {
                        prop_assert!(
                            frontier.contains(&a.request.group.0),
                            "non-frontier admitted while frontier waits"
                        );
                    }
                    in_flight.push(a.request);
                    history.push(a.request);
                }
            }
            Op::Finish(k, x) => {
                if let Some(id) = pick(&mut in_flight, k) {
                    prop_assert_eq!(
                        s.on_request_finished(now, id, v, 1, x).is_ok(),
                        m.finish(id, step, false, x).is_ok()
                    );
                }
            }
            Op::Generate(k) => {
                if let Some(id) = pick(&mut in_flight, k) {
                    let r = s.on_request_generated(now, id, v, 1);
                    prop_assert_eq!(r.is_ok(), m.finish(id, step, true, 0.0).is_ok());
                    if matches!(r, Ok(Completion::Accepted { .. })) {
                        generated.push(id);
                    }
                }
            }
            Op::Reward(k, x) => {
                if let Some(id) = pick(&mut generated, k) {
                    prop_assert_eq!(s.on_reward(now, id, x).is_ok(), m.on_reward(id, x).is_ok());
                }
            }
            Op::Fail(k) => {
                if let Some(id) = pick(&mut in_flight, k) {
                    prop_assert_eq!(
                        s.on_request_failed(now, id, v).is_ok(),
                        m.fail(id, step).is_ok()
                    );
                }
            }
            Op::PollAbort => {
                let got = s.poll_abort(now);
                let want = (!m.aborts.is_empty()).then(|| m.aborts.remove(0));
                prop_assert_eq!(got.map(|r| (r.group.0, r.sample)), want);
                if let Some(r) = got {
                    aborts.push(r);
                    // A polled abort stays "aborting" in the model (it is out of the list).
                }
            }
            Op::Ack(k) => {
                if let Some(id) = pick(&mut aborts, k) {
                    prop_assert_eq!(s.on_abort_acked(now, id).is_ok(), m.ack(id).is_ok());
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
                    s.on_micro_batch_consumed(now)
                        .map(|b| (b.first_seq, b.len))
                        .ok(),
                    m.consume().ok()
                );
            }
            Op::OptDone => {
                prop_assert_eq!(s.on_optimizer_step_done(now).is_ok(), m.opt_done().is_ok())
            }
            Op::Exhaust => prop_assert_eq!(s.on_data_exhausted(now).is_ok(), m.exhaust().is_ok()),
            Op::Extend(g, e) => {
                prop_assert_eq!(
                    s.extend_group(now, GroupId(g), e).is_ok(),
                    m.extend(g, e).is_ok()
                );
            }
            Op::Replay(k, which) => {
                if !history.is_empty() {
                    let id = history[k % history.len()];
                    let (a, b) = match which {
                        0 => (
                            s.on_request_finished(now, id, v, 1, 1.0).is_ok(),
                            m.finish(id, step, false, 1.0).is_ok(),
                        ),
                        1 => (
                            s.on_request_failed(now, id, v).is_ok(),
                            m.fail(id, step).is_ok(),
                        ),
                        2 => (s.on_abort_acked(now, id).is_ok(), m.ack(id).is_ok()),
                        _ => (
                            s.on_reward(now, id, 0.0).is_ok(),
                            m.on_reward(id, 0.0).is_ok(),
                        ),
                    };
                    prop_assert_eq!(a, b);
                }
            }
            Op::WrongVersion(k) => {
                if !in_flight.is_empty() {
                    let id = in_flight[k % in_flight.len()];
                    let before = *s.counters();
                    prop_assert!(
                        s.on_request_finished(now, id, PolicyVersion(step + 1), 1, 1.0)
                            .is_err()
                    );
                    prop_assert_eq!(before, *s.counters());
                }
            }
            Op::NextStep => {
                let p = plans.next().expect("cycled");
                let ok = s
                    .begin_step(now, StepId(step + 1), PolicyVersion(step + 1), p)
                    .is_ok();
                prop_assert_eq!(ok, m.begin(step + 1, p));
                if ok {
                    step += 1;
                    in_flight.clear();
                    generated.clear();
                    aborts.clear();
                    history.clear();
                }
            }
        }
        check(&s, &m)?;
    }
    Ok(())
}

fn check(s: &Scheduler<'_>, m: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(s.audit(), Ok(()));
    let c = s.counters();
    prop_assert!(c.is_conserved(), "conservation");
    prop_assert_eq!(c.drawn as usize, m.groups.len(), "no group lost");
    for (g, mg) in m.groups.iter().enumerate() {
        prop_assert_eq!(
            s.view().group_state(GroupId(g as u32)),
            Some(mg.state),
            "group {} state",
            g
        );
    }
    let q: Vec<(u32, u16)> = s.view().queue().map(|r| (r.group.0, r.sample)).collect();
    prop_assert_eq!(q, m.queue.clone(), "waiting queue");
    prop_assert_eq!(s.slots_in_use(), m.slots);
    prop_assert!(
        s.slots_in_use() <= s.plan().map_or(0, |p| p.slots),
        "slots in use exceed capacity"
    );
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
    // Miri runs the same test at a few cases so the whole suite stays within minutes.
    ProptestConfig {
        cases: if cfg!(miri) { 2 } else { 512 },
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn scheduler_matches_the_reference_model(
        plans in prop::collection::vec(plan(), 1..4),
        ops in prop::collection::vec(op(), 0..if cfg!(miri) { 25 } else { 300 }),
    ) {
        run_case(plans, ops)?;
    }
}
