//! The allocation seam: a hold after scoring, a policy deciding commit / extend / skip from the
//! view's reward statistics, the step's sample budget, and fixed G unchanged.

use rolloutpipe_core::*;

/// Drives one step with every request finishing at once; `reward(group, sample)`. Polls the
/// allocation decision with `policy` after every event when `hold` is set.
fn run(
    hold: bool,
    budget: u32,
    policy: &dyn Allocate,
    reward: impl Fn(GroupId, u16) -> f32,
) -> (StepSummary, Vec<GroupId>, Vec<u16>) {
    let mut groups = vec![GroupSlot::EMPTY; 16];
    let mut requests = vec![RequestSlot::EMPTY; 256];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let mut plan = Plan::new(4, 4);
    plan.max_groups = 8;
    plan.micro_batch = 2;
    plan.slots = 3;
    plan.draw_batch = 2;
    plan.hold_scored = hold;
    plan.sample_budget = budget;
    plan.admission = AdmissionPolicy::Frontier {
        width: 0,
        expected_filter_ppm: 0,
        fallback: SubmitOrder::Interleaved,
    };
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)
        .unwrap();
    let mut order = Vec::new();
    for t in 0..500 {
        let now = Tick(t);
        if let Some(sum) = s.poll_step_done() {
            let targets = (0..sum.counters.drawn)
                .map(|g| s.group(GroupId(g)).unwrap().target)
                .collect();
            return (sum, order, targets);
        }
        if let Some(n) = s.poll_draw(now) {
            s.on_prompts_drawn(now, n).unwrap();
        }
        // One completion per tick, so holds and admissions interleave.
        if let Some(a) = s.poll_admit(now) {
            let r = reward(a.request.group, a.request.sample);
            s.on_request_finished(now, a.request, a.version, 10, r)
                .unwrap();
        }
        if hold {
            while let Some(a) = s.poll_allocation_with(now, policy) {
                if let Some(left) = s.view().samples_left() {
                    assert!(left <= budget as u64);
                }
                let _ = a;
            }
        }
        while let Some(r) = s.poll_abort(now) {
            s.on_abort_acked(now, r).unwrap();
        }
        while let Some(d) = s.poll_dispatch(now) {
            order.push(d.group);
        }
        while s.poll_micro_batch(now).is_some() {
            s.on_micro_batch_consumed(now).unwrap();
        }
        if s.poll_optimizer_step(now).is_some() {
            s.on_optimizer_step_done(now).unwrap();
        }
        s.audit().unwrap();
    }
    panic!("step did not finish: {:?}", s.counters());
}

fn mixed(g: GroupId, k: u16) -> f32 {
    if g.0.is_multiple_of(3) {
        1.0
    } else {
        (k % 2) as f32
    }
}

#[test]
fn fixed_g_through_the_hold_behaves_exactly_as_without_it() {
    let plain = run(false, 0, &FixedG, mixed);
    let held = run(true, 0, &FixedG, mixed);
    assert_eq!(plain.1, held.1, "dispatch order");
    assert_eq!(plain.0.counters, held.0.counters);
    assert!(held.2.iter().all(|&t| t == 4));
}

/// VIGOR-like: extend the groups whose rewards vary, 2 samples at a time, while the budget lasts.
struct ExtendVarying;

impl Allocate for ExtendVarying {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        let st = v.reward_stats(g).unwrap();
        if st.var > 0.0 && st.count < 8 {
            Allocation::Extend(2)
        } else {
            Allocation::Commit
        }
    }
}

