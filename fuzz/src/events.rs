//! Decodes arbitrary bytes into a plan and an event sequence (valid and invalid events) and drives
//! the scheduler with it, checking after every event:
//! - `audit()` (every count re-derived from storage, lists consistent, conservation);
//! - an event that returned an error changed nothing observable;
//! - slots in use never exceed the plan's slots;
//! - every admission carries the step's policy version;
//! - no group is dispatched twice, only complete trainable groups are dispatched, in
//!   materialization order (tracked here from the completions this driver reported);
//! - under `Frontier`, no non-frontier request is admitted while a frontier request waits;
//! - liveness: at the end of the input, a driver that only answers the core's `poll_*`
//!   decisions (finishing whatever it was handed, as engines eventually do) brings the step to
//!   `Done` within a bound.
//!
//! Used by the cargo-fuzz target `events` and, on stable, by `core/tests/fuzz_corpus.rs`.

use std::collections::HashSet;

use rolloutpipe_core::{
    AdmissionPolicy, Allocate, Allocation, Counters, DispatchPolicy, GroupId, GroupSlot,
    GroupState, Plan, PolicyVersion, RequestId, RequestSlot, RequestState, Scheduler, SkipReason,
    StepId, StepPhase, StepSummary, SubmitOrder, Tick, View,
};

/// Group slots given to the scheduler: small, so capacity errors are reachable.
pub const GROUPS: usize = 12;
/// Request slots given to the scheduler: below the `max_groups x G` of many decoded plans, so
/// `begin_step` refusals and `extend_group`'s `RequestsFull` are reached.
pub const REQUESTS: usize = 32;

struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl Bytes<'_> {
    fn done(&self) -> bool {
        self.at >= self.data.len()
    }
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }
    fn pick(&mut self, n: usize) -> usize {
        self.u8() as usize % n.max(1)
    }
}

fn order(b: &mut Bytes<'_>) -> SubmitOrder {
    match b.pick(3) {
        0 => SubmitOrder::GroupMajor,
        1 => SubmitOrder::Interleaved,
        _ => SubmitOrder::Shuffled {
            seed: b.u8() as u64,
        },
    }
}

fn plan(b: &mut Bytes<'_>) -> Plan {
    let batch = 1 + b.pick(6) as u32;
    let mut p = Plan::new(batch, 1 + b.pick(4) as u16);
    // Mostly valid divisor choices, sometimes raw values so that plan errors are exercised.
    if b.pick(8) == 0 {
        p.opt_steps = b.pick(4) as u32;
        p.micro_batch = b.pick(4) as u32;
    } else {
        let divisors = |n: u32| (1..=n).filter(move |d| n.is_multiple_of(*d));
        let opts: Vec<u32> = divisors(batch).collect();
        p.opt_steps = opts[b.pick(opts.len())];
        let mbs: Vec<u32> = divisors(batch / p.opt_steps).collect();
        p.micro_batch = mbs[b.pick(mbs.len())];
    }
    p.slots = b.pick(9) as u32;
    p.max_attempts = b.pick(4) as u8;
    p.max_groups = batch + b.pick(10) as u32;
    p.draw_batch = b.pick(5) as u32;
    p.draw_ahead = b.pick(3) as u32;
    p.admission = if b.pick(2) == 0 {
        AdmissionPolicy::Fifo { order: order(b) }
    } else {
        let width = b.pick(4) as u32;
        let ppm = [0, 100_000, 500_000, 999_999, 1_000_000][b.pick(5)];
        AdmissionPolicy::Frontier {
            width,
            expected_filter_ppm: ppm,
            fallback: order(b),
        }
    };
    p.dispatch = if b.pick(2) == 0 {
        DispatchPolicy::Pipelined
    } else {
        DispatchPolicy::Sync
    };
    p.hold_scored = b.pick(2) == 0;
    p.sample_budget = [0, 0, 8, 16, 24, 40][b.pick(6)];
    p.commit_reserve = [0, 0, 2, 4][b.pick(4)];
    p
}

/// Decides held groups from the input bytes (commit, extend, skip), ignoring the view.
struct Scripted(Allocation);

impl Allocate for Scripted {
    fn decide(&self, _: &View<'_, '_>, _: GroupId) -> Allocation {
        self.0
    }
}

fn reward(b: &mut Bytes<'_>) -> f32 {
    [
        0.0,
        1.0,
        0.5,
        1.0,
        0.0,
        0.25,
        1.0,
        0.0,
        1.0,
        0.0,
        f32::NAN,
        f32::INFINITY,
    ][b.pick(12)]
}

/// What an error must leave unchanged.
#[derive(PartialEq, Debug)]
struct Snapshot {
    counters: Counters,
    phase: StepPhase,
    summary: Option<StepSummary>,
    pending: u32,
    is_final: bool,
    opt_due: bool,
    states: Vec<Option<GroupState>>,
}

