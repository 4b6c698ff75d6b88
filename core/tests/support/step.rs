//! A whole-step driver without allocation, shared by the no-alloc test and the benchmark
//! (`#[path]`-included): a pretend engine with `plan.slots` slots that finishes a pseudo-random
//! in-flight request per tick, a reward rule that filters every fifth group for zero variance,
//! and a trainer that consumes each micro-batch as soon as it is released.

use rolloutpipe_core::{
    Allocate, Allocation, GroupId, Plan, PolicyVersion, RequestError, RequestId, RequestState,
    Scheduler, StepId, Tick, View,
};

/// A variable-G allocation policy for plans with `hold_scored`: a group whose rewards vary gets
/// 8 more samples once (16 -> 24), the rest commit as scored.
pub struct ExtendVarying;

impl Allocate for ExtendVarying {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        match v.reward_stats(g) {
            Some(st) if st.var > 0.0 && st.count <= 16 => Allocation::Extend(8),
            _ => Allocation::Commit,
        }
    }
}

/// Most requests the pretend engine runs at once.
pub const MAX_SLOTS: usize = 1024;

/// What a step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepRun {
    /// Requests admitted (each is one admit + one finish or abort).
    pub requests: u64,
    /// Groups trained.
    pub trained: u32,
    /// Groups filtered.
    pub filtered: u32,
    /// Groups aborted.
    pub aborted: u32,
}

/// Every fifth group (by a hash of its id) answers identically and is filtered.
pub fn reward(r: RequestId) -> f32 {
    let h = (r.group.0 as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    if h.is_multiple_of(5) {
        1.0
    } else {
        (r.sample % 2) as f32
    }
}

/// Drives step `step` under `plan` to completion. Panics (test failure) on any refused event.
pub fn run_step(s: &mut Scheduler<'_>, step: u64, plan: Plan, seed: u64) -> StepRun {
    run_step_with(s, step, plan, seed, &ExtendVarying)
}

/// [`run_step`] with allocation policy `policy` (used when `plan.hold_scored`).
pub fn run_step_with(
    s: &mut Scheduler<'_>,
    step: u64,
    plan: Plan,
    seed: u64,
    policy: &dyn Allocate,
) -> StepRun {
    assert!(
        plan.slots as usize <= MAX_SLOTS,
        "the pretend engine has {MAX_SLOTS} slots"
    );
    let v = PolicyVersion(step);
    s.begin_step(Tick(0), StepId(step), v, plan)
        .expect("plan fits the storage");
    let mut in_flight: heapless::Vec<RequestId, MAX_SLOTS> = heapless::Vec::new();
    let mut rng = seed | 1;
    let mut t = 0u64;
    loop {
        let now = Tick(t);
        if let Some(n) = s.poll_draw(now) {
            s.on_prompts_drawn(now, n).expect("draw accepted");
        }
        while s.poll_allocation_with(now, policy).is_some() {}
        while let Some(a) = s.poll_admit(now) {
            in_flight.push(a.request).expect("slot cap respected");
        }
        // The engine stops aborted requests at once; their stale entries stay in `in_flight`
        // (searching for them would cost more than the core) and are refused when picked.
        while let Some(r) = s.poll_abort(now) {
            s.on_abort_acked(now, r).expect("abort ack accepted");
        }
        while s.poll_dispatch(now).is_some() {}
        while s.poll_micro_batch(now).is_some() {
            s.on_micro_batch_consumed(now)
                .expect("released micro-batch");
            if s.poll_optimizer_step(now).is_some() {
                s.on_optimizer_step_done(now).expect("optimizer step due");
            }
        }
        if s.poll_optimizer_step(now).is_some() {
            s.on_optimizer_step_done(now).expect("optimizer step due");
        }
        if let Some(sum) = s.poll_step_done() {
            let c = sum.counters;
            return StepRun {
                requests: c.requests_admitted,
                trained: c.trained,
                filtered: c.filtered(),
                aborted: c.aborted,
            };
        }
        assert!(!in_flight.is_empty(), "step stalled with nothing in flight");
        // xorshift64: which running request finishes next.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let r = in_flight.swap_remove((rng % in_flight.len() as u64) as usize);
        match s.on_request_finished(now, r, v, 100, reward(r)) {
            Ok(_)
            | Err(RequestError::BadRequestState {
                state: RequestState::Cancelled,
            }) => {}
            Err(e) => panic!("completion of {r} refused: {e}"),
        }
        t += 1;
    }
}

/// A plan for `b` groups of 16 samples: m = 32 (or B), 4 optimizer steps where B allows, 256
/// slots, prompts drawn B/4 (at most 256) at a time, room to over-sample 2x.
pub fn plan(b: u32) -> Plan {
    let mut p = Plan::new(b, 16);
    p.micro_batch = b.min(32);
    p.opt_steps = if b >= 128 { 4 } else { 1 };
    p.slots = 256;
    p.draw_batch = (b / 4).clamp(1, 256);
    p.max_groups = 2 * b;
    p
}
