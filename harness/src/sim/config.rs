//! The simulator's configuration: the system (engines, trainer, scheduler) and the workloads
//! (benchmark profiles x rollout settings), read from TOML.
//!
//! The defaults live in `harness/configs/sim/*.toml` and are compiled in, so `rolloutpipe
//! simulate` needs no files. Users layer their own files (`--config`, deep-merged over the
//! defaults) and single values (`--set rollout.engines=4`) on top. Unknown keys are errors, so a
//! typo never silently falls back to a default.
use std::collections::BTreeMap;

use anyhow::{Context, bail, ensure};
use serde::{Deserialize, Serialize};

pub use crate::driver::mode::{Mode, Schedule};
pub use crate::driver::plan::QueueOrder;
use crate::toml_config::{merge, parse_value};

/// The embedded default system (engines, trainer, scheduler, run selection).
pub const DEFAULT_SYSTEM_TOML: &str = include_str!("../../configs/sim/system.toml");
/// The embedded default workloads (profiles and rollout settings).
pub const DEFAULT_WORKLOADS_TOML: &str = include_str!("../../configs/sim/workloads.toml");

/// Everything one simulator invocation needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// What to run: seed, steps, which profiles, settings and modes.
    pub run: RunConfig,
    /// The rollout engines.
    pub rollout: RolloutConfig,
    /// The trainer pool.
    pub trainer: TrainerConfig,
    /// Scheduler parameters passed to the core.
    pub scheduler: SchedulerConfig,
    /// The bound-moving policies (tail multiplexing, long-tail migration).
    pub policy: PolicyConfig,
    /// Benchmark profiles by name.
    pub profile: BTreeMap<String, Profile>,
    /// Rollout settings by name.
    pub setting: BTreeMap<String, Setting>,
    /// The allocation policy (samples per prompt); fixed G when absent. Its budget defaults to
    /// each setting's B × G.
    #[serde(default)]
    pub alloc: crate::alloc::AllocSection,
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Seed of every random draw.
    pub seed: u64,
    /// RL steps simulated per (setting, mode).
    pub steps: u32,
    /// Profiles to run, in order (keys of `[profile.*]`).
    pub profiles: Vec<String>,
    /// Rollout settings to run, in order (keys of `[setting.*]`).
    pub settings: Vec<String>,
    /// Modes to run (a mode, or `cgp` with its tail policies: `cgp-mux`, `cgp-migrate`,
    /// `cgp-mux-migrate`); the ideal bound is derived from `sync` whenever it runs.
    pub modes: Vec<Schedule>,
    /// The step shown in the Gantt plot and the Chrome trace.
    pub trace_step: u32,
}

/// The rollout engines (SGLang-like, continuous batching).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Number of engines (one per rollout GPU).
    pub engines: u32,
    /// Requests in flight per engine unless the setting overrides it.
    pub max_running: u32,
    /// KV-cache capacity per engine, in tokens.
    pub kv_capacity_tokens: u64,
    /// Share of each running request's remaining budget reserved at admission.
    pub kv_new_token_ratio: f64,
    /// Decode iteration time: constant term, ms.
    pub decode_base_ms: f64,
    /// Decode iteration time: per running sequence, ms.
    pub decode_per_seq_ms: f64,
    /// Decode iteration time: per thousand resident KV tokens, ms.
    pub decode_per_kilo_kv_ms: f64,
    /// Prefill throughput per engine, tokens/s.
    pub prefill_tok_per_s: f64,
    /// Reward (verifier) latency per response, s.
    pub verifier_latency_s: f64,
    /// SGLang's `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`: the admission estimate of a request's
    /// remaining tokens is clipped at this many.
    pub clip_max_new_tokens: u32,
    /// How requests reach an engine.
    pub routing: Routing,
    /// cache_aware: rebalance to the least-loaded engine when max - min load exceeds this.
    pub router_balance_abs: u32,
    /// cache_aware: ... and max load exceeds min load times this.
    pub router_balance_rel: f64,
    /// Slime's abort of the surplus once the batch is full (`abort_servers_until_idle`), s.
    pub abort_s: f64,
}