fn snapshot(s: &Scheduler<'_>) -> Snapshot {
    Snapshot {
        counters: *s.counters(),
        phase: s.phase(),
        summary: s.summary(),
        pending: s.view().pending_requests(),
        is_final: s.is_batch_final(),
        opt_due: s.optimizer_step_due(),
        states: (0..GROUPS as u32)
            .map(|g| s.view().group_state(GroupId(g)))
            .collect(),
    }
}

/// The driver's own record of one step.
#[derive(Default)]
struct Track {
    in_flight: Vec<RequestId>,
    generated: Vec<RequestId>,
    aborts: Vec<RequestId>,
    history: Vec<RequestId>,
    /// Groups in the order this driver saw them become trainable.
    materialized: Vec<GroupId>,
    dispatched: Vec<GroupId>,
    dispatched_set: HashSet<GroupId>,
}

fn take(list: &mut Vec<RequestId>, b: &mut Bytes<'_>) -> Option<RequestId> {
    if list.is_empty() {
        return None;
    }
    let k = b.pick(list.len());
    Some(list.swap_remove(k))
}

/// How far an input got, so tests can check the driver reaches deep states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Events applied.
    pub events: u32,
    /// Events refused with an error.
    pub errors: u32,
    /// Steps that reached `Done`.
    pub steps_done: u32,
    /// Groups dispatched to the trainer.
    pub dispatched: u32,
    /// Groups filtered (any reason).
    pub filtered: u32,
    /// Groups aborted.
    pub aborted: u32,
    /// Request attempts that failed.
    pub failed: u64,
}

impl Stats {
    fn tally(&mut self, c: &Counters, done: bool) {
        self.dispatched += c.dispatched + c.trained;
        self.filtered += c.filtered();
        self.aborted += c.aborted;
        self.failed += c.requests_failed;
        self.steps_done += done as u32;
    }
}

