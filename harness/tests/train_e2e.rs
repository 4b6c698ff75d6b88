//! End-to-end runs of `rolloutpipe train` on a tiny model: every mode, the equivalence
//! property, on-policy versions, an injected engine failure, and resume.
mod support;
use std::path::PathBuf;

use rolloutpipe_backends::Weights;
use rolloutpipe_harness::train::{Mode, RunOutcome, TrainConfig, run};

/// A run that takes about a second ([`TrainConfig::tiny`], seeds 3): a 1-layer model
/// warm-started on 1-digit addition so that groups have mixed rewards, 4 groups of 4 per step,
/// 2 engines of 4 slots (fewer slots than requests, so admission order matters), a checkpoint
/// every step; `extra` holds `;`-separated overrides.
fn tiny(mode: Mode, steps: u32, extra: &str) -> TrainConfig {
    let (steps, mode_set) = (
        format!("run.steps={steps}"),
        format!("run.mode={}", mode.name()),
    );
    let mut cfg = TrainConfig::tiny()
        .set(&[
            &steps,
            &mode_set,
            "run.test_problems=24",
            "run.checkpoint_every=1",
        ])
        .unwrap();
    if !extra.is_empty() {
        let sets: Vec<String> = extra.split(';').map(str::to_owned).collect();
        cfg = cfg.with_overrides(&sets).unwrap();
    }
    if mode == Mode::OneStepOff {
        cfg.rl.old_logprobs = rolloutpipe_harness::train::config::OldLogprobs::Rollout;
    }
    cfg.validate().unwrap();
    cfg
}

fn dir(name: &str) -> PathBuf {
    support::train::scratch("train", name)
}

fn dir_of(o: &RunOutcome) -> PathBuf {
    o.dir.clone()
}

fn go(cfg: &TrainConfig, name: &str) -> RunOutcome {
    run(cfg, &dir(name), false).unwrap()
}

/// Every drawn prompt ends trained, filtered or aborted; full batches train B groups.
fn check_accounting(o: &RunOutcome, b: u32) {
    for (i, c) in o.counters.iter().enumerate() {
        assert!(c.is_conserved(), "step {i}: {c:?}");
        assert_eq!(
            c.drawn,
            c.trained + c.filtered() + c.aborted,
            "step {i}: {c:?}"
        );
        assert_eq!(c.in_progress(), 0, "step {i}");
        assert!(c.trained <= b);
    }
}

fn max_diff(a: &Weights, b: &Weights) -> (f64, f64) {
    let (mut max, mut sq) = (0.0f64, 0.0f64);
    for (name, ta) in &a.tensors {
        let tb = &b.tensors[name];
        for (x, y) in ta.data.iter().zip(&tb.data) {
            let d = (*x as f64 - *y as f64).abs();
            max = max.max(d);
            sq += d * d;
        }
    }
    (max, sq.sqrt())
}

fn norm_delta(a: &Weights, b: &Weights) -> f64 {
    max_diff(a, b).1
}

