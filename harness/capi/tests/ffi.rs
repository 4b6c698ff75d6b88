//! The C ABI's contract from Rust: null pointers, unknown codes and illegal events come back as
//! status codes with a message, never a panic; a seeded storm of random (mostly illegal) calls
//! never yields `RP_ERR_PANIC` and leaves the audit clean.

use std::ptr::null_mut;

use rolloutpipe_capi::ffi::*;
use rolloutpipe_capi::ffi_step::*;
use rolloutpipe_capi::types::*;

fn message() -> String {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the buffer is valid for its length.
    let n = unsafe { rp_last_error_message(buf.as_mut_ptr(), buf.len()) };
    let bytes: Vec<u8> = buf[..n.min(255)].iter().map(|&c| c as u8).collect();
    String::from_utf8(bytes).unwrap()
}

fn out_ptr_placeholder() -> *mut RpAdmission {
    // Never written: the call is refused for its null `n` first.
    std::ptr::NonNull::dangling().as_ptr()
}

fn new_sched(groups: usize, requests: usize) -> *mut RpScheduler {
    let mut s = null_mut();
    // SAFETY: `s` is a valid out-pointer.
    assert_eq!(unsafe { rp_scheduler_new(groups, requests, &mut s) }, RP_OK);
    s
}

#[test]
fn nulls_codes_and_illegal_events_are_status_codes_with_messages() {
    // SAFETY (whole test): every pointer passed is null on purpose or points at a live local.
    unsafe {
        assert_eq!(rp_audit(null_mut()), RP_ERR_NULL);
        assert_eq!(message(), "scheduler handle is null");
        assert_eq!(rp_scheduler_new(1 << 25, 1, &mut null_mut()), RP_ERR_ARG);
        assert!(message().contains("exceeds"), "{}", message());
        assert_eq!(rp_scheduler_new(4, 16, null_mut()), RP_ERR_NULL);
        let s = new_sched(4, 16);
        let mut plan = RpPlan::default();
        assert_eq!(rp_plan_default(2, 2, &mut plan), RP_OK);
        assert_eq!(rp_begin_step(s, 0, 0, 0, std::ptr::null()), RP_ERR_NULL);
        let mut bad = plan;
        bad.dispatch = 7;
        assert_eq!(rp_begin_step(s, 0, 0, 0, &bad), RP_ERR_ARG);
        assert_eq!(message(), "RpPlan.dispatch: unknown code 7");
        assert_eq!(rp_on_prompts_drawn(s, 0, 1, 0, null_mut()), RP_ERR_DRAW);
        assert_eq!(message(), "no step is running");
        assert_eq!(rp_begin_step(s, 0, 0, 3, &plan), RP_OK);
        assert_eq!(rp_begin_step(s, 0, 1, 3, &plan), RP_ERR_BEGIN);
        assert_eq!(message(), "step 0 is still in progress");
        let mut n = 0u32;
        assert_eq!(rp_poll_draw(s, 1, &mut n), RP_OK);
        assert_eq!(rp_on_prompts_drawn(s, 1, n, 0, null_mut()), RP_OK);
        let mut a = RpAdmission::default();
        assert_eq!(rp_poll_admit(s, 1, &mut a), RP_OK);
        assert_eq!(
            rp_on_request_finished(s, 1, a.request, 2, 5, 1.0, null_mut()),
            RP_ERR_REQUEST
        );
        assert_eq!(message(), "completion from v2, step runs v3");
        assert_eq!(rp_on_micro_batch_consumed(s, 1, null_mut()), RP_ERR_TRAIN);
        assert_eq!(rp_set_slots(s, 1, 0), RP_ERR_SLOTS);
        assert_eq!(rp_extend_group(s, 1, 99, 1), RP_ERR_EXTEND);
        // A null buffer is refused before the poll runs: no admission is lost.
        assert_eq!(
            rp_poll_admit_batch(s, 1, null_mut(), 4, &mut 0),
            RP_ERR_NULL
        );
        assert_eq!(
            rp_poll_admit_batch(s, 1, out_ptr_placeholder(), 4, null_mut()),
            RP_ERR_NULL
        );
        // A huge `cap` is bounded by the request storage (16), not allocated.
        let mut out = [RpAdmission::default(); 16];
        let mut got = 9usize;
        assert_eq!(
            rp_poll_admit_batch(s, 1, out.as_mut_ptr(), usize::MAX, &mut got),
            RP_OK
        );
        assert_eq!(got, 3); // the three samples still pending
        let mut r = [0f32; 1];
        let mut k = 0usize;
        assert_eq!(rp_group_rewards(s, 0, r.as_mut_ptr(), 1, &mut k), RP_OK);
        assert_eq!(k, 2); // the full count, though only one fits
        assert!(r[0].is_nan()); // no reward yet
        assert_eq!(
            rp_group_rewards(s, 9, r.as_mut_ptr(), 1, &mut k),
            RP_ERR_ARG
        );
        let mut c = RpCounters::default();
        assert_eq!(rp_counters(s, &mut c), RP_OK);
        assert_eq!(
            (c.drawn, c.requests_admitted, c.requests_rewarded),
            (2, 4, 0)
        );
        assert_eq!(rp_audit(s), RP_OK);
        // A message longer than the buffer is truncated, NUL-terminated, full length returned.
        let mut tiny = [1 as std::ffi::c_char; 4];
        let full = rp_last_error_message(tiny.as_mut_ptr(), tiny.len());
        assert!(full > 3 && tiny[3] == 0);
        rp_scheduler_free(s);
        rp_scheduler_free(null_mut());
    }
}

