//! VIGOR and Pilot-Commit on the allocation seam, under random completion orders and every
//! admission × dispatch combination: the budget is never exceeded, conservation holds, every step
//! ends, the outcome is the same whatever order the rewards arrive in, and it matches a
//! straightforward reference of each policy.

use proptest::prelude::*;
use rolloutpipe_core::*;

/// Seeded SplitMix64, for completion orders.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A binary reward for sample `k` of prompt `g`: prompt difficulty varies with `g`.
fn reward(seed: u64, g: u32, k: u16) -> f32 {
    let mut r = Rng(seed ^ ((g as u64) << 20) ^ k as u64);
    let p = (g as u64 * 37 + seed) % 5; // success chance p/4: 0, .25, .5, .75, 1
    ((r.next() % 4 < p) as u8) as f32
}

struct Outcome {
    targets: Vec<u16>,
    states: Vec<GroupState>,
    dispatched: Vec<GroupId>,
    counters: Counters,
    max_samples: u64,
}

/// Runs one step; requests finish in an order drawn from `order_seed`.
fn run(
    plan: Plan,
    policy: &dyn Allocate,
    seed: u64,
    order_seed: u64,
    group_cap: usize,
    req_cap: usize,
) -> Outcome {
    let mut groups = vec![GroupSlot::EMPTY; group_cap];
    let mut reqs = vec![RequestSlot::EMPTY; req_cap];
    let mut s = Scheduler::new(&mut groups, &mut reqs);
    s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)
        .unwrap();
    let mut rng = Rng(order_seed);
    let mut running: Vec<RequestId> = Vec::new();
    let mut dispatched = Vec::new();
    let mut max_samples = 0;
    for t in 1..100_000 {
        let now = Tick(t);
        if let Some(sum) = s.poll_step_done() {
            let drawn = sum.counters.drawn;
            let targets = (0..drawn)
                .map(|g| s.group(GroupId(g)).unwrap().target)
                .collect();
            let states = (0..drawn)
                .map(|g| s.group(GroupId(g)).unwrap().state)
                .collect();
            return Outcome {
                targets,
                states,
                dispatched,
                counters: sum.counters,
                max_samples,
            };
        }
        if let Some(n) = s.poll_draw(now) {
            s.on_prompts_drawn(now, n).unwrap();
        }
        while let Some(a) = s.poll_admit(now) {
            running.push(a.request);
        }
        // Finish one random running request (or ack an abort) per tick.
        if !running.is_empty() {
            let x = running.swap_remove(rng.below(running.len()));
            let r = reward(seed, x.group.0, x.sample);
            s.on_request_finished(now, x, PolicyVersion(0), 5, r)
                .unwrap();
        }
        while let Some(_a) = s.poll_allocation_with(now, policy) {}
        while let Some(x) = s.poll_abort(now) {
            running.retain(|r| *r != x);
            s.on_abort_acked(now, x).unwrap();
        }
        while let Some(d) = s.poll_dispatch(now) {
            dispatched.push(d.group);
        }
        while s.poll_micro_batch(now).is_some() {
            s.on_micro_batch_consumed(now).unwrap();
        }
        if s.poll_optimizer_step(now).is_some() {
            s.on_optimizer_step_done(now).unwrap();
        }
        let used: u64 = (0..s.counters().drawn)
            .map(|g| s.group(GroupId(g)).unwrap().target as u64)
            .sum();
        max_samples = max_samples.max(used);
        assert!(s.counters().is_conserved());
        s.audit().unwrap();
    }
    panic!("step did not end: {:?}", s.counters());
}

fn plan_for(b: u32, admission: u8, sync: bool) -> Plan {
    let mut p = Plan::new(b, 2);
    p.slots = 3;
    p.admission = match admission {
        0 => AdmissionPolicy::Fifo {
            order: SubmitOrder::GroupMajor,
        },
        1 => AdmissionPolicy::Fifo {
            order: SubmitOrder::Shuffled { seed: 3 },
        },
        _ => AdmissionPolicy::Frontier {
            width: 0,
            expected_filter_ppm: 0,
            fallback: SubmitOrder::GroupMajor,
        },
    };
    p.dispatch = if sync {
        DispatchPolicy::Sync
    } else {
        DispatchPolicy::Pipelined
    };
    p
}

/// Population variance as a ranking key, as VIGOR rounds it.
fn var_key(xs: &[f32]) -> u64 {
    let n = xs.len() as f64;
    let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = xs.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    if var > 0.0 {
        (var * 1e9 + 0.5) as u64
    } else {
        0
    }
}