#[test]
fn every_mode_runs_end_to_end_and_stays_on_policy() {
    for mode in [Mode::Sync, Mode::Cgp, Mode::Rolloutpipe, Mode::OneStepOff] {
        let cfg = tiny(mode, 2, "");
        let o = go(&cfg, mode.name());
        assert_eq!(o.metrics.len(), 2, "{mode}");
        assert_eq!(o.counters.len(), 2, "{mode}");
        check_accounting(&o, 4);
        let trained: u32 = o.counters.iter().map(|c| c.trained).sum();
        assert!(trained > 0, "{mode}: nothing trained");
        assert_eq!(
            o.trained.len() as u32,
            trained * 4,
            "{mode}: 4 samples per trained group"
        );
        for m in &o.metrics {
            assert!(
                m.timing.rollout_to_train_end_s > 0.0
                    && m.timing.rollout_to_train_end_s >= m.rollout_s
            );
            assert!((0.0..=1.0).contains(&m.timing.trainer_wait_ratio));
            assert!(m.loss.is_finite() && m.grad_norm.is_finite());
            // The metrics shared with `simulate` (driver::metrics), by hand.
            let bound = m
                .timing
                .ideal_s
                .max(m.timing.first_micro_batch_ready_s + m.train_busy_s);
            assert!((m.timing.bound_s - bound).abs() < 1e-9, "{mode}: {m:?}");
            // Group times are read from an Instant, the rollout from the core's ticks: 1 ms slack.
            assert!(m.timing.first_micro_batch_ready_s > 0.0);
            assert!(
                m.timing.first_micro_batch_ready_s <= m.rollout_s + 1e-3,
                "{mode}: {m:?}"
            );
            assert!(
                (0.0..1.0).contains(&m.timing.slime_wait_ratio),
                "{mode}: {m:?}"
            );
            if mode != Mode::OneStepOff {
                // Slime's window (from the previous train end) holds the in-window one's work.
                assert!(
                    m.timing.slime_wait_ratio >= m.timing.trainer_wait_ratio - 1e-9,
                    "{mode}: {m:?}"
                );
            }
            assert!(
                m.timing.slot_occupancy > 0.0 && m.timing.slot_occupancy <= 1.0,
                "{mode}: {m:?}"
            );
            assert!(
                (0.0..=m.timing.rollout_to_train_end_s).contains(&m.timing.rollout_idle_s),
                "{mode}: {m:?}"
            );
            assert!(m.rollouts > 0);
        }
        let lines = std::fs::read_to_string(o.dir.join("metrics.jsonl")).unwrap();
        assert_eq!(lines.lines().count(), 2);
        for f in [
            "config.toml",
            "trace.json",
            "learning_curves.svg",
            "step_times.svg",
            "checkpoints/latest",
            "final/model.safetensors",
        ] {
            assert!(o.dir.join(f).exists(), "{mode}: {f} missing");
        }
        if mode == Mode::OneStepOff {
            // Step 0 trains v0's samples from v0; step 1 trains v0's samples from v1.
            for r in &o.trained {
                assert_eq!(r.version, r.step.saturating_sub(1), "{r:?}");
                assert_eq!(r.rollout_step, r.step);
            }
        } else {
            // On-policy: every trained sample was generated by the weights of its step.
            for r in &o.trained {
                assert_eq!(r.version, r.step, "{mode}: {r:?}");
                assert_eq!(r.rollout_step, r.step);
            }
        }
    }
}

#[test]
fn pipelined_step_equals_sync_step_on_the_same_samples() {
    // m = 1: the pipelined trainer runs one micro-batch per group as it completes, the sync one
    // the same groups after the batch is final, in materialization order.
    let sync = go(&tiny(Mode::Sync, 1, ""), "eq-sync");
    let pipe = go(&tiny(Mode::Rolloutpipe, 1, ""), "eq-pipe");
    let key = |o: &RunOutcome| {
        let mut v: Vec<(u32, u16)> = o.trained.iter().map(|r| (r.group, r.sample)).collect();
        v.sort();
        v
    };
    assert_eq!(
        key(&sync),
        key(&pipe),
        "both modes trained the same samples"
    );
    assert!(!sync.trained.is_empty());
    let start = rolloutpipe_backends::load_model_dir(&sync.dir.join("sft"))
        .unwrap()
        .1;
    let step = norm_delta(&start, &sync.weights);
    let (max, l2) = max_diff(&sync.weights, &pipe.weights);
    assert!(step > 1e-4, "the step moved the weights ({step})");
    // Only the summation order differs (f32); relative to the step itself that is tiny.
    assert!(
        l2 <= 1e-3 * step,
        "pipelined vs sync: L2 {l2:e}, max {max:e}, step {step:e}"
    );
}

#[test]
fn failed_engine_requests_are_readmitted_and_every_prompt_is_accounted_for() {
    let cfg = tiny(Mode::Rolloutpipe, 2, "fault.fail_engine_at_request=3");
    let o = go(&cfg, "fault");
    check_accounting(&o, 4);
    let failed: u64 = o.counters.iter().map(|c| c.requests_failed).sum();
    assert!(failed >= 1, "the injected failure lost requests");
    assert!(o.metrics.iter().any(|m| m.requests_failed >= 1));
    // The step with the failure still trained a batch, on-policy.
    assert!(o.counters[0].trained > 0);
    for r in &o.trained {
        assert_eq!(r.version, r.step);
    }
}

