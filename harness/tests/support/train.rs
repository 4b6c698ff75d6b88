//! Helpers shared by the `train` equivalence tests (multiplexing, migration): a tiny seeded run
//! and the bits of what it ends with.
#![allow(dead_code)] // each test crate uses a subset

use std::path::PathBuf;

use rolloutpipe_backends::Weights;
use rolloutpipe_harness::train::remote::Loopback;
use rolloutpipe_harness::train::{
    Mode, RunOptions, RunOutcome, TrainConfig, run, run_with_transport,
};

/// The `[model]` section of every tiny test run: a 1-layer model with GQA (2 query heads, 1
/// KV head), small enough that a run takes a second.
pub const TINY_MODEL: &str = "[model]
hidden_size = 32
intermediate_size = 64
layers = 1
heads = 2
kv_heads = 1
head_dim = 16
";

/// The tiny run both equivalence tests start from (1-digit addition, a 1-layer model, a short
/// SFT warm start, `rl.beta > 0`), in `mode`, with `[rl]` and `[rollout]` extras appended to
/// their sections and `extra` overrides applied; validated.
pub fn tiny_cfg(mode: Mode, rl: &str, rollout: &str, extra: &[&str]) -> TrainConfig {
    let base = format!(
        r#"
[run]
seed = 5
steps = 3
mode = "{}"
eval_every = 0
eval_problems = 8
test_problems = 0
checkpoint_every = 0
progress = false
[task]
name = "add"
digits = 1
# Malformed answers score below wrong ones, so that groups have mixed rewards.
format_penalty = 0.5
{TINY_MODEL}[sft]
steps = 100
batch = 16
lr = 1e-2
carry_drop = 0.0
[rl]
batch_groups = 4
group_size = 8
lr = 1e-3
beta = 0.1
{rl}
[rollout]
max_groups_factor = 1.0
{rollout}
"#,
        mode.name()
    );
    let sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let c = TrainConfig::from_partial_toml(&base)
        .unwrap()
        .with_overrides(&sets)
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