#[test]
fn extensions_stop_at_the_sample_budget_and_commit_instead() {
    let (sum, _, targets) = run(true, 32, &ExtendVarying, mixed);
    let total: u32 = targets.iter().map(|&t| t as u32).sum();
    // Six prompts drawn (groups 0 and 3 answer identically and are replaced): 24 samples; the
    // other 8 of the budget go to extensions of the varying groups, 2 at a time.
    assert_eq!(total, 32, "{targets:?}");
    assert!(targets.iter().any(|&t| t > 4), "{targets:?}");
    assert!(sum.counters.is_conserved());
    // Without a budget, every varying group grows to 8.
    let (_, _, targets) = run(true, 0, &ExtendVarying, mixed);
    for (g, &t) in targets.iter().enumerate() {
        if g % 3 != 0 {
            assert_eq!(t, 8, "group {g}");
        }
    }
}

/// Pilot-Commit-like: skip the groups that are all correct.
struct SkipSolved;

impl Allocate for SkipSolved {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        if v.reward_stats(g).unwrap().min >= 1.0 {
            Allocation::Skip(SkipReason::TooEasy)
        } else {
            Allocation::Commit
        }
    }
}

#[test]
fn a_skipped_group_is_filtered_with_its_reason_and_replaced() {
    let (sum, order, _) = run(true, 0, &SkipSolved, mixed);
    assert_eq!(sum.counters.trained, 4);
    assert_eq!(sum.counters.filtered_zero_variance, 0);
    assert!(sum.counters.filtered_skipped >= 1);
    assert!(order.iter().all(|g| g.0 % 3 != 0));
}

#[test]
fn a_budget_below_the_batch_is_refused() {
    let mut p = Plan::new(4, 4);
    p.sample_budget = 15;
    assert_eq!(
        p.validate(),
        Err(PlanError::SampleBudgetBelowBatch {
            sample_budget: 15,
            needed: 16
        })
    );
}

/// Groups end with 4, 6 or 8 samples, by id.
struct VarySize;

impl Allocate for VarySize {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        match v.group_target(g) {
            Some(4) if !g.0.is_multiple_of(3) => Allocation::Extend(2 * (g.0 % 3) as u16),
            _ => Allocation::Commit,
        }
    }
}

/// Drives a step with variable group sizes and micro-batches of `unit`s; returns each
/// micro-batch's groups and their sizes in that unit.
fn micro_batches(dispatch: DispatchPolicy, unit: MicroBatchUnit, m: u32) -> Vec<Vec<(u32, u64)>> {
    let mut groups = vec![GroupSlot::EMPTY; 16];
    let mut requests = vec![RequestSlot::EMPTY; 256];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let mut plan = Plan::new(6, 4);
    plan.max_groups = 10;
    plan.opt_steps = 2;
    plan.micro_batch = m;
    plan.micro_batch_unit = unit;
    plan.slots = 3;
    plan.hold_scored = true;
    plan.dispatch = dispatch;
    plan.admission = AdmissionPolicy::Frontier {
        width: 0,
        expected_filter_ppm: 0,
        fallback: SubmitOrder::GroupMajor,
    };
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)
        .unwrap();
    let mut out = Vec::new();
    for t in 0..2_000 {
        let now = Tick(t);
        if s.poll_step_done().is_some() {
            return out;
        }
        if let Some(n) = s.poll_draw(now) {
            s.on_prompts_drawn(now, n).unwrap();
        }
        if let Some(a) = s.poll_admit(now) {
            let r = mixed(a.request.group, a.request.sample);
            let tokens = 10 + 7 * a.request.group.0 + a.request.sample as u32;
            s.on_request_finished(now, a.request, a.version, tokens, r)
                .unwrap();
        }
        while s.poll_allocation_with(now, &VarySize).is_some() {}
        while let Some(r) = s.poll_abort(now) {
            s.on_abort_acked(now, r).unwrap();
        }
        while s.poll_dispatch(now).is_some() {}
        while let Some(mb) = s.poll_micro_batch(now) {
            let c = s.on_micro_batch_consumed(now).unwrap();
            assert_eq!((c.first_seq, c.len), (mb.first_seq, mb.len));
            let gs = (mb.first_seq..mb.first_seq + mb.len)
                .map(|q| {
                    let g = s.dispatched_group(q).unwrap();
                    let info = s.group(g).unwrap();
                    let size = match unit {
                        MicroBatchUnit::Samples => info.target as u64,
                        MicroBatchUnit::Tokens => info.tokens,
                        _ => 1,
                    };
                    (g.0, size)
                })
                .collect();
            out.push(gs);
            if s.poll_optimizer_step(now).is_some() {
                s.on_optimizer_step_done(now).unwrap();
            }
        }
        if s.poll_optimizer_step(now).is_some() {
            s.on_optimizer_step_done(now).unwrap();
        }
        s.audit().unwrap();
    }
    panic!("step did not finish: {:?}", s.counters());
}

