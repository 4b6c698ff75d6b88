//! Simulator integration tests: determinism, conservation, the closed-form sync step, and the
//! orderings the modes must respect on identical samples.
use rolloutpipe_harness::sim::config::{Mode, Schedule, SimConfig};
use rolloutpipe_harness::sim::simulate;

/// A trivial workload: constant lengths (sigma 0, no runaways), rewards 1,0,1,0 so no group is
/// filtered, everything admitted at once (32 requests, 32 slots), KV never binding.
fn trivial() -> SimConfig {
    let layer = r#"
[run]
steps = 2
profiles = ["flat"]
settings = ["T"]
modes = ["sync", "cgp", "rolloutpipe", "one-step-off"]
trace_step = 0

[rollout]
engines = 2
kv_new_token_ratio = 0.0

[profile.flat]
label = "constant"
prompt_tokens = 100
mean_tokens_start = 500
mean_tokens_late = 500
sigma = 0.0
runaway = 0.0
acc_start = 0.5
acc_late = 0.5
beta_k = 1.5
wrong_length_factor = 1.0
alternate_rewards = true

[setting.T]
batch = 8
group = 4
cap = 1024
max_running = 16
micro_batch = 2
draw_batch = 8
opt_steps = 1
"#;
    SimConfig::load(&[("trivial".into(), layer.into())], &[]).unwrap()
}

fn small(profile: &str, setting: &str) -> SimConfig {
    SimConfig::load(
        &[],
        &[
            "run.steps=3".into(),
            format!("run.profiles=[\"{profile}\"]"),
            format!("run.settings=[\"{setting}\"]"),
        ],
    )
    .unwrap()
}

#[test]
fn sync_step_time_matches_closed_form() {
    let cfg = trivial();
    let r = simulate(&cfg, "flat", "T", Mode::Sync, false)
        .unwrap()
        .result;
    let ro = &cfg.rollout;
    let tr = &cfg.trainer;
    // Each engine runs 16 requests together: one prefill of 16 x 100 tokens, then 500 decode
    // iterations with B = 16 and K = 1600 + 16 i resident tokens.
    let (b, p, l) = (16.0, 100.0, 500.0);
    let prefill = b * p / ro.prefill_tok_per_s;
    let decode: f64 = (0..500)
        .map(|i| {
            (ro.decode_base_ms
                + ro.decode_per_seq_ms * b
                + ro.decode_per_kilo_kv_ms * (b * p + b * f64::from(i)) / 1000.0)
                * 1e-3
        })
        .sum();
    let rollout = prefill + decode + ro.verifier_latency_s;
    // Four micro-batches of 2 groups x 4 responses x (100 + 500) tokens on 2 GPUs.
    let gpus = f64::from(tr.gpus);
    let tokens = 2.0 * 4.0 * (p + l);
    let mb = tr.micro_batch_overhead_s
        + tokens / (tr.fwd_bwd_tok_per_s_per_gpu * gpus)
        + tokens * f64::from(tr.logprob_passes) / (tr.logprob_tok_per_s_per_gpu * gpus);
    // Slime aborts the (empty) surplus, then ships the batch group by group; the first
    // micro-batch waits for its two groups' data.
    let transfer_group = tr.data_transfer_s_per_mtok * 4.0 * (p + l) * 1e-6;
    let handoff = ro.abort_s + 2.0 * transfer_group;
    let expected = rollout + handoff + 4.0 * mb + tr.optimizer_step_s;
    for s in &r.steps {
        assert!(
            (s.rollout() - rollout).abs() < 1e-6,
            "rollout {} vs {rollout}",
            s.rollout()
        );
        assert!(
            (s.r2t() - expected).abs() < 1e-6,
            "step {}: r2t {} vs closed form {expected}",
            s.step,
            s.r2t()
        );
        assert_eq!(
            (s.drawn, s.trained, s.filtered, s.aborted_groups),
            (8, 8, 0, 0)
        );
        assert_eq!(s.tokens_generated, 32 * 500);
    }
    // The second step starts after the first one's train end plus the weight sync.
    let gap = r.steps[1].rollout_start - r.steps[0].train_end;
    assert!((gap - tr.weight_sync_s).abs() < 1e-6, "gap {gap}");
    // Every group materializes at the same instant, so even the ideal schedule must run all
    // four micro-batches after the rollout: the bound is the sync step without Slime's abort
    // and hand-off.
    assert!((r.mean_ideal() - (expected - handoff)).abs() < 1e-6);
    // Slime's wait_time_ratio spans train end to train end, weight sync included.
    let s1 = &r.steps[1];
    let slime = 1.0 - s1.trainer_busy / (s1.train_end - r.steps[0].train_end);
    assert!((s1.slime_wait_ratio() - slime).abs() < 1e-9);
    assert!(s1.slime_wait_ratio() > s1.wait_ratio());
}