/// VIGOR written round by round over all B prompts at once (no over-drawing).
fn vigor_reference(seed: u64, b: u32, n0: u16, rounds: u16, inc: u16, budget: u32) -> Vec<u16> {
    let mut targets = vec![n0; b as usize];
    let mut used = n0 as u64 * b as u64;
    let per_round = if rounds == 0 {
        0
    } else {
        (budget as u64 - used) / rounds as u64 / inc as u64
    };
    let mut live: Vec<u32> = (0..b).collect();
    for _ in 0..rounds {
        let mut ranked: Vec<(u64, u32)> = live
            .iter()
            .map(|&g| {
                let xs: Vec<f32> = (0..targets[g as usize])
                    .map(|k| reward(seed, g, k))
                    .collect();
                (var_key(&xs), g)
            })
            .filter(|&(v, _)| v > 0)
            .collect();
        ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut next = Vec::new();
        for &(_, g) in ranked.iter().take(per_round as usize) {
            if used + inc as u64 > budget as u64 {
                break;
            }
            used += inc as u64;
            targets[g as usize] += inc;
            next.push(g);
        }
        live = next;
    }
    targets
}

/// `cargo test` runs the default 256; CI raises PROPTEST_CASES (scripts/ci.d/core.sh); Miri runs
/// a couple so the whole suite stays within minutes.
fn cases() -> u32 {
    if cfg!(miri) {
        return 2;
    }
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn vigor_stays_in_budget_and_matches_the_round_by_round_reference(
        seed in 0u64..1_000,
        order in any::<u64>(),
        b in 2u32..7,
        n0 in 2u16..5,
        rounds in 0u16..4,
        inc in 1u16..4,
        extra in 0u32..40,
        admission in 0u8..3,
        sync in any::<bool>(),
    ) {
        let budget = n0 as u32 * b + extra;
        let v = Vigor::new(n0, rounds, inc, budget, b).unwrap();
        let mut plan = plan_for(b, admission, sync);
        plan.max_groups = b;
        v.configure(&mut plan);
        let out = run(plan, &v, seed, order, 8, 256);
        prop_assert!(out.max_samples <= budget as u64);
        prop_assert!(out.counters.is_conserved());
        prop_assert_eq!(out.counters.drawn, b);
        let want = vigor_reference(seed, b, n0, rounds, inc, budget);
        prop_assert_eq!(&out.targets, &want);
        // Deterministic given the same rewards: another completion order, the same result.
        let again = run(plan, &v, seed, order ^ 0xABCD, 8, 256);
        prop_assert_eq!(&again.targets, &out.targets);
        prop_assert_eq!(&again.states, &out.states);
        // Every trainable group was dispatched, each once.
        let mut d = out.dispatched.clone();
        d.sort();
        d.dedup();
        prop_assert_eq!(d.len(), out.dispatched.len());
        prop_assert_eq!(d.len() as u32, out.counters.trained);
    }

    #[test]
    fn pilot_commit_keeps_the_band_skips_and_defers_the_rest(
        seed in 0u64..1_000,
        order in any::<u64>(),
        b in 1u32..5,
        over in 0u32..6,
        n_pilot in 2u16..6,
        n_commit in 2u16..6,
        admission in 0u8..3,
        sync in any::<bool>(),
    ) {
        let pc = PilotCommit::new(n_pilot, n_commit, 0.125, 0.25).unwrap();
        let mut plan = plan_for(b, admission, sync);
        plan.max_groups = b + over;
        pc.configure(&mut plan);
        let out = run(plan, &pc, seed, order, 16, 512);
        prop_assert!(out.counters.is_conserved());
        for (g, (&t, &st)) in out.targets.iter().zip(&out.states).enumerate() {
            let pilot: Vec<f32> = (0..n_pilot).map(|k| reward(seed, g as u32, k)).collect();
            let p = pilot.iter().map(|&x| x as f64).sum::<f64>() / n_pilot as f64;
            match st {
                // Aborted when the batch filled first: no verdict needed.
                GroupState::Aborted => {}
                GroupState::Filtered(FilterReason::Skipped(r)) => {
                    prop_assert_eq!(t, n_pilot);
                    let want = if p == 1.0 {
                        SkipReason::Solved
                    } else if p > 0.75 {
                        SkipReason::TooEasy
                    } else {
                        SkipReason::TooHard
                    };
                    prop_assert!(!(0.125..=0.75).contains(&p), "g{} p={} skipped", g, p);
                    prop_assert_eq!(r, want);
                }
                _ => {
                    // Kept: in the band, and committed with n_commit more samples.
                    prop_assert!((0.125..=0.75).contains(&p), "g{} p={} kept as {:?}", g, p, st);
                    prop_assert_eq!(t, n_pilot + n_commit);
                }
            }
        }
        // Deterministic given the same rewards: another completion order decides every prompt
        // both runs decided the same way (which over-drawn prompts the filled batch aborts
        // before their verdict depends on timing, not on the policy).
        let again = run(plan, &pc, seed, order ^ 0x1234, 16, 512);
        for g in 0..out.states.len().min(again.states.len()) {
            if out.states[g] != GroupState::Aborted && again.states[g] != GroupState::Aborted {
                prop_assert_eq!(again.states[g], out.states[g], "g{}", g);
                prop_assert_eq!(again.targets[g], out.targets[g], "g{}", g);
            }
        }
        prop_assert_eq!(again.counters.trained, out.counters.trained);
    }

    /// With a step budget, a kept prompt's commit is reserved before another pilot is drawn (as
    /// the public code commits to every kept prompt of its over-drawn set): a prompt drawn
    /// beyond the first B, or among the first `K = (budget − B × n_pilot) / n_commit` of them,
    /// never trains on its pilot alone. Only a prompt of the first B drawn when the budget could
    /// not also hold its commit may. The budget holds, and every prompt decided in two runs of
    /// different completion orders is decided the same way.
    #[test]
    fn pilot_commit_reserves_the_commit_of_every_kept_prompt(
        seed in 0u64..1_000,
        order in any::<u64>(),
        b in 1u32..5,
        over in 0u32..8,
        n_pilot in 2u16..6,
        n_commit in 2u16..6,
        extra in 0u32..40,
        draw_batch in 1u32..5,
        draw_ahead in 0u32..3,
        admission in 0u8..3,
        sync in any::<bool>(),
    ) {
        let budget = b * n_pilot as u32 + extra;
        let pc = PilotCommit::new(n_pilot, n_commit, 0.125, 0.25).unwrap();
        let mut plan = plan_for(b, admission, sync);
        plan.max_groups = b + over;
        plan.draw_batch = draw_batch;
        plan.draw_ahead = draw_ahead;
        plan.sample_budget = budget;
        pc.configure(&mut plan);
        let out = run(plan, &pc, seed, order, 16, 512);
        prop_assert!(out.max_samples <= budget as u64, "{} > {}", out.max_samples, budget);
        prop_assert!(out.counters.is_conserved());
        let k = (budget - b * n_pilot as u32) / n_commit as u32;
        let reserved = |g: u32| g >= b || g < k;
        let kept = |g: u32| {
            let p = (0..n_pilot).map(|j| reward(seed, g, j) as f64).sum::<f64>() / n_pilot as f64;
            (0.125..=0.75).contains(&p)
        };
        for (g, (&t, &st)) in out.targets.iter().zip(&out.states).enumerate() {
            let g = g as u32;
            if st == GroupState::Aborted || !kept(g) {
                continue;
            }
            if reserved(g) {
                prop_assert_eq!(t, n_pilot + n_commit, "kept g{} ({:?}) trained on its pilot alone", g, st);
            } else {
                prop_assert!(t == n_pilot || t == n_pilot + n_commit, "g{} target {}", g, t);
            }
        }
        let again = run(plan, &pc, seed, order ^ 0x5A5A, 16, 512);
        for g in 0..out.states.len().min(again.states.len()) {
            let (a, z) = (out.states[g], again.states[g]);
            if a != GroupState::Aborted && z != GroupState::Aborted && reserved(g as u32) {
                prop_assert_eq!(a, z, "g{}", g);
                prop_assert_eq!(out.targets[g], again.targets[g], "g{}", g);
            }
        }
    }
}