/// The router between Slime's rollout and the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// sgl-router's default `cache_aware` policy, which Slime launches: a request is bound to an
    /// engine when it is submitted. Samples of a group share their prompt, so they follow the
    /// engine that holds that prefix unless the loads are unbalanced; a new prompt goes to the
    /// least-loaded engine (est. for the smallest radix tree).
    CacheAware,
    /// Bound at submission to the engine with the fewest requests.
    LeastLoaded,
    /// Not Slime: one central queue, a request is bound only when an engine can run it.
    Central,
}

/// The trainer pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerConfig {
    /// GPUs in the trainer pool.
    pub gpus: u32,
    /// Forward+backward throughput per GPU, tokens/s.
    pub fwd_bwd_tok_per_s_per_gpu: f64,
    /// Log-prob (forward only) throughput per GPU, tokens/s.
    pub logprob_tok_per_s_per_gpu: f64,
    /// Log-prob passes per token (old policy; +1 with a KL reference).
    pub logprob_passes: u32,
    /// Fixed cost per micro-batch, s.
    pub micro_batch_overhead_s: f64,
    /// Optimizer step, s.
    pub optimizer_step_s: f64,
    /// Weight sync from trainer to engines between steps, s.
    pub weight_sync_s: f64,
    /// Moving rollout data to the trainer (Slime: `_convert_samples_to_train_data`,
    /// `_split_train_data_by_dp`, `ray.put`), s per million prompt+response tokens.
    pub data_transfer_s_per_mtok: f64,
}

/// The bound-moving policies' parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// Log-prob (forward-only) throughput of one rollout engine's GPU, tokens/s.
    pub mux_logprob_tok_per_s: f64,
    /// Fixed cost per multiplexed group (launch, moving its tokens to the engine), s.
    pub mux_overhead_s: f64,
    /// Only requests that have generated at least this many tokens move (the live signal that
    /// a request is a long tail).
    pub migrate_min_generated: u32,
    /// An engine running fewer requests than this receives long-tail requests.
    pub migrate_receiver_max: u32,
    /// How migrated requests carry their state.
    pub migrate_via: MigrateVia,
    /// KV transfer bandwidth between engines, GB/s.
    pub migrate_kv_gb_per_s: f64,
    /// KV bytes per token (Qwen3-1.7B: 28 layers x 8 KV heads x 128 x 2 x 2 bytes).
    pub kv_bytes_per_token: u32,
}

/// How a migrated request's state reaches the target engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrateVia {
    /// Copy its KV (prompt + generated tokens) at `migrate_kv_gb_per_s`.
    KvTransfer,
    /// Prefill prompt + generated tokens again on the target.
    Reprefill,
}

/// Scheduler parameters handed to the core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Extra frontier groups beyond those the next micro-batch needs (FGD).
    pub frontier_width: u32,
    /// The order in which the FIFO (baseline) admission sees requests.
    pub submit_order: QueueOrder,
    /// Attempts per request before its group is filtered.
    pub max_attempts: u8,
    /// Over-sampling cap: prompts drawn per step are at most this times B.
    pub max_groups_factor: f64,
    /// FGD's filter-share estimate for the first step, in [0, 1); later steps take the
    /// previous step's observed share (`driver::plan::FilterEstimate`, as `train` does).
    pub expected_filter: f64,
}

/// A benchmark profile: response lengths and pass rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Human-readable name for tables and plots.
    pub label: String,
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Mean response length at the first step, tokens.
    pub mean_tokens_start: f64,
    /// Mean response length at the last step, tokens.
    pub mean_tokens_late: f64,
    /// Lognormal sigma of response lengths.
    pub sigma: f64,
    /// Share of responses that loop to the cap.
    pub runaway: f64,
    /// Mean pass rate at the first step.
    pub acc_start: f64,
    /// Mean pass rate at the last step.
    pub acc_late: f64,
    /// Concentration k of the per-prompt Beta(acc k, (1-acc) k) pass rate.
    pub beta_k: f64,
    /// Wrong responses are this many times longer than right ones on average.
    pub wrong_length_factor: f64,
    /// Rewards 1, 0, 1, 0, ... by sample index instead of drawn: no group is ever filtered
    /// (closed-form checks and what-if runs without filtering).
    #[serde(default)]
    pub alternate_rewards: bool,
}