#[test]
fn pipelining_trivial_workload_reaches_the_ideal_bound() {
    // Every group completes at the same instant, so CGP cannot start earlier than sync: the
    // on-policy modes agree except for Slime's abort before the hand-off, which only sync
    // waits for; one-step-off overlaps whole steps.
    let cfg = trivial();
    let sync = simulate(&cfg, "flat", "T", Mode::Sync, false)
        .unwrap()
        .result;
    let cgp = simulate(&cfg, "flat", "T", Mode::Cgp, false)
        .unwrap()
        .result;
    let rp = simulate(&cfg, "flat", "T", Mode::Rolloutpipe, false)
        .unwrap()
        .result;
    let abort = cfg.rollout.abort_s;
    assert!((sync.mean_r2t() - abort - cgp.mean_r2t()).abs() < 1e-6);
    assert_eq!(cgp.mean_r2t(), rp.mean_r2t());
    let off = simulate(&cfg, "flat", "T", Mode::OneStepOff, false)
        .unwrap()
        .result;
    assert_eq!(off.steps[0].staleness, 0);
    assert_eq!(off.steps[1].staleness, 1);
}

#[test]
fn same_seed_gives_identical_summary_and_another_seed_does_not() {
    let cfg = small("math", "R1");
    for mode in [Mode::Sync, Mode::Rolloutpipe, Mode::OneStepOff] {
        let a = simulate(&cfg, "math", "R1", mode, false).unwrap().result;
        let b = simulate(&cfg, "math", "R1", mode, false).unwrap().result;
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&b).unwrap(),
            "{mode}"
        );
    }
    let mut other = cfg.clone();
    other.run.seed += 1;
    let a = simulate(&cfg, "math", "R1", Mode::Sync, false)
        .unwrap()
        .result;
    let c = simulate(&other, "math", "R1", Mode::Sync, false)
        .unwrap()
        .result;
    assert_ne!(a.mean_r2t(), c.mean_r2t());
}

#[test]
fn every_drawn_prompt_is_accounted_for() {
    // Competition math early: about 45% of groups are all wrong or all right, so the core
    // over-samples, filters and aborts surplus groups.
    for setting in ["R1", "R3"] {
        let cfg = small("math", setting);
        let b = cfg.setting[setting].batch;
        for mode in [Mode::Sync, Mode::Cgp, Mode::Rolloutpipe, Mode::OneStepOff] {
            let r = simulate(&cfg, "math", setting, mode, false).unwrap().result;
            assert!(r.conserved, "{setting}/{mode}: core conservation");
            let mut filtered = 0;
            for s in &r.steps {
                assert_eq!(s.trained, b, "{setting}/{mode} step {}", s.step);
                assert_eq!(
                    s.drawn,
                    s.trained + s.filtered + s.aborted_groups,
                    "{setting}/{mode} step {}",
                    s.step
                );
                assert_eq!(s.group_completion.len(), b as usize);
                filtered += s.filtered;
            }
            assert!(
                filtered > 0,
                "{setting}/{mode}: the workload should filter some groups"
            );
        }
    }
}

#[test]
fn pipelining_never_hurts_on_identical_samples() {
    // Sync and CGP share admission (FIFO), so their rollouts are identical and CGP only moves
    // training earlier.
    let cfg = small("logic", "R2");
    let sync = simulate(&cfg, "logic", "R2", Mode::Sync, false)
        .unwrap()
        .result;
    let cgp = simulate(&cfg, "logic", "R2", Mode::Cgp, false)
        .unwrap()
        .result;
    for (s, c) in sync.steps.iter().zip(&cgp.steps) {
        assert!((s.rollout() - c.rollout()).abs() < 1e-6, "rollouts differ");
        assert!(
            c.r2t() < s.r2t(),
            "step {}: cgp {} vs sync {}",
            s.step,
            c.r2t(),
            s.r2t()
        );
        assert!(c.r2t() >= s.ideal() - 1e-6, "cgp beat the ideal bound");
        assert!(c.wait_ratio() < s.wait_ratio());
    }
}