#[test]
fn bad_parameters_name_the_parameter() {
    let e = |r: Result<Vigor, AllocParamError>| r.unwrap_err().to_string();
    assert_eq!(
        e(Vigor::new(1, 2, 2, 100, 4)),
        "n0 is 1, must be at least 2"
    );
    assert_eq!(
        e(Vigor::new(4, 2, 0, 100, 4)),
        "increment is 0, must be at least 1"
    );
    assert_eq!(
        e(Vigor::new(4, 2, 2, 15, 4)),
        "budget 15 is below n0 × batch_groups = 16 samples"
    );
    let e = |r: Result<PilotCommit, AllocParamError>| r.unwrap_err().to_string();
    assert_eq!(
        e(PilotCommit::new(4, 1, 0.1, 0.2)),
        "n_commit is 1, must be at least 2"
    );
    assert_eq!(
        e(PilotCommit::new(4, 4, -0.1, 0.2)),
        "lower is -0.1, must be within [0, 1]"
    );
    assert_eq!(
        e(PilotCommit::new(4, 4, 0.1, f32::NAN)),
        "upper is NaN, must be within [0, 1]"
    );
    assert_eq!(
        e(PilotCommit::new(4, 4, 0.8, 0.5)),
        "lower 0.8 is above 1 - upper 0.5: no prompt would be kept"
    );
}

/// VIGOR spends the extra budget where the variance is: the all-wrong and all-right prompts keep
/// n0, the mixed ones grow, and the total is exactly the budget.
#[test]
fn vigor_spends_the_budget_on_the_varying_prompts() {
    // Seed 0: prompt g succeeds with chance ((37 g) % 5) / 4.
    let b = 5;
    let v = Vigor::new(4, 2, 4, 4 * 5 + 16, b).unwrap();
    let mut plan = plan_for(b, 2, false);
    plan.max_groups = b;
    v.configure(&mut plan);
    let out = run(plan, &v, 0, 7, 8, 256);
    assert_eq!(out.targets, vigor_reference(0, b, 4, 2, 4, 36));
    assert!(out.targets.iter().map(|&t| t as u64).sum::<u64>() <= 36);
    for (g, &t) in out.targets.iter().enumerate() {
        let xs: Vec<f32> = (0..4).map(|k| reward(0, g as u32, k)).collect();
        if var_key(&xs) == 0 {
            assert_eq!(t, 4, "zero-variance prompt {g} got extra samples");
        }
    }
    assert!(out.targets.iter().any(|&t| t > 4), "{:?}", out.targets);
}