#[test]
fn micro_batches_by_samples_and_tokens_cut_at_the_size_and_match_across_dispatch() {
    for (unit, m) in [(MicroBatchUnit::Samples, 10), (MicroBatchUnit::Tokens, 150)] {
        let piped = micro_batches(DispatchPolicy::Pipelined, unit, m);
        // The equivalence property: the same samples give the same micro-batches in the same
        // order, whether groups are released as they materialize or all at the end.
        let sync = micro_batches(DispatchPolicy::Sync, unit, m);
        assert_eq!(piped, sync, "{unit:?}");
        let groups: usize = piped.iter().map(Vec::len).sum();
        assert_eq!(groups, 6);
        // Extensions made the sizes vary; each micro-batch is cut at the first group that
        // brings it to m, or at the optimizer step's 3 groups.
        assert!(
            piped.iter().flatten().any(|&(_, n)| n != piped[0][0].1),
            "{piped:?}"
        );
        let mut seen = 0;
        for mb in &piped {
            let sizes: Vec<u64> = mb.iter().map(|&(_, n)| n).collect();
            let total: u64 = sizes.iter().sum();
            seen += mb.len();
            let before_last: u64 = total - sizes.last().unwrap();
            assert!(before_last < m as u64, "{unit:?} {piped:?}");
            assert!(total >= m as u64 || seen % 3 == 0, "{unit:?} {piped:?}");
        }
    }
}

#[test]
fn micro_batches_by_groups_need_no_divisor_check_in_other_units() {
    let mut p = Plan::new(6, 4);
    p.micro_batch = 4;
    assert!(p.validate().is_err(), "4 groups do not divide 6");
    p.micro_batch_unit = MicroBatchUnit::Samples;
    assert_eq!(p.validate(), Ok(()));
}

#[test]
fn groups_may_start_below_g_and_the_budget_counts_what_was_drawn() {
    let mut storage = SchedulerStorage::<4, 16>::new();
    let mut s = storage.scheduler();
    let mut plan = Plan::new(2, 4);
    plan.max_groups = 2;
    plan.sample_budget = 10;
    plan.slots = 8;
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)
        .unwrap();
    assert_eq!(s.on_prompts_drawn_with(Tick(0), 1, 2), Ok(GroupId(0)));
    assert_eq!(s.view().samples_left(), Some(8));
    assert_eq!(
        s.on_prompts_drawn_with(Tick(0), 1, 0),
        Err(DrawError::ZeroSamples)
    );
    assert_eq!(s.on_prompts_drawn(Tick(0), 1), Ok(GroupId(1)));
    assert_eq!(s.view().samples_left(), Some(4));
    // The small group can still grow into the budget the full-size draw would have used.
    s.extend_group(Tick(0), GroupId(0), 4).unwrap();
    assert_eq!(s.view().samples_left(), Some(0));
    while let Some(a) = s.poll_admit(Tick(1)) {
        s.on_request_finished(
            Tick(2),
            a.request,
            a.version,
            1,
            (a.request.sample % 2) as f32,
        )
        .unwrap();
    }
    assert_eq!(s.group(GroupId(0)).unwrap().target, 6);
    assert_eq!(s.group(GroupId(1)).unwrap().target, 4);
    assert_eq!(s.counters().trainable, 2);
    s.audit().unwrap();
}
