//! Long-tail migration in `train` (`rollout.migrate`): long requests move from a crowded
//! engine to an idle one (export, the core's preemption, re-prefill, the same seeded stream),
//! and the run ends with the same samples and weights, bit for bit, as the run without it.
mod support;

use rolloutpipe_harness::train::{Mode, RunOutcome, TrainConfig};
use support::train::{bits, kl_loss_bits, tiny_cfg, trace_count};

/// Two engines, and one micro-batch holding the whole batch: the trainer sees the groups in
/// id order whichever engine generated them and whenever they completed, so a run's result
/// depends only on its samples. A short warm start and 16-token answers make lengths vary,
/// so that one engine is left with the tail while the other idles.
fn cfg(mode: Mode, extra: &[&str]) -> TrainConfig {
    let sets = [
        &["rl.micro_batch=4", "rl.max_new_tokens=16"][..],
        &["rollout.engines=2", "rollout.slots=16", "sft.steps=25"],
        extra,
    ]
    .concat();
    tiny_cfg(mode, &sets)
}

fn go(c: &TrainConfig, name: &str) -> RunOutcome {
    support::train::go(c, "migrate", name)
}

/// The same run with every worker behind the wire ([`support::train::go_remote`]).
fn go_remote(c: &TrainConfig, name: &str) -> RunOutcome {
    support::train::go_remote(c, "migrate", name)
}

fn migrations(o: &RunOutcome) -> u32 {
    o.metrics.iter().map(|m| m.migrations).sum()
}

/// Per step, what was sampled: each trained response's (group, sample, version).
fn trained(o: &RunOutcome) -> Vec<(u64, u32, u16, u64)> {
    let mut v: Vec<_> = (o.trained.iter())
        .map(|t| (t.rollout_step, t.group, t.sample, t.version))
        .collect();
    v.sort();
    v
}

#[test]
fn migrated_requests_leave_samples_and_weights_bit_identical() {
    for mode in [Mode::Sync, Mode::Rolloutpipe] {
        check_bit_identical(mode, &[], "cpu", go);
    }
}

/// Across the wire: the source host exports (`EngineMsg::Migrate`), the state travels back to
/// the scheduler and out to the target host in its next `Step` (`resumes`), and the run ends
/// with the in-process run's samples and weights.
#[test]
fn migration_crosses_the_remote_transport_bit_identical() {
    check_bit_identical(Mode::Rolloutpipe, &[], "remote", go_remote);
}

/// The same on wgpu engines and trainer (lavapipe here): the wgpu engine exports and resumes
/// requests as the CPU's does. Skipped where the machine has no wgpu adapter.
#[cfg(feature = "wgpu")]
#[test]
fn migrated_requests_on_wgpu_engines_leave_samples_and_weights_bit_identical() {
    if !wgpu_adapter("the wgpu migration run") {
        return;
    }
    check_bit_identical(Mode::Rolloutpipe, &["run.backend=wgpu"], "wgpu", go);
}

/// Look-ahead decoding (`rollout.lookahead`) on wgpu engines: the same samples and weights as
/// without it, and migration with it still moves only requests that have started (a request
/// added behind a queued step joins an iteration later) and ends bit-identical.
#[cfg(feature = "wgpu")]
#[test]
fn lookahead_wgpu_engines_train_bit_identical_with_and_without_migration() {
    if !wgpu_adapter("the wgpu look-ahead run") {
        return;
    }
    let mode = Mode::Rolloutpipe;
    let plain = go(&cfg(mode, &["run.backend=wgpu"]), "wgpu-blocking");
    let ahead = check_bit_identical(
        mode,
        &["run.backend=wgpu", "rollout.lookahead=true"],
        "wgpu-lookahead",
        go,
    );
    assert!(
        bits(&ahead.weights) == bits(&plain.weights),
        "look-ahead changed the weights"
    );
    assert_eq!(kl_loss_bits(&ahead), kl_loss_bits(&plain));
    assert_eq!(trained(&ahead), trained(&plain));
}

