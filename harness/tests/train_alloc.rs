//! End-to-end `train` runs under the allocation policies of `[alloc]`: VIGOR's extra rounds and
//! Pilot-Commit's verdicts run through the real engines and trainer, stay within the step's
//! sample budget, and are counted in metrics.jsonl.
mod support;

use rolloutpipe_harness::train::{RunOutcome, TrainConfig, read_metrics};

/// About a second ([`TrainConfig::tiny`], seed 5, the default's carry-dropping SFT teacher):
/// a 1-layer model warm-started on 1-digit addition (mixed rewards), 4 groups of G = 8 per
/// step, 2 engines of 4 slots.
fn tiny(steps: u32, sets: &[&str]) -> TrainConfig {
    let steps = format!("run.steps={steps}");
    let cfg = TrainConfig::tiny()
        .set(&[
            "run.seed=5",
            &steps,
            "sft.carry_drop=0.6",
            "rl.group_size=8",
        ])
        .and_then(|c| c.set(sets))
        .unwrap();
    cfg.validate().unwrap();
    cfg
}

/// The validation error of `tiny(1, sets)`'s config, in the one line the binary prints.
fn refused(sets: &[&str]) -> String {
    let base = tiny(1, &[]);
    let sets: Vec<String> = sets.iter().map(|s| (*s).to_owned()).collect();
    let e = match base.with_overrides(&sets) {
        Ok(cfg) => cfg.validate().unwrap_err(),
        Err(e) => e,
    };
    let e = format!("{e:#}");
    assert!(!e.contains('\n'), "{e}");
    e
}

#[test]
fn alloc_parameters_are_validated_whatever_the_policy() {
    // policy = "fixed" (the default): a bad VIGOR or Pilot-Commit key is still refused, named.
    assert_eq!(
        refused(&["alloc.n0=1"]),
        "alloc.n0 is 1, must be at least 2"
    );
    assert_eq!(
        refused(&["alloc.increment=0"]),
        "alloc.increment is 0, must be at least 1"
    );
    assert_eq!(
        refused(&["alloc.lower=2.0"]),
        "alloc.lower is 2, must be within [0, 1]"
    );
    assert_eq!(
        refused(&["alloc.policy=vigor", "alloc.n_pilot=1"]),
        "alloc.n_pilot is 1, must be at least 2"
    );
    // Fixed G has no step budget: a non-zero one would be ignored, so it is refused.
    let e = refused(&["alloc.budget=64"]);
    assert!(
        e.starts_with("alloc.budget is 64, but alloc.policy = \"fixed\""),
        "{e}"
    );
    // The budget-dependent check of VIGOR still applies when VIGOR is selected.
    assert_eq!(
        refused(&["alloc.policy=vigor", "alloc.budget=8"]),
        "alloc.budget 8 is below n0 × batch_groups = 16 samples"
    );
}

fn go(cfg: &TrainConfig, name: &str) -> RunOutcome {
    support::train::go(cfg, "alloc", name)
}

/// Rollouts per step within the budget, cumulative counts adding up, conservation per step.
fn check_counts(o: &RunOutcome, budget: u64) {
    let ms = read_metrics(&o.dir).unwrap();
    assert_eq!(ms.len(), o.metrics.len());
    let mut cum = 0;
    for (m, c) in ms.iter().zip(&o.counters) {
        assert!(c.is_conserved(), "step {}: {c:?}", m.step);
        assert!(
            m.rollouts > 0 && m.rollouts <= budget,
            "step {}: {}",
            m.step,
            m.rollouts
        );
        assert_eq!(m.rollouts, c.requests_generated + c.requests_discarded);
        cum += m.rollouts;
        assert_eq!(m.rollouts_cum, cum, "step {}", m.step);
    }
}

#[test]
fn vigor_extends_high_variance_groups_within_the_budget() {
    let cfg = tiny(
        4,
        &[
            "alloc.policy=vigor",
            "alloc.n0=4",
            "alloc.rounds=2",
            "alloc.increment=2",
        ],
    );
    let o = go(&cfg, "vigor");
    check_counts(&o, 32);
    // Mixed rewards after the warm start: some group has variance, so some round extends.
    assert!(o.metrics.iter().map(|m| m.extended).sum::<u32>() > 0);
    // A trained group has n0 samples, or n0 plus whole increments.
    for t in &o.trained {
        assert!(t.sample < 8, "sample {} beyond n0 + 2 x 2", t.sample);
    }
}

#[test]
fn pilot_commit_trains_kept_prompts_with_their_committed_samples() {
    let cfg = tiny(
        4,
        &[
            "alloc.policy=pilot_commit",
            "alloc.n_pilot=4",
            "alloc.n_commit=4",
        ],
    );
    let o = go(&cfg, "pilot");
    check_counts(&o, 32);
    let decided: u32 = o.metrics.iter().map(|m| m.extended + m.skipped).sum();
    assert!(decided > 0, "no pilot was judged");
    // Every trained group was committed: 4 pilot + 4 committed samples. The budget (B x G =
    // 4 x 8) holds every first-B prompt's commit, and a replacement is drawn only with its
    // commit reserved, so no kept prompt trains on its pilot alone.
    let mut per_group = std::collections::HashMap::new();
    for t in &o.trained {
        *per_group.entry((t.rollout_step, t.group)).or_insert(0u32) += 1;
    }
    assert!(!per_group.is_empty(), "nothing trained");
    assert!(per_group.values().all(|&n| n == 8), "{per_group:?}");
}

#[test]
fn fixed_g_counts_rollouts_too() {
    let cfg = tiny(2, &[]);
    let o = go(&cfg, "fixed");
    // Fixed G has no step budget: over-sampling may draw up to max_groups x G.
    check_counts(&o, 16 * 8);
    assert!(o.metrics.iter().all(|m| m.extended == 0 && m.skipped == 0));
}