#[test]
fn resumed_run_ends_where_an_uninterrupted_one_does() {
    // Sync with one micro-batch per step and no surplus draws: what trains is independent of
    // thread timing, so two runs with the same seed agree exactly.
    let extra = "rl.micro_batch=4";
    let full = go(&tiny(Mode::Sync, 3, extra), "resume-full");
    let d = dir("resume-part");
    let first = run(&tiny(Mode::Sync, 2, extra), &d, false).unwrap();
    assert_eq!(first.metrics.len(), 2);
    // Without --resume the directory is refused, so nothing is overwritten.
    let err = run(&tiny(Mode::Sync, 3, extra), &d, false).unwrap_err();
    assert!(err.to_string().contains("--resume"), "{err}");
    let resumed = run(&tiny(Mode::Sync, 3, extra), &d, true).unwrap();
    assert_eq!(resumed.metrics.len(), 1);
    assert_eq!(resumed.metrics[0].step, 2);
    let (max, _) = max_diff(&full.weights, &resumed.weights);
    assert!(max <= 1e-6, "resumed run differs by {max:e}");
    let all = rolloutpipe_harness::train::read_metrics(&d).unwrap();
    assert_eq!(all.iter().map(|m| m.step).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(all[2].reward, full.metrics[2].reward);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let mut cfg = tiny(Mode::Sync, 1, "");
    cfg.model.dir = PathBuf::from("/nonexistent/model");
    let err = run(&cfg, &dir("bad-model"), false).unwrap_err();
    assert!(format!("{err:#}").contains("/nonexistent/model"), "{err:#}");

    let cfg = tiny(Mode::Sync, 1, "");
    let mut bad = cfg.clone();
    bad.task.name = "division".into();
    let err = run(&bad, &dir("bad-task"), false).unwrap_err();
    assert!(format!("{err:#}").contains("unknown task"), "{err:#}");

    // A broken checkpoint is reported and left in place.
    let d = dir("bad-ckpt");
    run(&cfg, &d, false).unwrap();
    let ck = d.join("checkpoints/step-000001/state.json");
    std::fs::write(&ck, "{not json").unwrap();
    let mut more = cfg.clone();
    more.run.steps = 2;
    let err = run(&more, &d, true).unwrap_err();
    assert!(format!("{err:#}").contains("state.json"), "{err:#}");
    assert!(d.join("checkpoints/step-000001/model.safetensors").exists());

    #[cfg(not(feature = "wgpu"))]
    {
        let mut w = cfg.clone();
        w.run.backend = "wgpu".into();
        let err = run(&w, &dir("no-wgpu"), false).unwrap_err();
        assert!(format!("{err:#}").contains("not built"), "{err:#}");
    }
}

#[test]
fn one_step_off_resumes_with_its_untrained_batch() {
    // The checkpoint of a one-step-off run holds the rolled-out batch that has not trained yet;
    // a resumed run trains it first and ends where the uninterrupted run does.
    let extra = "rl.micro_batch=4";
    let full = go(&tiny(Mode::OneStepOff, 3, extra), "oso-full");
    let d = dir("oso-part");
    run(&tiny(Mode::OneStepOff, 2, extra), &d, false).unwrap();
    let resumed = run(&tiny(Mode::OneStepOff, 3, extra), &d, true).unwrap();
    let (max, _) = max_diff(&full.weights, &resumed.weights);
    assert!(max <= 1e-6, "resumed one-step-off run differs by {max:e}");
    let all = rolloutpipe_harness::train::read_metrics(&d).unwrap();
    assert_eq!(all.iter().map(|m| m.step).collect::<Vec<_>>(), [0, 1, 2]);
    // The boundary step (rolled out before the stop, trained after the resume) keeps the
    // rollout half of its line: not zeros.
    let full_m = rolloutpipe_harness::train::read_metrics(&dir_of(&full)).unwrap();
    assert!(all[1].tokens > 0, "{:?}", all[1]);
    assert_eq!(all[1].reward, full_m[1].reward);
    assert_eq!(all[1].drawn, full_m[1].drawn);
    for r in &resumed.trained {
        assert_eq!(r.version + 1, r.step.max(1), "{r:?}");
    }
}
