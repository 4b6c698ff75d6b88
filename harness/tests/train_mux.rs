//! Tail multiplexing in `train` (`rollout.multiplex`): engines compute the KL reference
//! log-probs of dispatched groups, and the run ends with the same weights, bit for bit, as
//! the same run without it.
mod support;

use rolloutpipe_harness::train::{Mode, RunOutcome, TrainConfig};
use support::train::{bits, kl_loss_bits, tiny_cfg, trace_count};

/// A tiny run whose schedule is deterministic, so that two runs can be compared bit for bit:
/// one engine holding every request of the step (its continuous batch, and so the order
/// groups complete and are dispatched in, does not depend on timing) and no over-sampling
/// (nothing is drawn while the rollout runs).
fn cfg(mode: Mode, extra: &[&str]) -> TrainConfig {
    let sets = [
        &["rl.micro_batch=1", "rl.max_new_tokens=6"][..],
        &["rollout.engines=1", "rollout.slots=32"],
        extra,
    ]
    .concat();
    tiny_cfg(mode, &sets)
}

fn go(c: &TrainConfig, name: &str) -> RunOutcome {
    support::train::go(c, "mux", name)
}

/// The same run with every worker behind the wire ([`support::train::go_remote`]).
fn go_remote(c: &TrainConfig, name: &str) -> RunOutcome {
    support::train::go_remote(c, "mux", name)
}

fn mux_groups(o: &RunOutcome) -> u32 {
    o.metrics.iter().map(|m| m.mux_groups).sum()
}

/// Which groups an engine gets to depends on timing (the trainer may overtake a pass on a
/// loaded machine), so a run is repeated, up to 4 times, until engines multiplexed some.
fn go_until_multiplexed(c: &TrainConfig, name: &str, each: impl Fn(&RunOutcome)) -> RunOutcome {
    go_until_multiplexed_on(go, c, name, each)
}

fn go_until_multiplexed_on(
    run_on: fn(&TrainConfig, &str) -> RunOutcome,
    c: &TrainConfig,
    name: &str,
    each: impl Fn(&RunOutcome),
) -> RunOutcome {
    for i in 0..4 {
        let o = run_on(c, &format!("{name}-{i}"));
        each(&o);
        if mux_groups(&o) > 0 {
            return o;
        }
    }
    panic!("{name}: in 4 runs no reference pass was used from an engine");
}

#[test]
fn multiplexed_reference_passes_leave_the_weights_bit_identical() {
    for mode in [Mode::Sync, Mode::Rolloutpipe] {
        let plain = go(&cfg(mode, &[]), &format!("{mode}-plain"));
        assert_eq!(mux_groups(&plain), 0);
        let trained: Vec<u32> = plain.metrics.iter().map(|m| m.trained).collect();
        assert!(
            trained.iter().all(|&t| t >= 2),
            "{mode}: trained {trained:?}"
        );
        let kl: f64 = plain.metrics.iter().map(|m| m.kl).sum();
        assert!(kl > 0.0, "{mode}: the KL term is live");
        let target = bits(&plain.weights);
        let target_kl = kl_loss_bits(&plain);
        // Every run, with whatever share of the passes on engines, ends bit-identical.
        let mux = go_until_multiplexed(
            &cfg(mode, &["rollout.multiplex=true"]),
            &format!("{mode}-mux"),
            |o| {
                let n = mux_groups(o);
                assert!(
                    bits(&o.weights) == target,
                    "{mode}: {n} multiplexed groups changed the weights"
                );
                assert_eq!(
                    kl_loss_bits(o),
                    target_kl,
                    "{mode}: {n} multiplexed groups changed the KL or the loss"
                );
            },
        );
        let n = mux_groups(&mux);
        assert!(mux.metrics.iter().all(|m| m.mux_s >= 0.0));
        assert!(mux.metrics.iter().any(|m| m.mux_s > 0.0), "{mode}");
        assert!(
            trace_count(&mux, "multiplexed") >= n as usize,
            "{mode}: trace"
        );
        let lines = std::fs::read_to_string(mux.dir.join("metrics.jsonl")).unwrap();
        assert!(lines.contains("\"mux_groups\"") && lines.contains("\"mux_s\""));
        if mode == Mode::Rolloutpipe {
            // A wrong engine pass (1e-3 on one log-prob per group) is seen.
            let bad = go_until_multiplexed(
                &cfg(mode, &["rollout.multiplex=true", "fault.perturb_mux=true"]),
                &format!("{mode}-bad"),
                |_| {},
            );
            assert!(
                bits(&bad.weights) != target,
                "{mode}: a perturbed engine pass left the weights unchanged"
            );
        }
    }
}

/// Across the wire: each engine host builds its reference model from the Init message's
/// reference part and answers `RefLogprobs`; the run ends on the in-process plain run's
/// weights, and a perturbed host pass is seen there too (so the passes really came from the
/// hosts).
#[test]
fn multiplexing_crosses_the_remote_transport_bit_identical() {
    let mode = Mode::Rolloutpipe;
    let plain = go(&cfg(mode, &[]), "remote-plain");
    let target = bits(&plain.weights);
    let target_kl = kl_loss_bits(&plain);
    let mux = go_until_multiplexed_on(
        go_remote,
        &cfg(mode, &["rollout.multiplex=true"]),
        "remote-mux",
        |o| {
            let n = mux_groups(o);
            assert!(
                bits(&o.weights) == target,
                "remote: {n} multiplexed groups changed the weights"
            );
            assert_eq!(kl_loss_bits(o), target_kl, "remote: {n} groups, KL or loss");
        },
    );
    assert!(trace_count(&mux, "multiplexed") >= mux_groups(&mux) as usize);
    let bad = go_until_multiplexed_on(
        go_remote,
        &cfg(mode, &["rollout.multiplex=true", "fault.perturb_mux=true"]),
        "remote-bad",
        |_| {},
    );
    assert!(
        bits(&bad.weights) != target,
        "remote: a perturbed host pass left the weights unchanged"
    );
}

#[test]
fn multiplexing_refuses_what_it_cannot_do() {
    let base = cfg(Mode::Rolloutpipe, &[]);
    for (sets, want) in [
        (vec!["rollout.multiplex=true", "rl.beta=0"], "rl.beta > 0"),
        (
            vec![
                "rollout.multiplex=true",
                "run.mode=one-step-off",
                "rl.old_logprobs=rollout",
            ],
            "on-policy mode",
        ),
        (vec!["fault.perturb_mux=true"], "needs rollout.multiplex"),
    ] {
        let s: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let c = base.clone().with_overrides(&s).unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains(want), "{sets:?}: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}