/// Runs one fuzz input. Panics when an invariant breaks.
pub fn run(data: &[u8]) -> Stats {
    let mut groups = vec![GroupSlot::EMPTY; GROUPS];
    let mut requests = vec![RequestSlot::EMPTY; REQUESTS];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let mut b = Bytes { data, at: 0 };
    let mut step = 0u64;
    let mut t = Track::default();
    let mut now = 0u64;
    let begin = |s: &mut Scheduler<'_>, b: &mut Bytes<'_>, step: u64| {
        let p = plan(b);
        let before = snapshot(s);
        let r = s.begin_step(Tick(0), StepId(step), PolicyVersion(step), p);
        if r.is_err() {
            assert_eq!(before, snapshot(s), "failed begin_step changed state");
        }
        r.is_ok()
    };
    let mut stats = Stats::default();
    while !begin(&mut s, &mut b, step) {
        if b.done() {
            return stats;
        }
    }
    while !b.done() {
        now += b.pick(3) as u64;
        let tick = Tick(now);
        let version = PolicyVersion(step);
        let before = snapshot(&s);
        // Progress events are weighted up so inputs reach full batches, dispatch and training.
        let op = match b.pick(46) {
            0..=3 => 0,
            4 => 1,
            5..=10 => 2,
            11..=16 => 3,
            17..=18 => 4,
            19..=20 => 5,
            21 => 6,
            22..=23 => 7,
            24..=25 => 8,
            26..=28 => 9,
            29..=31 => 10,
            32..=33 => 11,
            34 => 12,
            35 if b.pick(4) == 0 => 13,
            35 => 0,
            36 => 14,
            37 => 15,
            38 => 16,
            39 => 18,
            40 => 19,
            41 => 20,
            42 => 21,
            43 | 44 => 22,
            _ => 17,
        };
        // `Err` results must leave the snapshot unchanged; `Ok` ones are checked by audit.
        let failed: bool = match op {
            0 => {
                if let Some(n) = s.poll_draw(tick) {
                    s.on_prompts_drawn(tick, n)
                        .expect("a draw the core asked for must be accepted");
                }
                false
            }
            1 => s.on_prompts_drawn(tick, b.pick(4) as u32).is_err(),
            2 => {
                for _ in 0..=b.pick(4) {
                    let frontier: Vec<GroupId> = s.view().frontier().collect();
                    let frontier_waits = frontier.iter().any(|&g| s.view().pending_in(g) > 0);
                    let is_frontier_policy = matches!(
                        s.plan().map(|p| p.admission),
                        Some(AdmissionPolicy::Frontier { .. })
                    );
                    let Some(a) = s.poll_admit(tick) else { break };
                    assert_eq!(a.version, version, "admission with another policy version");
                    assert_eq!(a.request.step, StepId(step));
                    if is_frontier_policy && frontier_waits {
                        assert!(
                            frontier.contains(&a.request.group),
                            "non-frontier request admitted while a frontier request waits"
                        );
                    }
                    t.in_flight.push(a.request);
                    t.history.push(a.request);
                }
                false
            }
            3 => match take(&mut t.in_flight, &mut b) {
                Some(r) => s
                    .on_request_finished(tick, r, version, b.u8() as u32, reward(&mut b))
                    .is_err(),
                None => false,
            },
            4 => match take(&mut t.in_flight, &mut b) {
                Some(r) => match s.on_request_generated(tick, r, version, b.u8() as u32) {
                    // Accepted, or discarded (its group ended): a reward may follow either way.
                    Ok(_) => {
                        t.generated.push(r);
                        false
                    }
                    Err(_) => true,
                },
                None => false,
            },
            5 => match take(&mut t.generated, &mut b) {
                Some(r) => s.on_reward(tick, r, reward(&mut b)).is_err(),
                None => false,
            },
            6 => match take(&mut t.in_flight, &mut b) {
                Some(r) => s.on_request_failed(tick, r, version).is_err(),
                None => false,
            },
            7 => {
                while let Some(r) = s.poll_abort(tick) {
                    t.aborts.push(r);
                }
                false
            }
            8 => match take(&mut t.aborts, &mut b) {
                Some(r) => {
                    t.in_flight.retain(|x| *x != r);
                    s.on_abort_acked(tick, r).is_err()
                }
                None => false,
            },
            9 => {
                while let Some(d) = s.poll_dispatch(tick) {
                    assert!(t.dispatched_set.insert(d.group), "group dispatched twice");
                    assert_eq!(
                        d.seq as usize,
                        t.dispatched.len(),
                        "dispatch seqs are dense"
                    );
                    t.dispatched.push(d.group);
                    let info = s.group(d.group).expect("dispatched group exists");
                    assert_eq!(info.rewarded, info.target, "dispatched an incomplete group");
                }
                assert!(
                    t.materialized.starts_with(&t.dispatched),
                    "dispatch order differs from materialization order"
                );
                false
            }
            10 => {
                let _ = s.poll_micro_batch(tick);
                s.on_micro_batch_consumed(tick).is_err()
            }
            11 => {
                // Mostly as announced by the poll; sometimes unannounced (then maybe refused).
                if b.pick(4) != 0 && s.poll_optimizer_step(tick).is_none() {
                    false
                } else {
                    s.on_optimizer_step_done(tick).is_err()
                }
            }
            18 => match take(&mut t.in_flight, &mut b) {
                Some(r) => s.on_admission_refused(tick, r).is_err(),
                None => false,
            },
            19 => match take(&mut t.in_flight, &mut b) {
                Some(r) => s.on_request_preempted(tick, r).is_err(),
                None => false,
            },
            20 => s.set_slots(tick, b.pick(6) as u32).is_err(),
            22 => {
                let decision = match b.pick(4) {
                    0 | 1 => Allocation::Commit,
                    2 => Allocation::Extend(b.pick(4) as u16),
                    _ => Allocation::Skip(SkipReason::TooEasy),
                };
                if let Some(a) = s.poll_allocation_with(tick, &Scripted(decision)) {
                    assert_eq!(a.decided, decision);
                    assert!(
                        a.applied == decision || a.applied == Allocation::Commit,
                        "applied {:?} for {:?}",
                        a.applied,
                        decision
                    );
                }
                false
            }
            21 => {
                let _ = s.poll_optimizer_step(tick);
                false
            }
            12 => s
                .extend_group(tick, GroupId(b.pick(GROUPS + 2) as u32), b.pick(4) as u16)
                .is_err(),
            13 => s.on_data_exhausted(tick).is_err(),
            14 => {
                // Replays an old id: duplicate, stale attempt or late completion.
                if t.history.is_empty() {
                    false
                } else {
                    let r = t.history[b.pick(t.history.len())];
                    let res = match b.pick(4) {
                        0 => s.on_request_finished(tick, r, version, 1, 1.0).map(|_| ()),
                        1 => s.on_request_failed(tick, r, version).map(|_| ()),
                        2 => s.on_abort_acked(tick, r),
                        _ => s.on_reward(tick, r, 0.0).map(|_| ()),
                    };
                    // A replay can be legal (the request is really in that state); then the driver's
                    // lists are stale, which only makes later events of it invalid.
                    res.is_err()
                }
            }
            15 => {
                let forged = RequestId {
                    step: StepId(step + b.pick(2) as u64),
                    group: GroupId(b.pick(GROUPS + 1) as u32),
                    sample: b.pick(6) as u16,
                    attempt: b.pick(3) as u8,
                };
                s.on_request_failed(tick, forged, version).is_err()
            }
            16 => match t.in_flight.first() {
                Some(&r) => {
                    let wrong = PolicyVersion(step + 1 + b.pick(3) as u64);
                    assert!(
                        s.on_request_finished(tick, r, wrong, 1, 1.0).is_err(),
                        "wrong version accepted"
                    );
                    true
                }
                None => false,
            },
            _ => {
                let next = step + 1;
                let ended = *s.counters();
                let was_done = s.phase() == StepPhase::Done;
                if begin(&mut s, &mut b, next) {
                    stats.tally(&ended, was_done);
                    step = next;
                    t = Track::default();
                }
                false
            }
        };
        stats.events += 1;
        if failed {
            stats.errors += 1;
            assert_eq!(before, snapshot(&s), "op {op} failed but changed state");
        }
        // One event completes at most one group; record materialization order from the states.
        let after = snapshot(&s);
        for (g, (a, b)) in before.states.iter().zip(&after.states).enumerate() {
            if a.is_some_and(|a| a.is_incomplete()) && *b == Some(GroupState::Trainable) {
                t.materialized.push(GroupId(g as u32));
            }
        }
        if let Err(e) = s.audit() {
            panic!("op {op}: {e}");
        }
        assert!(s.counters().is_conserved());
    }
    if s.phase() == StepPhase::Active {
        drive_to_done(&mut s, StepId(step), &mut now);
    }
    stats.tally(s.counters(), s.phase() == StepPhase::Done);
    stats
}

