//! A step with more than 4,096 groups in flight at once, audited mid-run: the pending-groups
//! bitset then spans several level-1 words and several level-2 bits (64^2 = 4,096 groups per
//! level-2 bit), and the audit compares its answer (`first_pending_group`) with a linear scan of
//! every group after each batch of events.

use rolloutpipe_core::*;

#[test]
fn more_than_4096_groups_in_flight_keep_every_invariant_and_finish() {
    // Miri (~1000x slower) runs a small step through the same code; the bitset levels it then
    // skips are covered by the native run.
    const B: u32 = if cfg!(miri) { 100 } else { 5_000 };
    let mut groups = vec![GroupSlot::EMPTY; 2 * B as usize];
    let mut requests = vec![RequestSlot::EMPTY; 2 * B as usize * 2];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let mut plan = Plan::new(B, 2);
    // m divides each optimizer step's B / 5 groups at both sizes.
    plan.micro_batch = if cfg!(miri) { 10 } else { 100 };
    plan.opt_steps = 5;
    plan.slots = 3_000;
    plan.draw_batch = B;
    plan.admission = AdmissionPolicy::Frontier {
        width: 64,
        expected_filter_ppm: 200_000,
        fallback: SubmitOrder::Shuffled { seed: 7 },
    };
    let v = PolicyVersion(3);
    s.begin_step(Tick(0), StepId(1), v, plan).unwrap();
    let mut running: Vec<RequestId> = Vec::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let (mut events, mut audits, mut peak_incomplete) = (0u64, 0u32, 0u32);
    for t in 0..1_000_000u64 {
        let now = Tick(t);
        if let Some(sum) = s.poll_step_done() {
            assert_eq!(sum.counters.trained, B);
            assert!(sum.counters.is_conserved());
            if !cfg!(miri) {
                assert!(peak_incomplete > 4_096, "peak {peak_incomplete}");
                assert!(audits >= 20, "{audits} audits");
            }
            return;
        }
        if let Some(n) = s.poll_draw(now) {
            s.on_prompts_drawn(now, n).unwrap();
        }
        while let Some(a) = s.poll_admit(now) {
            running.push(a.request);
        }
        peak_incomplete = peak_incomplete.max(s.counters().incomplete());
        // A random running request finishes; every seventh group answers identically.
        for _ in 0..64 {
            if running.is_empty() {
                break;
            }
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let r = running.swap_remove((rng % running.len() as u64) as usize);
            let x = if r.group.0.is_multiple_of(7) {
                1.0
            } else {
                (r.sample % 2) as f32
            };
            s.on_request_finished(now, r, v, 10, x).unwrap();
            events += 1;
            if events % if cfg!(miri) { 50 } else { 500 } == 0 {
                s.audit().unwrap();
                audits += 1;
            }
        }
        while let Some(r) = s.poll_abort(now) {
            running.retain(|x| *x != r);
            s.on_abort_acked(now, r).unwrap();
        }
        while s.poll_dispatch(now).is_some() {}
        while s.poll_micro_batch(now).is_some() {
            s.on_micro_batch_consumed(now).unwrap();
            if s.poll_optimizer_step(now).is_some() {
                s.on_optimizer_step_done(now).unwrap();
            }
        }
        if s.poll_optimizer_step(now).is_some() {
            s.on_optimizer_step_done(now).unwrap();
        }
    }
    panic!("step did not finish: {:?}", s.counters());
}