/// SplitMix64: a seeded generator without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn a_seeded_storm_of_random_calls_never_panics_and_keeps_the_audit_clean() {
    let mut rng = Rng(7);
    let s = new_sched(8, 64);
    let mut seen = [0usize; 12];
    // SAFETY (whole test): `s` is live until the free; out-pointers are locals.
    unsafe {
        for i in 0..20_000u64 {
            let now = i;
            let id = RpRequestId {
                step: rng.below(3),
                group: rng.below(10) as u32,
                sample: rng.below(5) as u16,
                attempt: rng.below(3) as u8,
            };
            let mut plan = RpPlan::default();
            rp_plan_default(1 + rng.below(4) as u32, 1 + rng.below(4) as u16, &mut plan);
            plan.max_groups = plan.batch_groups * 2;
            plan.slots = 1 + rng.below(8) as u32;
            plan.admission = rng.below(3) as u8; // 2 is an unknown code
            let st = match rng.below(14) {
                0 => rp_begin_step(s, now, rng.below(4), rng.below(2), &plan),
                1 => {
                    let mut n = 0;
                    match rp_poll_draw(s, now, &mut n) {
                        RP_OK => rp_on_prompts_drawn(s, now, n, 0, null_mut()),
                        x => x,
                    }
                }
                2 => rp_on_prompts_drawn(s, now, rng.below(3) as u32, 0, null_mut()),
                3 => {
                    let mut a = RpAdmission::default();
                    match rp_poll_admit(s, now, &mut a) {
                        RP_OK => rp_on_request_finished(
                            s,
                            now,
                            a.request,
                            a.version,
                            3,
                            rng.below(2) as f32,
                            null_mut(),
                        ),
                        x => x,
                    }
                }
                4 => rp_on_request_finished(s, now, id, rng.below(2), 3, 1.0, null_mut()),
                5 => rp_on_request_failed(s, now, id, rng.below(2), null_mut()),
                6 => rp_on_abort_acked(s, now, id),
                7 => {
                    let mut r = RpRequestId::default();
                    match rp_poll_abort(s, now, &mut r) {
                        RP_OK => rp_on_abort_acked(s, now, r),
                        x => x,
                    }
                }
                8 => {
                    let mut d = [RpDispatch::default(); 4];
                    rp_poll_dispatch_batch(s, now, d.as_mut_ptr(), 4, &mut 0)
                }
                9 => {
                    let mut m = RpMicroBatch::default();
                    match rp_poll_micro_batch(s, now, &mut m) {
                        RP_OK => rp_on_micro_batch_consumed(s, now, null_mut()),
                        x => x,
                    }
                }
                10 => {
                    let mut k = 0;
                    match rp_poll_optimizer_step(s, now, &mut k) {
                        RP_OK => rp_on_optimizer_step_done(s, now),
                        x => x,
                    }
                }
                11 => rp_on_request_preempted(s, now, id, null_mut()),
                12 => rp_extend_group(s, now, id.group, rng.below(3) as u16),
                _ => rp_set_slots(s, now, rng.below(4) as u32),
            };
            assert_ne!(st, RP_ERR_PANIC, "call {i}: {}", message());
            assert!((RP_ERR_PANIC..=RP_EMPTY).contains(&st));
            seen[(st - RP_ERR_PANIC) as usize] += 1;
            assert_eq!(rp_audit(s), RP_OK, "after call {i}: {}", message());
        }
        let mut sum = RpStepSummary::default();
        let _ = rp_poll_step_done(s, &mut sum);
        rp_scheduler_free(s);
    }
    // The storm reached both accepted calls and refusals of several kinds.
    let idx = |code: RpStatus| (code - RP_ERR_PANIC) as usize;
    assert!(seen[idx(RP_OK)] > 1000, "{seen:?}");
    for code in [RP_ERR_ARG, RP_ERR_BEGIN, RP_ERR_REQUEST, RP_ERR_SLOTS] {
        assert!(seen[idx(code)] > 0, "no {code} in {seen:?}");
    }
}