/// A rollout setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Setting {
    /// B: trainable groups per step.
    pub batch: u32,
    /// G: responses per prompt.
    pub group: u32,
    /// Response cap, tokens.
    pub cap: u32,
    /// Requests in flight per engine (overrides `rollout.max_running`).
    #[serde(default)]
    pub max_running: Option<u32>,
    /// Micro-batch size m, in groups.
    pub micro_batch: u32,
    /// Prompts drawn at a time (Slime's over_sampling_batch_size).
    pub draw_batch: u32,
    /// Optimizer steps per rollout.
    pub opt_steps: u32,
}

impl Setting {
    /// Requests in flight per engine for this setting.
    pub fn max_running(&self, rollout: &RolloutConfig) -> u32 {
        self.max_running.unwrap_or(rollout.max_running)
    }
}

impl SimConfig {
    /// The defaults compiled into the binary.
    pub fn defaults_table() -> anyhow::Result<toml::Table> {
        let mut table: toml::Table =
            toml::from_str(DEFAULT_SYSTEM_TOML).context("parsing the embedded system.toml")?;
        let workloads: toml::Table = toml::from_str(DEFAULT_WORKLOADS_TOML)
            .context("parsing the embedded workloads.toml")?;
        merge(&mut table, workloads);
        Ok(table)
    }

    /// The defaults, validated.
    pub fn defaults() -> anyhow::Result<Self> {
        Self::from_table(Self::defaults_table()?)
    }

    /// Defaults, then each TOML text deep-merged in order, then each `key=value` override.
    pub fn load(texts: &[(String, String)], sets: &[String]) -> anyhow::Result<Self> {
        let mut table = Self::defaults_table()?;
        for (name, text) in texts {
            let layer: toml::Table =
                toml::from_str(text).with_context(|| format!("parsing config file {name}"))?;
            merge(&mut table, layer);
        }
        for set in sets {
            apply_set(&mut table, set)?;
        }
        Self::from_table(table)
    }

