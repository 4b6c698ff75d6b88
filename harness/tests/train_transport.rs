//! `train` through the transport seam: the same run with its workers behind the wire
//! (`support::loopback::Loopback`, every message encoded and decoded as a Ray deployment's are) trains
//! what the in-process run trains, and a rollout engine lost mid-step has its requests
//! re-admitted on the others.
mod support;

use std::path::PathBuf;

use rolloutpipe_backends::Weights;
use support::loopback::Loopback;
use support::train::{FRESH, scratch, trained};

use rolloutpipe_harness::train::{Local, Mode, RunOutcome, TrainConfig, run_with_transport};

/// The tiny job of `train_e2e` ([`TrainConfig::tiny`]: a 1-layer model warm-started on 1-digit
/// addition, 4 groups of 4 per step, 2 engines of 4 slots), one micro-batch per step, with two
/// verifiers so the verifier route is exercised concurrently.
fn tiny(mode: Mode, steps: u32) -> TrainConfig {
    let (steps, mode) = (
        format!("run.steps={steps}"),
        format!("run.mode={}", mode.name()),
    );
    let sets = [
        &steps,
        &mode,
        "run.checkpoint_every=1",
        "rl.micro_batch=4",
        "rollout.verifiers=2",
    ];
    let cfg = TrainConfig::tiny().set(&sets).unwrap();
    cfg.validate().unwrap();
    cfg
}

fn dir(name: &str) -> PathBuf {
    scratch("transport", name)
}

fn max_abs_diff(a: &Weights, b: &Weights) -> f64 {
    assert_eq!(a.tensors.len(), b.tensors.len());
    let mut max = 0.0f64;
    for (name, ta) in &a.tensors {
        let tb = &b.tensors[name];
        assert_eq!(ta.data.len(), tb.data.len(), "{name}");
        for (x, y) in ta.data.iter().zip(&tb.data) {
            assert!(x.is_finite() && y.is_finite(), "{name}");
            max = max.max((*x as f64 - *y as f64).abs());
        }
    }
    max
}

/// Every drawn prompt ends trained, filtered or aborted, and the core's counts add up.
fn check_accounting(o: &RunOutcome) {
    for (i, c) in o.counters.iter().enumerate() {
        assert!(c.is_conserved(), "step {i}: {c:?}");
        assert_eq!(
            c.drawn,
            c.trained + c.filtered() + c.aborted,
            "step {i}: {c:?}"
        );
        assert_eq!(c.in_progress(), 0, "step {i}");
        assert_eq!(c.in_flight, 0, "step {i}");
    }
}

#[test]
fn remote_workers_train_what_in_process_workers_train() {
    let cfg = tiny(Mode::Sync, 2);
    let local = run_with_transport(&cfg, &dir("local"), FRESH, &Local).unwrap();
    let lb = Loopback::new(&cfg);
    let fwd = lb.transport();
    let remote = run_with_transport(&cfg, &dir("loopback"), FRESH, &fwd).unwrap();

    assert_eq!(local.metrics.len(), 2);
    assert_eq!(remote.metrics.len(), 2);
    assert!(!local.trained.is_empty());
    assert_eq!(
        trained(&local),
        trained(&remote),
        "the same samples trained"
    );
    for (l, r) in local.metrics.iter().zip(&remote.metrics) {
        assert_eq!(l.reward, r.reward, "step {}: same rewards", l.step);
        assert_eq!(l.tokens, r.tokens, "step {}: same tokens", l.step);
        assert_eq!(l.drawn, r.drawn, "step {}", l.step);
    }
    check_accounting(&remote);

    // The weights moved, and both runs moved them to the same place: one micro-batch per
    // step whose groups the trainer sorts by id, so even the summation order is the same.
    let start = rolloutpipe_backends::load_model_dir(&local.dir.join("sft"))
        .unwrap()
        .1;
    let moved = max_abs_diff(&start, &local.weights);
    assert!(moved > 1e-5, "the run changed the weights ({moved:e})");
    let diff = max_abs_diff(&local.weights, &remote.weights);
    assert_eq!(diff, 0.0, "in-process vs remote weights differ by {diff:e}");

    // Per step: one weight publish (put once) for both engines, plus the initial one.
    let c = fwd.counts();
    assert_eq!(c.publishes, 1 + 2, "{c:?}");
    let blob = c.published_bytes / c.publishes;
    let params: u64 = local
        .weights
        .tensors
        .values()
        .map(|t| t.data.len() as u64)
        .sum();
    assert!(
        blob >= 4 * params,
        "a publish carries the f32 weights ({blob} B)"
    );
    assert!(c.calls > 10 && c.bytes_in > 0 && c.bytes_out > 0, "{c:?}");
}