/// Whether the machine has a wgpu adapter; prints a SKIP line naming `run` where it has none.
#[cfg(feature = "wgpu")]
fn wgpu_adapter(run: &str) -> bool {
    let found = matches!(rolloutpipe_backends::wgpu::Gpu::new(), Ok(Some(_)));
    if !found {
        eprintln!("SKIP: no wgpu adapter; {run} did not run");
    }
    found
}

/// Runs `mode` without and with migration (up to 4 times, until some request moves) and
/// checks that every run trains the same samples into the same weights; the runs with
/// migration go through `run_on`. Returns the run without migration.
fn check_bit_identical(
    mode: Mode,
    base: &[&str],
    tag: &str,
    run_on: fn(&TrainConfig, &str) -> RunOutcome,
) -> RunOutcome {
    {
        let plain = go(&cfg(mode, base), &format!("{tag}-{mode}-plain"));
        assert_eq!(migrations(&plain), 0);
        let target = bits(&plain.weights);
        let target_kl = kl_loss_bits(&plain);
        let tokens: Vec<u64> = plain.metrics.iter().map(|m| m.tokens).collect();
        // Which requests move depends on timing; every run must end bit-identical, and some
        // run within 4 must move requests.
        let sets: Vec<&str> = [
            base,
            &["rollout.migrate=true", "rollout.migrate_min_generated=1"],
        ]
        .concat();
        let on = cfg(mode, &sets);
        let mut moved = None;
        for i in 0..4 {
            let o = run_on(&on, &format!("{tag}-{mode}-on-{i}"));
            let n = migrations(&o);
            assert!(
                bits(&o.weights) == target,
                "{mode}: {n} migrations changed the weights"
            );
            assert_eq!(
                kl_loss_bits(&o),
                target_kl,
                "{mode}: {n} migrations, KL or loss"
            );
            assert_eq!(trained(&o), trained(&plain), "{mode}: trained responses");
            let got: Vec<u64> = o.metrics.iter().map(|m| m.tokens).collect();
            assert_eq!(
                got, tokens,
                "{mode}: {n} migrations changed the tokens generated"
            );
            if n > 0 {
                moved = Some(o);
                break;
            }
        }
        let Some(o) = moved else {
            panic!("{mode}: in 4 runs no request migrated");
        };
        let n = migrations(&o);
        assert!(o.metrics.iter().map(|m| m.migrated_tokens).sum::<u64>() >= u64::from(n) * 2);
        assert!(o.metrics.iter().any(|m| m.reprefill_s > 0.0), "{mode}");
        // One instant per export and one span per re-prefill.
        assert!(
            trace_count(&o, "migration") >= 2 * n as usize,
            "{mode}: trace"
        );
        let c = &o.counters;
        assert!(c.iter().map(|c| c.requests_requeued).sum::<u64>() >= u64::from(n));
        assert_eq!(c.iter().map(|c| c.requests_failed).sum::<u64>(), 0);
        let lines = std::fs::read_to_string(o.dir.join("metrics.jsonl")).unwrap();
        for key in ["\"migrations\"", "\"migrated_tokens\"", "\"reprefill_s\""] {
            assert!(lines.contains(key), "{key}");
        }
        plain
    }
}

#[test]
fn migration_refuses_what_it_cannot_do() {
    let base = cfg(Mode::Rolloutpipe, &[]);
    for (sets, want) in [
        (
            vec!["rollout.migrate=true", "run.backend=cuda"],
            "needs run.backend = \"cpu\" or \"wgpu\"",
        ),
        (
            vec!["rollout.migrate=true", "rollout.engines=1"],
            "rollout.engines >= 2",
        ),
        (vec!["rollout.migrate_min_generated=0"], "at least 1"),
        (
            vec!["rollout.migrate_receiver_max=0"],
            "within 1..=rollout.slots",
        ),
        (
            vec!["rollout.migrate_receiver_max=17"],
            "within 1..=rollout.slots",
        ),
    ] {
        let s: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let c = base.clone().with_overrides(&s).unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(want), "{sets:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}
