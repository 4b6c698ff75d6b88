//! Regression tests for the two sequences that left a step stuck forever (issue 9). Each drives
//! the core only through its `poll_*` decisions, as the protocol in lib.rs says, and requires the
//! step to reach `Done` within a bound.

use rolloutpipe_core::*;

/// Follows the protocol: draw what `poll_draw` asks, admit, answer every admission at once with
/// `reward(group, sample)`, ack aborts, dispatch, train, and apply an optimizer step whenever the
/// polls say so. Returns the summary, or the tick at which nothing was left to do.
fn drive(
    s: &mut Scheduler<'_>,
    mut reward: impl FnMut(GroupId, u16) -> f32,
    mut on_tick: impl FnMut(&mut Scheduler<'_>, u64),
) -> Result<StepSummary, String> {
    let (_, v) = s.step().expect("a step has begun");
    for t in 0..1000u64 {
        let now = Tick(t);
        if let Some(sum) = s.poll_step_done() {
            return Ok(sum);
        }
        on_tick(s, t);
        if let Some(n) = s.poll_draw(now) {
            s.on_prompts_drawn(now, n)
                .map_err(|e| format!("t{t}: a draw poll_draw asked for was refused: {e}"))?;
        }
        while let Some(a) = s.poll_admit(now) {
            let r = reward(a.request.group, a.request.sample);
            s.on_request_finished(now, a.request, v, 10, r)
                .map_err(|e| format!("t{t}: completion refused: {e}"))?;
        }
        while let Some(r) = s.poll_abort(now) {
            s.on_abort_acked(now, r).map_err(|e| e.to_string())?;
        }
        while s.poll_dispatch(now).is_some() {}
        while s.poll_micro_batch(now).is_some() {
            s.on_micro_batch_consumed(now).map_err(|e| e.to_string())?;
        }
        if s.poll_optimizer_step(now).is_some() {
            s.on_optimizer_step_done(now).map_err(|e| e.to_string())?;
        }
        s.audit().map_err(|e| e.to_string())?;
    }
    Err(format!(
        "step stalled: phase {:?}, optimizer step due {}, counters {:?}",
        s.phase(),
        s.optimizer_step_due(),
        s.counters()
    ))
}

/// Issue 9, bug 1: the batch turns final and short after its last micro-batch was consumed. The
/// optimizer step it then needs must be announced by a poll.
#[test]
fn an_optimizer_step_due_after_the_last_micro_batch_is_announced() {
    let mut storage = SchedulerStorage::<4, 8>::new();
    let mut s = storage.scheduler();
    let mut plan = Plan::new(2, 2);
    plan.max_groups = 2;
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)
        .unwrap();
    // By hand up to the trap: g0 answers 0, 1 (trainable) and its micro-batch is consumed; only
    // then does g1 answer 1, 1 (filtered).
    s.on_prompts_drawn(Tick(0), 2).unwrap();
    let a: Vec<Admission> = std::iter::from_fn(|| s.poll_admit(Tick(0))).collect();
    assert_eq!(a.len(), 4);
    for (x, r) in [(0, 0.0), (1, 1.0)] {
        s.on_request_finished(Tick(1), a[x].request, PolicyVersion(0), 5, r)
            .unwrap();
    }
    assert_eq!(s.poll_dispatch(Tick(1)).map(|d| d.group), Some(GroupId(0)));
    assert!(s.poll_micro_batch(Tick(1)).is_some());
    assert!(
        !s.on_micro_batch_consumed(Tick(1))
            .unwrap()
            .ends_optimizer_step
    );
    for x in [2, 3] {
        s.on_request_finished(Tick(2), a[x].request, PolicyVersion(0), 5, 1.0)
            .unwrap();
    }
    // The batch is final and short; one optimizer step is due, and only a poll can say so.
    let sum = drive(&mut s, |_, _| 1.0, |_, _| {}).unwrap();
    assert!(sum.short);
    assert_eq!((sum.counters.trained, sum.counters.filtered()), (1, 1));
    assert_eq!(s.optimizer_steps_done(), 1);
}

/// Bug 1 through data exhaustion: the data source runs dry after the batch's groups so far were
/// all trained.
#[test]
fn data_exhaustion_after_a_fully_consumed_batch_still_ends_the_step() {
    let mut storage = SchedulerStorage::<4, 8>::new();
    let mut s = storage.scheduler();
    let mut plan = Plan::new(2, 2);
    plan.draw_batch = 1;
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)
        .unwrap();
    // Group 0 trains; group 1 is filtered; the data runs out before a third prompt.
    let sum = drive(
        &mut s,
        |g, k| if g == GroupId(0) { k as f32 } else { 1.0 },
        |s, t| {
            if s.counters().trained == 1 && s.counters().filtered() == 1 && t > 0 {
                s.on_data_exhausted(Tick(t)).unwrap();
            }
        },
    )
    .unwrap();
    assert!(sum.short);
    assert_eq!(sum.counters.trained, 1);
    assert_eq!(s.optimizer_steps_done(), 1);
}

/// Issue 9, bug 2: storage that holds B x G requests but not the max_groups x G that
/// over-sampling may draw. The core must not ask for a draw it then refuses.
#[test]
fn over_sampling_never_asks_for_a_draw_the_storage_refuses() {
    let mut storage = SchedulerStorage::<8, 8>::new();
    let mut s = storage.scheduler();
    match s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(4, 2)) {
        // The contract: begin_step refuses storage that over-sampling could overflow.
        Err(BeginError::Plan(PlanError::RequestCapacity { needed, capacity })) => {
            assert_eq!((needed, capacity), (16, 8));
        }
        Err(e) => panic!("unexpected refusal: {e}"),
        Ok(()) => {
            drive(&mut s, |_, _| 1.0, |_, _| {}).unwrap();
        }
    }
    // With room for max_groups x G, every group filtered ends the step short and empty.
    let mut storage = SchedulerStorage::<8, 16>::new();
    let mut s = storage.scheduler();
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(4, 2))
        .unwrap();
    let sum = drive(&mut s, |_, _| 1.0, |_, _| {}).unwrap();
    assert!(sum.short);
    assert_eq!((sum.counters.drawn, sum.counters.trained), (8, 0));
}