/// What the environment holds of the current step: every request it was handed and has not
/// answered (running, being aborted, or generated and awaiting its reward).
fn outstanding(s: &Scheduler<'_>, step: StepId) -> (Vec<RequestId>, Vec<RequestId>) {
    let (mut running, mut generated) = (Vec::new(), Vec::new());
    for g in 0..s.counters().drawn {
        let group = GroupId(g);
        let target = s.group(group).map_or(0, |i| i.target);
        for sample in 0..target {
            let Some((state, attempt)) = s.request_state(group, sample) else {
                continue;
            };
            let id = RequestId {
                step,
                group,
                sample,
                attempt,
            };
            match state {
                RequestState::InFlight | RequestState::AbortSent => running.push(id),
                RequestState::Generated | RequestState::Dropped => generated.push(id),
                _ => {}
            }
        }
    }
    (running, generated)
}

/// Liveness: answers every decision of the core (and finishes every request the environment
/// holds, with rewards that differ within a group) until the step is done. Panics if it is not
/// done within a bound: a few rounds per group the storage can hold.
fn drive_to_done(s: &mut Scheduler<'_>, step: StepId, now: &mut u64) {
    let v = PolicyVersion(step.0);
    let (mut running, mut generated) = outstanding(s, step);
    let bound = 4 * (GROUPS + 2);
    for _ in 0..bound {
        if s.phase() != StepPhase::Active {
            return;
        }
        *now += 1;
        let tick = Tick(*now);
        if let Some(n) = s.poll_draw(tick) {
            s.on_prompts_drawn(tick, n)
                .expect("a draw the core asked for must be accepted");
        }
        while s.poll_allocation(tick).is_some() {}
        while let Some(a) = s.poll_admit(tick) {
            running.push(a.request);
        }
        for r in std::mem::take(&mut generated) {
            s.on_reward(tick, r, (r.sample % 2) as f32)
                .expect("a reward for a generated request is accepted or discarded");
        }
        for r in std::mem::take(&mut running) {
            let x = ((r.sample as u32 + r.group.0) % 2) as f32;
            s.on_request_finished(tick, r, v, 1, x)
                .expect("a running request's completion is accepted or discarded");
        }
        while let Some(r) = s.poll_abort(tick) {
            // Already finished above (then the ack is refused) or the abort settles it.
            let _ = s.on_abort_acked(tick, r);
        }
        while s.poll_dispatch(tick).is_some() {}
        // The trainer: apply a due optimizer step (announced now or by an earlier random event),
        // train micro-batches handed out earlier, then new ones.
        loop {
            let announced = s.poll_optimizer_step(tick).is_some();
            if announced || s.optimizer_step_due() {
                s.on_optimizer_step_done(tick)
                    .expect("a due optimizer step is accepted");
            }
            if s.on_micro_batch_consumed(tick).is_ok() {
                continue;
            }
            if s.poll_micro_batch(tick).is_none() {
                break;
            }
        }
        s.audit().expect("audit while driving to done");
    }
    assert_eq!(
        s.phase(),
        StepPhase::Done,
        "step not done after {bound} rounds of answering every decision: {:?}",
        s.counters()
    );
}