#[test]
fn caller_owned_storage_runs_in_the_callers_memory_and_refuses_short_or_null_memory() {
    let need = rp_scheduler_storage_size(4, 16);
    assert!(need > 0);
    assert_eq!(rp_scheduler_storage_size(1 << 25, 1), 0, "refused capacity");
    let mut buf = vec![0u8; need + 7];
    // SAFETY (whole block): pointers are null on purpose or into `buf`, which outlives every
    // handle placed in it and is not touched while one lives.
    unsafe {
        let mut s = null_mut();
        let mem = buf.as_mut_ptr().add(3).cast::<std::ffi::c_void>();
        assert_eq!(
            rp_scheduler_new_in(mem, need - 1, 4, 16, &mut s),
            RP_ERR_ARG
        );
        assert!(message().contains(&format!("need {need}")), "{}", message());
        assert_eq!(
            rp_scheduler_new_in(null_mut(), need, 4, 16, &mut s),
            RP_ERR_NULL
        );
        assert_eq!(message(), "mem is null");
        assert_eq!(
            rp_scheduler_new_in(mem, need, 4, 16, null_mut()),
            RP_ERR_NULL
        );
        assert_eq!(
            rp_scheduler_new_in(mem, need, 1 << 25, 1, &mut s),
            RP_ERR_ARG
        );
        assert!(s.is_null(), "nothing written on refusal");

        assert_eq!(rp_scheduler_new_in(mem, need, 4, 16, &mut s), RP_OK);
        let (lo, hi) = (buf.as_ptr() as usize, buf.as_ptr() as usize + buf.len());
        assert!(
            (lo..hi).contains(&(s as usize)),
            "the handle lives in the caller's memory"
        );
        let mut plan = RpPlan::default();
        assert_eq!(rp_plan_default(2, 2, &mut plan), RP_OK);
        assert_eq!(rp_begin_step(s, 0, 0, 0, &plan), RP_OK);
        let mut n = 0u32;
        assert_eq!(rp_poll_draw(s, 0, &mut n), RP_OK);
        assert_eq!(rp_on_prompts_drawn(s, 0, n, 0, null_mut()), RP_OK);
        let mut c = RpCounters::default();
        assert_eq!(rp_counters(s, &mut c), RP_OK);
        assert_eq!(c.drawn, 2);
        assert_eq!(rp_audit(s), RP_OK);
        rp_scheduler_free(s); // ends the handle; `buf` is ours to free (Miri checks no double free)
    }
}

/// Rewards by group: `g % 3 == 0` all wrong, `1` all right, `2` alternating (variance).
fn c_reward(group: u32, sample: u16) -> f32 {
    match group % 3 {
        0 => 0.0,
        1 => 1.0,
        _ => (sample % 2) as f32,
    }
}

