//! Helpers shared by the `train` equivalence tests (multiplexing, migration): a tiny seeded run
//! and the bits of what it ends with.
#![allow(dead_code)] // each test crate uses a subset

use std::path::PathBuf;

use super::loopback::Loopback;
use rolloutpipe_backends::Weights;
use rolloutpipe_harness::train::{
    Mode, RunOptions, RunOutcome, TrainConfig, run, run_with_transport,
};

/// The `[model]` section of [`TrainConfig::tiny`], for TOML files the CLI tests write.
pub const TINY_MODEL: &str = "[model]
hidden_size = 32
intermediate_size = 64
layers = 1
heads = 2
kv_heads = 1
head_dim = 16
";

/// The tiny run both equivalence tests start from ([`TrainConfig::tiny`] with a 100-step SFT
/// warm start, 3 steps of 4 groups of 8, `rl.beta > 0`, no over-sampling, and malformed answers
/// scored below wrong ones so that groups have mixed rewards), in `mode`, with `sets` applied;
/// validated.
pub fn tiny_cfg(mode: Mode, sets: &[&str]) -> TrainConfig {
    let mode = format!("run.mode={}", mode.name());
    let c = TrainConfig::tiny()
        .set(&[
            "run.seed=5",
            "run.steps=3",
            &mode,
            "run.eval_problems=8",
            "task.format_penalty=0.5",
            "sft.steps=100",
            "rl.group_size=8",
            "rl.micro_batch=2",
            "rl.max_new_tokens=6",
            "rl.beta=0.1",
            "rollout.slots=16",
            "rollout.max_groups_factor=1.0",
        ])
        .and_then(|c| c.set(sets))
        .unwrap();
    c.validate().unwrap();
    c
}

/// A fresh run: neither resumed nor forced.
pub const FRESH: RunOptions = RunOptions {
    resume: false,
    force: false,
};

/// The scratch run directory `rp-{prefix}-{pid}-{name}` under the temp dir, removed if an
/// earlier run left it.
pub fn scratch(prefix: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rp-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs `c` in a fresh scratch directory named `{prefix}-{name}`.
pub fn go(c: &TrainConfig, prefix: &str, name: &str) -> RunOutcome {
    run(c, &scratch(prefix, name), false).unwrap()
}

/// Runs `c` in a fresh scratch directory named `{prefix}-{name}` with every worker behind the
/// wire (`remote::Loopback`: hosts answering encoded messages on other threads, as Ray actors
/// do).
pub fn go_remote(c: &TrainConfig, prefix: &str, name: &str) -> RunOutcome {
    let d = scratch(prefix, name);
    run_with_transport(c, &d, FRESH, &Loopback::new(c).transport()).unwrap()
}

/// Trained samples as (step, group, sample, version), sorted.
pub fn trained(o: &RunOutcome) -> Vec<(u64, u32, u16, u64)> {
    let mut v: Vec<_> = (o.trained.iter())
        .map(|r| (r.step, r.group, r.sample, r.version))
        .collect();
    v.sort();
    v
}

/// The weights' bits, by tensor name.
pub fn bits(w: &Weights) -> Vec<(String, Vec<u32>)> {
    let mut v: Vec<(String, Vec<u32>)> = w
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.data.iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

/// Per step, the bits of the KL and loss sums: they take every log-prob in, so they see a
/// change the weights can round away (one ulp of one log-prob).
pub fn kl_loss_bits(o: &RunOutcome) -> Vec<(u64, u64)> {
    o.metrics
        .iter()
        .map(|m| (m.kl.to_bits(), m.loss.to_bits()))
        .collect()
}

/// How often the run's trace holds `"{cat}"` (a category of its events).
pub fn trace_count(o: &RunOutcome, cat: &str) -> usize {
    let t = std::fs::read_to_string(o.dir.join("trace.json")).unwrap();
    t.matches(&format!("\"{cat}\"")).count()
}