#[test]
fn an_engine_killed_mid_step_has_its_requests_readmitted() {
    let cfg = tiny(Mode::Rolloutpipe, 2);
    let lb = Loopback::new(&cfg);
    // Engine 0 dies at its third Step message: after admitting requests, before they finish.
    lb.kill_engine_at_step(0, 3);
    let fwd = lb.transport();
    let o = run_with_transport(&cfg, &dir("kill"), FRESH, &fwd).unwrap();
    assert!(!lb.engine_alive(0), "the engine was killed");
    assert_eq!(o.metrics.len(), 2, "the run completed");
    check_accounting(&o);
    let requeued: u64 = o.counters.iter().map(|c| c.requests_requeued).sum();
    assert!(
        requeued >= 1,
        "the lost requests were re-admitted: {:?}",
        o.counters
    );
    // Preemption burns no attempt: no request failed, so no group was filtered for it.
    assert!(o.counters.iter().all(|c| c.requests_failed == 0));
    assert!(o.counters.iter().all(|c| c.filtered_attempts == 0));
    // On-policy, and exactly what the same run trains without the kill: a preempted request
    // keeps its id, so its sampling seed, and generates the same response elsewhere.
    for r in &o.trained {
        assert_eq!(r.version, r.step, "{r:?}");
    }
    let whole = run_with_transport(&cfg, &dir("nokill"), FRESH, &Local).unwrap();
    assert!(!o.trained.is_empty());
    assert_eq!(trained(&o), trained(&whole));
    let per_step = |o: &RunOutcome| o.counters.iter().map(|c| c.trained).collect::<Vec<_>>();
    assert_eq!(per_step(&o), per_step(&whole));
}

/// `rollout.dtype = "bf16"` puts bf16 weights in every engine, in-process and behind the wire
/// alike: with the rollout's log-probs as logπ_old (so the engines' numerics reach the update),
/// the bf16 runs end on the same weights as each other and on different weights from the f32
/// run. Were the dtype dropped on the wire, the remote run would match the f32 one instead.
#[test]
fn half_storage_engines_run_in_process_and_remote_alike() {
    let with = |dtype: &str| {
        tiny(Mode::Sync, 1)
            .with_overrides(&[
                format!("rollout.dtype={dtype:?}"),
                "rl.old_logprobs=\"rollout\"".into(),
            ])
            .unwrap()
    };
    let (f32_cfg, bf16_cfg) = (with("f32"), with("bf16"));
    bf16_cfg.validate().unwrap();
    let full = run_with_transport(&f32_cfg, &dir("dtype-f32"), FRESH, &Local).unwrap();
    let local = run_with_transport(&bf16_cfg, &dir("dtype-bf16"), FRESH, &Local).unwrap();
    let lb = Loopback::new(&bf16_cfg);
    let remote =
        run_with_transport(&bf16_cfg, &dir("dtype-bf16-remote"), FRESH, &lb.transport()).unwrap();
    check_accounting(&local);
    assert_eq!(
        trained(&local),
        trained(&remote),
        "the same samples trained"
    );
    let same = max_abs_diff(&local.weights, &remote.weights);
    assert_eq!(
        same, 0.0,
        "bf16 in-process vs remote weights differ by {same:e}"
    );
    let moved = max_abs_diff(&full.weights, &local.weights);
    assert!(
        moved > 0.0,
        "bf16 engines left the update bit-identical to f32 engines'"
    );
    // The engines' bf16 weights are not what the trainer keeps: its master copy stays f32.
    let rounded = local
        .weights
        .tensors
        .values()
        .flat_map(|t| t.data.iter())
        .filter(|x| x.to_bits() & 0xffff != 0)
        .count();
    assert!(rounded > 0, "the trainer's weights are not bf16-rounded");
}

/// `--backend wgpu --set rollout.dtype="bf16"` trains: the engines are bf16 wgpu engines
/// (`WgpuBackend::with_dtype`) synced from the f32 wgpu trainer through the host, and one GRPO
/// step runs with every sample accounted for. Skipped where the machine has no wgpu adapter.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_bf16_engines_train_a_step() {
    if !matches!(rolloutpipe_backends::wgpu::Gpu::new(), Ok(Some(_))) {
        eprintln!("SKIP: no wgpu adapter; the wgpu bf16 training run did not run");
        return;
    }
    let cfg = tiny(Mode::Sync, 1)
        .with_overrides(&[
            "run.backend=\"wgpu\"".into(),
            "rollout.dtype=\"bf16\"".into(),
            // Enough SFT (on the wgpu trainer) that some groups have mixed rewards and train.
            "sft.steps=24".into(),
        ])
        .unwrap();
    cfg.validate().unwrap();
    let o = run_with_transport(&cfg, &dir("wgpu-bf16"), FRESH, &Local).unwrap();
    check_accounting(&o);
    assert!(o.metrics.iter().any(|m| m.tokens > 0), "nothing generated");
    assert!(!o.trained.is_empty(), "no sample trained");
}