/// Drives one whole step through the C ABI under `policy` and returns every allocation
/// decision, the step's counters and the samples each drawn group ended with.
fn c_step_with(policy: &RpAllocPolicy, b: u32) -> (Vec<RpAllocated>, RpCounters, Vec<u32>) {
    let s = new_sched(16, 256);
    let mut decisions = Vec::new();
    let mut finished = std::collections::HashMap::<u32, u32>::new();
    // SAFETY (whole block): `s` is live until freed at the end; out-pointers are live locals.
    unsafe {
        let mut plan = RpPlan::default();
        assert_eq!(rp_plan_default(b, 8, &mut plan), RP_OK);
        plan.admission = RP_ADMIT_FRONTIER;
        plan.slots = 4;
        plan.max_groups = b;
        assert_eq!(
            rp_plan_apply_policy(policy, &mut plan),
            RP_OK,
            "{}",
            message()
        );
        assert_eq!(rp_begin_step(s, 0, 0, 0, &plan), RP_OK, "{}", message());
        let mut running: Vec<RpRequestId> = Vec::new();
        for t in 1..100_000u64 {
            let mut sum = RpStepSummary::default();
            if rp_poll_step_done(s, &mut sum) == RP_OK {
                let mut c = RpCounters::default();
                assert_eq!(rp_counters(s, &mut c), RP_OK);
                assert_eq!(rp_audit(s), RP_OK, "{}", message());
                rp_scheduler_free(s);
                let per_group = (0..c.drawn).map(|g| finished.get(&g).copied().unwrap_or(0));
                return (decisions, c, per_group.collect());
            }
            let mut n = 0u32;
            if rp_poll_draw(s, t, &mut n) == RP_OK {
                assert_eq!(rp_on_prompts_drawn(s, t, n, 0, null_mut()), RP_OK);
            }
            let mut a = RpAdmission::default();
            while rp_poll_admit(s, t, &mut a) == RP_OK {
                running.push(a.request);
            }
            // Finish the oldest running request per tick (deterministic).
            if !running.is_empty() {
                let x = running.remove(0);
                let r = c_reward(x.group, x.sample);
                assert_eq!(rp_on_request_finished(s, t, x, 0, 5, r, null_mut()), RP_OK);
                *finished.entry(x.group).or_default() += 1;
            }
            let mut al = RpAllocated::default();
            while rp_poll_allocation_with(s, t, policy, &mut al) == RP_OK {
                decisions.push(al);
            }
            let mut x = RpRequestId::default();
            while rp_poll_abort(s, t, &mut x) == RP_OK {
                running.retain(|r| r.group != x.group || r.sample != x.sample);
                assert_eq!(rp_on_abort_acked(s, t, x), RP_OK);
            }
            let mut d = RpDispatch::default();
            while rp_poll_dispatch(s, t, &mut d) == RP_OK {}
            let mut m = RpMicroBatch::default();
            while rp_poll_micro_batch(s, t, &mut m) == RP_OK {
                assert_eq!(rp_on_micro_batch_consumed(s, t, null_mut()), RP_OK);
            }
            let mut i = 0u32;
            if rp_poll_optimizer_step(s, t, &mut i) == RP_OK {
                assert_eq!(rp_on_optimizer_step_done(s, t), RP_OK);
            }
        }
    }
    panic!("the step did not end");
}

#[test]
fn vigor_through_c_extends_only_varying_groups_within_the_budget() {
    let b = 6;
    let policy = RpAllocPolicy {
        kind: RP_POLICY_VIGOR,
        n0: 4,
        rounds: 2,
        increment: 4,
        budget: 4 * 6 + 16,
        batch_groups: b,
        ..Default::default()
    };
    let (decisions, c, per_group) = c_step_with(&policy, b);
    assert_eq!(c.drawn, b, "VIGOR draws no replacements");
    let extended: Vec<u32> = decisions
        .iter()
        .filter(|d| d.applied == RP_ALLOC_EXTEND)
        .map(|d| d.group)
        .collect();
    assert!(!extended.is_empty(), "{decisions:?}");
    assert!(
        extended.iter().all(|g| g % 3 == 2),
        "only varying groups grow: {extended:?}"
    );
    let total: u32 = per_group.iter().sum();
    assert!(
        total <= 40,
        "{total} samples exceed the budget of 40: {per_group:?}"
    );
    for (g, &k) in per_group.iter().enumerate() {
        if g % 3 != 2 {
            assert_eq!(k, 4, "zero-variance group {g} kept n0");
        }
    }
    assert_eq!(c.trained, 2, "the two varying groups train");
}