    /// Deserializes and validates a merged table.
    pub fn from_table(table: toml::Table) -> anyhow::Result<Self> {
        let config: SimConfig = toml::Value::Table(table)
            .try_into()
            .context("the simulator config does not match its schema")?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value a simulation relies on; names the offending key.
    pub fn validate(&self) -> anyhow::Result<()> {
        let r = &self.run;
        ensure!(r.steps >= 1, "run.steps must be at least 1");
        ensure!(!r.profiles.is_empty(), "run.profiles is empty");
        ensure!(!r.settings.is_empty(), "run.settings is empty");
        ensure!(!r.modes.is_empty(), "run.modes is empty");
        ensure!(
            r.trace_step < r.steps,
            "run.trace_step ({}) must be below run.steps ({})",
            r.trace_step,
            r.steps
        );
        for name in &r.profiles {
            ensure!(
                self.profile.contains_key(name),
                "run.profiles names unknown profile `{name}`"
            );
        }
        for name in &r.settings {
            ensure!(
                self.setting.contains_key(name),
                "run.settings names unknown setting `{name}`"
            );
        }
        self.validate_system()?;
        self.validate_profiles()?;
        self.validate_settings()
    }

    /// The engines, the trainer, the tail policies and the scheduler.
    fn validate_system(&self) -> anyhow::Result<()> {
        let ro = &self.rollout;
        ensure!(ro.engines >= 1, "rollout.engines must be at least 1");
        ensure!(
            ro.max_running >= 1,
            "rollout.max_running must be at least 1"
        );
        positive("rollout.decode_base_ms", ro.decode_base_ms)?;
        non_negative("rollout.decode_per_seq_ms", ro.decode_per_seq_ms)?;
        non_negative("rollout.decode_per_kilo_kv_ms", ro.decode_per_kilo_kv_ms)?;
        positive("rollout.prefill_tok_per_s", ro.prefill_tok_per_s)?;
        non_negative("rollout.verifier_latency_s", ro.verifier_latency_s)?;
        ensure!(
            ro.clip_max_new_tokens >= 1,
            "rollout.clip_max_new_tokens must be at least 1"
        );
        ensure!(
            ro.router_balance_rel.is_finite() && ro.router_balance_rel >= 1.0,
            "rollout.router_balance_rel must be at least 1, got {}",
            ro.router_balance_rel
        );
        non_negative("rollout.abort_s", ro.abort_s)?;
        non_negative(
            "trainer.data_transfer_s_per_mtok",
            self.trainer.data_transfer_s_per_mtok,
        )?;
        let po = &self.policy;
        positive("policy.mux_logprob_tok_per_s", po.mux_logprob_tok_per_s)?;
        non_negative("policy.mux_overhead_s", po.mux_overhead_s)?;
        positive("policy.migrate_kv_gb_per_s", po.migrate_kv_gb_per_s)?;
        ensure!(
            po.migrate_receiver_max >= 1,
            "policy.migrate_receiver_max must be at least 1"
        );

        ensure!(
            (0.0..=1.0).contains(&ro.kv_new_token_ratio),
            "rollout.kv_new_token_ratio must be in [0, 1], got {}",
            ro.kv_new_token_ratio
        );
        let t = &self.trainer;
        ensure!(t.gpus >= 1, "trainer.gpus must be at least 1");
        positive(
            "trainer.fwd_bwd_tok_per_s_per_gpu",
            t.fwd_bwd_tok_per_s_per_gpu,
        )?;
        positive(
            "trainer.logprob_tok_per_s_per_gpu",
            t.logprob_tok_per_s_per_gpu,
        )?;
        non_negative("trainer.micro_batch_overhead_s", t.micro_batch_overhead_s)?;
        non_negative("trainer.optimizer_step_s", t.optimizer_step_s)?;
        non_negative("trainer.weight_sync_s", t.weight_sync_s)?;
        let s = &self.scheduler;
        ensure!(
            s.max_attempts >= 1,
            "scheduler.max_attempts must be at least 1"
        );
        ensure!(
            s.max_groups_factor.is_finite() && s.max_groups_factor >= 1.0,
            "scheduler.max_groups_factor must be at least 1, got {}",
            s.max_groups_factor
        );
        ensure!(
            (0.0..1.0).contains(&s.expected_filter),
            "scheduler.expected_filter must be in [0, 1), got {}",
            s.expected_filter
        );
        Ok(())
    }

    fn validate_profiles(&self) -> anyhow::Result<()> {
        for (name, p) in &self.profile {
            let key = |field: &str| format!("profile.{name}.{field}");
            ensure!(
                p.prompt_tokens >= 1,
                "{} must be at least 1",
                key("prompt_tokens")
            );
            positive(&key("mean_tokens_start"), p.mean_tokens_start)?;
            positive(&key("mean_tokens_late"), p.mean_tokens_late)?;
            non_negative(&key("sigma"), p.sigma)?;
            positive(&key("beta_k"), p.beta_k)?;
            positive(&key("wrong_length_factor"), p.wrong_length_factor)?;
            ensure!(
                (0.0..1.0).contains(&p.runaway),
                "{} must be in [0, 1), got {}",
                key("runaway"),
                p.runaway
            );
            for (field, v) in [("acc_start", p.acc_start), ("acc_late", p.acc_late)] {
                ensure!(
                    v > 0.0 && v < 1.0,
                    "{} must be in (0, 1), got {v}",
                    key(field)
                );
            }
        }
        Ok(())
    }

    fn validate_settings(&self) -> anyhow::Result<()> {
        let ro = &self.rollout;
        for (name, s) in &self.setting {
            let key = |field: &str| format!("setting.{name}.{field}");
            ensure!(s.batch >= 1, "{} must be at least 1", key("batch"));
            ensure!(
                s.group >= 1 && s.group <= u32::from(u16::MAX),
                "{} must be in 1..=65535",
                key("group")
            );
            ensure!(s.cap >= 1, "{} must be at least 1", key("cap"));
            ensure!(
                s.micro_batch >= 1,
                "{} must be at least 1",
                key("micro_batch")
            );
            ensure!(
                s.draw_batch >= 1,
                "{} must be at least 1",
                key("draw_batch")
            );
            ensure!(s.opt_steps >= 1, "{} must be at least 1", key("opt_steps"));
            ensure!(
                s.batch % s.opt_steps == 0 && (s.batch / s.opt_steps) % s.micro_batch == 0,
                "{}: batch ({}) must split into opt_steps ({}) optimizer steps of whole micro-batches ({})",
                key("batch"),
                s.batch,
                s.opt_steps,
                s.micro_batch
            );
            if let Some(m) = s.max_running {
                ensure!(m >= 1, "{} must be at least 1", key("max_running"));
            }
            let largest = u64::from(
                self.profile
                    .values()
                    .map(|p| p.prompt_tokens)
                    .max()
                    .unwrap_or(0),
            ) + u64::from(s.cap);
            self.alloc
                .allocator(s.batch, s.group as u16)
                .with_context(|| format!("setting {name}"))?;
            ensure!(
                largest <= ro.kv_capacity_tokens,
                "rollout.kv_capacity_tokens ({}) cannot hold one request of setting {name} (prompt + cap = {largest})",
                ro.kv_capacity_tokens
            );
        }
        Ok(())
    }
}

fn positive(key: &str, v: f64) -> anyhow::Result<()> {
    ensure!(
        v.is_finite() && v > 0.0,
        "{key} must be a positive number, got {v}"
    );
    Ok(())
}

fn non_negative(key: &str, v: f64) -> anyhow::Result<()> {
    ensure!(
        v.is_finite() && v >= 0.0,
        "{key} must be a finite number >= 0, got {v}"
    );
    Ok(())
}

/// Applies one `dotted.key=value` override. The value is read as TOML (`4`, `0.5`, `"x"`,
/// `["a", "b"]`); a bare word that is not valid TOML is taken as a string (`run.modes` excepted,
/// it is a list).
pub fn apply_set(table: &mut toml::Table, set: &str) -> anyhow::Result<()> {
    let Some((path, raw)) = set.split_once('=') else {
        bail!("--set `{set}`: expected key=value");
    };
    let path = path.trim();
    let raw = raw.trim();
    ensure!(!path.is_empty(), "--set `{set}`: empty key");
    let value = parse_value(raw);
    let keys: Vec<&str> = path.split('.').collect();
    let (last, parents) = keys.split_last().context("empty key")?;
    let mut cur = table;
    for (i, key) in parents.iter().enumerate() {
        let entry = cur
            .entry((*key).to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => bail!("--set `{set}`: `{}` is not a table", keys[..=i].join(".")),
        };
    }
    cur.insert((*last).to_owned(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_load_and_validate() {
        let c = SimConfig::defaults().unwrap();
        assert_eq!(c.rollout.engines, 6);
        assert_eq!(c.trainer.gpus, 2);
        assert_eq!(c.run.profiles.len() * c.run.settings.len(), 12);
        assert_eq!(c.setting["R3"].batch, 128);
        assert_eq!(c.profile["gsm8k"].prompt_tokens, 104);
    }

    #[test]
    fn set_overrides_values_and_lists() {
        let c = SimConfig::load(
            &[],
            &[
                "trainer.gpus=4".into(),
                "run.modes=[\"sync\"]".into(),
                "profile.math.sigma=0.7".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.trainer.gpus, 4);
        assert_eq!(c.run.modes, vec![Schedule::of(Mode::Sync)]);
        assert_eq!(c.profile["math"].sigma, 0.7);
    }

    #[test]
    fn config_file_layers_merge_deeply() {
        let layer = "[rollout]\nengines = 3\n[setting.R9]\nbatch = 4\ngroup = 2\ncap = 64\nmicro_batch = 2\ndraw_batch = 4\nopt_steps = 1\n";
        let c = SimConfig::load(&[("layer.toml".into(), layer.into())], &[]).unwrap();
        assert_eq!(c.rollout.engines, 3);
        // The rest of [rollout] keeps its defaults.
        assert_eq!(c.rollout.max_running, 512);
        assert_eq!(c.setting["R9"].cap, 64);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let err = SimConfig::load(&[], &["trainer.gpu=4".into()]).unwrap_err();
        assert!(format!("{err:#}").contains("gpu"), "{err:#}");
        let err = SimConfig::load(&[], &["trainer.gpus=0".into()]).unwrap_err();
        assert!(format!("{err:#}").contains("trainer.gpus"), "{err:#}");
        let err = SimConfig::load(&[], &["setting.R1.micro_batch=5".into()]).unwrap_err();
        assert!(format!("{err:#}").contains("setting.R1"), "{err:#}");
        let err = SimConfig::load(&[], &["run.profiles=[\"nope\"]".into()]).unwrap_err();
        assert!(format!("{err:#}").contains("nope"), "{err:#}");
        assert!(SimConfig::load(&[], &["no_equals_sign".into()]).is_err());
        assert!(SimConfig::load(&[], &["rollout.engines.x=1".into()]).is_err());
    }
}