#[test]
fn recording_covers_the_trace_step() {
    let cfg = small("gsm8k", "R1");
    let sim = simulate(&cfg, "gsm8k", "R1", Mode::Rolloutpipe, true).unwrap();
    let step = u64::from(cfg.run.trace_step);
    let n = sim
        .recording
        .requests
        .iter()
        .filter(|q| q.step == step)
        .count();
    let s = &sim.result.steps[step as usize];
    // Every request of the step ran once (no faults): G per drawn group, minus never-admitted
    // requests of aborted groups.
    assert!(n >= (s.trained * 8) as usize, "{n} request spans");
    assert!(n <= (s.drawn * 8) as usize);
    assert!(
        sim.recording
            .trainer
            .iter()
            .any(|t| t.0 == step && t.1 == "optimizer")
    );
}

#[test]
fn tail_multiplexing_moves_the_bound_and_stays_on_policy() {
    // All groups complete together, so CGP equals the bound; idle engines then take the
    // log-prob passes of the groups the trainer has not reached, and the step ends earlier
    // than the bound given this rollout, with the same rollout and version.
    let cfg = trivial();
    let cgp = simulate(&cfg, "flat", "T", Mode::Cgp, false)
        .unwrap()
        .result;
    let mux = simulate(&cfg, "flat", "T", Schedule::CGP_MUX, true).unwrap();
    for (c, m) in cgp.steps.iter().zip(&mux.result.steps) {
        assert!((c.rollout() - m.rollout()).abs() < 1e-6, "rollouts differ");
        assert_eq!(m.staleness, 0);
        assert_eq!((m.trained, m.drawn), (c.trained, c.drawn));
        assert!(m.mux_groups > 0, "no group was multiplexed");
        assert!(
            m.r2t() < c.r2t() - 0.05,
            "step {}: mux {} vs cgp {}",
            m.step,
            m.r2t(),
            c.r2t()
        );
        assert!(m.r2t() < c.ideal(), "the bound did not move");
        // The trainer saved exactly the log-prob passes of the multiplexed groups.
        assert!(m.trainer_busy < c.trainer_busy);
    }
    assert!(!mux.recording.mux.is_empty());
    assert!(mux.result.conserved);
}

#[test]
fn migration_moves_tail_requests_without_failing_them() {
    // Competition math at an 8k cap: long, heavy-tailed responses leave a tail on the engines.
    let cfg = small("math", "R2");
    let cgp = simulate(&cfg, "math", "R2", Mode::Cgp, false)
        .unwrap()
        .result;
    let mig = simulate(&cfg, "math", "R2", Schedule::CGP_MIGRATE, true).unwrap();
    let moved: u32 = mig.result.steps.iter().map(|s| s.migrations).sum();
    assert!(moved > 0, "no request migrated");
    assert_eq!(mig.recording.migrations.len() as u32, moved);
    assert!(mig.result.conserved);
    for (c, m) in cgp.steps.iter().zip(&mig.result.steps) {
        // Moves are not failures: every group is trained or accounted for as before.
        assert_eq!(m.trained, c.trained);
        assert_eq!(m.drawn, m.trained + m.filtered + m.aborted_groups);
        assert_eq!(m.staleness, 0);
    }
    // Every move is a request that had generated at least the threshold, from a batch more than
    // twice the receiver's.
    let min = cfg.policy.migrate_min_generated;
    for m in &mig.recording.migrations {
        assert!(m.6 >= min, "moved a request with {} tokens", m.6);
        assert_ne!(m.3, m.4);
    }
}

#[test]
fn cache_aware_routing_keeps_a_group_on_one_engine() {
    let cfg = trivial();
    let sim = simulate(&cfg, "flat", "T", Mode::Sync, true).unwrap();
    let mut home = std::collections::HashMap::new();
    for q in sim.recording.requests.iter().filter(|q| q.step == 0) {
        let e = *home.entry(q.group).or_insert(q.engine);
        assert_eq!(e, q.engine, "group {} split across engines", q.group);
    }
    // ... and the least-loaded choice for new prompts spreads groups over both engines.
    let engines: std::collections::HashSet<u16> = home.values().copied().collect();
    assert_eq!(engines.len(), 2);
}