#[test]
fn pilot_commit_through_c_commits_the_band_and_skips_the_rest() {
    let b = 3;
    let policy = RpAllocPolicy {
        kind: RP_POLICY_PILOT_COMMIT,
        n_pilot: 4,
        n_commit: 6,
        lower: 0.125,
        upper: 0.25,
        ..Default::default()
    };
    let (decisions, c, per_group) = c_step_with(&policy, b);
    for d in &decisions {
        match d.group % 3 {
            0 => assert_eq!(
                (d.applied, d.skip_reason),
                (RP_ALLOC_SKIP, RP_FILTER_SKIPPED_TOO_HARD)
            ),
            1 => assert_eq!(
                (d.applied, d.skip_reason),
                (RP_ALLOC_SKIP, RP_FILTER_SKIPPED_SOLVED)
            ),
            _ => match d.applied {
                RP_ALLOC_EXTEND => assert_eq!(d.extra, 6),
                a => assert_eq!(a, RP_ALLOC_COMMIT, "after the commit round"),
            },
        }
    }
    for (g, &k) in per_group.iter().enumerate() {
        assert_eq!(
            k,
            if g % 3 == 2 { 10 } else { 4 },
            "group {g}: {per_group:?}"
        );
    }
    assert!(c.filtered_skipped >= 2, "{c:?}");
    assert!(c.trained >= 1, "{c:?}");
}

#[test]
fn bad_policies_are_refused_with_the_parameter_named_and_nothing_changed() {
    // SAFETY (whole test): pointers are live locals or null on purpose.
    unsafe {
        let mut plan = RpPlan::default();
        assert_eq!(rp_plan_default(4, 8, &mut plan), RP_OK);
        let before = plan;
        let vigor = |n0, budget| RpAllocPolicy {
            kind: RP_POLICY_VIGOR,
            n0,
            rounds: 2,
            increment: 4,
            budget,
            batch_groups: 4,
            ..Default::default()
        };
        assert_eq!(
            rp_plan_apply_policy(&vigor(1, 64), &mut plan),
            RP_ERR_ALLOC_PARAM
        );
        assert!(message().contains("n0"), "{}", message());
        assert_eq!(
            rp_plan_apply_policy(&vigor(4, 15), &mut plan),
            RP_ERR_ALLOC_PARAM
        );
        assert!(message().contains("budget"), "{}", message());
        let pc = RpAllocPolicy {
            kind: RP_POLICY_PILOT_COMMIT,
            n_pilot: 4,
            n_commit: 4,
            lower: 0.5,
            upper: 1.5,
            ..Default::default()
        };
        assert_eq!(rp_plan_apply_policy(&pc, &mut plan), RP_ERR_ALLOC_PARAM);
        assert!(message().contains("upper"), "{}", message());
        let unknown = RpAllocPolicy {
            kind: 9,
            ..Default::default()
        };
        assert_eq!(
            rp_plan_apply_policy(&unknown, &mut plan),
            RP_ERR_ALLOC_PARAM
        );
        assert!(message().contains("unknown code 9"), "{}", message());
        assert_eq!(
            plan.group_size, before.group_size,
            "plan untouched on refusal"
        );
        assert!(!plan.hold_scored);
        assert_eq!(
            rp_plan_apply_policy(std::ptr::null(), &mut plan),
            RP_ERR_NULL
        );
        assert_eq!(rp_plan_apply_policy(&unknown, null_mut()), RP_ERR_NULL);

        // The same checks on the poll: refused, nothing polled.
        let s = new_sched(8, 64);
        assert_eq!(rp_begin_step(s, 0, 0, 0, &plan), RP_OK, "{}", message());
        let mut out = RpAllocated::default();
        assert_eq!(
            rp_poll_allocation_with(s, 1, &vigor(1, 64), &mut out),
            RP_ERR_ALLOC_PARAM
        );
        assert!(message().contains("n0"), "{}", message());
        assert_eq!(
            rp_poll_allocation_with(s, 1, std::ptr::null(), &mut out),
            RP_ERR_NULL
        );
        assert_eq!(message(), "policy is null");
        let fixed = RpAllocPolicy::default();
        assert_eq!(rp_poll_allocation_with(s, 1, &fixed, &mut out), RP_EMPTY);
        assert_eq!(rp_audit(s), RP_OK);
        rp_scheduler_free(s);
    }
}
