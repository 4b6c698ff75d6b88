//! Simulator integration tests: determinism, conservation, the closed-form sync step, and the
//! orderings the modes must respect on identical samples.
use rolloutpipe_harness::sim::config::{Mode, SimConfig};
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
    let expected = rollout + 4.0 * mb + tr.optimizer_step_s;
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
    // four micro-batches after the rollout: the bound equals the sync step.
    assert!((r.mean_ideal() - expected).abs() < 1e-6);
}

#[test]
fn pipelining_trivial_workload_reaches_the_ideal_bound() {
    // Every group completes at the same instant, so CGP cannot start earlier than sync: the
    // three on-policy modes must agree exactly, and one-step-off overlaps whole steps.
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
    assert_eq!(sync.mean_r2t(), cgp.mean_r2t());
    assert_eq!(sync.mean_r2t(), rp.mean_r2t());
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
