//! Reading and writing a [`TrainConfig`]: the embedded default, a partial file merged over it,
//! `--set` overrides, the resolved TOML a run directory keeps, and the tiny config tests use.
use anyhow::{Context, ensure};

use super::{DEFAULT_TOML, TrainConfig};
use crate::toml_config::{from_table, merge, parse_value};

/// What [`TrainConfig::tiny`] sets over the default: about a second of work on two cores.
const TINY: &[&str] = &[
    "run.seed=3",
    "run.steps=2",
    "run.eval_every=0",
    "run.eval_problems=24",
    "run.test_problems=0",
    "run.checkpoint_every=0",
    "run.progress=false",
    "task.name=\"add\"",
    "task.digits=1",
    // A 1-layer model with GQA (2 query heads, 1 KV head).
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.layers=1",
    "model.heads=2",
    "model.kv_heads=1",
    "model.head_dim=16",
    // A short warm start on the true answers, so that groups have mixed rewards.
    "sft.steps=40",
    "sft.batch=16",
    "sft.lr=1e-2",
    "sft.carry_drop=0.0",
    "rl.batch_groups=4",
    "rl.group_size=4",
    "rl.micro_batch=1",
    "rl.max_new_tokens=4",
    "rl.lr=1e-3",
    // Fewer slots than requests, so that admission order matters.
    "rollout.engines=2",
    "rollout.slots=4",
    "rollout.max_groups_factor=4.0",
];

impl TrainConfig {
    /// The embedded default.
    pub fn default_config() -> anyhow::Result<Self> {
        Self::from_toml_str(DEFAULT_TOML).context("the embedded default config")
    }

    /// The smallest run that still exercises everything (tests and examples): 1-digit
    /// addition, a 1-layer model warm-started for 40 steps, 2 RL steps of 4 groups of 4 on 2
    /// engines of 4 slots, no evaluation between the ends, no checkpoint until the last step.
    /// Tests change what they need with [`set`](Self::set).
    pub fn tiny() -> Self {
        // The default and these overrides are part of the binary and tested below.
        Self::default_config()
            .and_then(|c| c.set(TINY))
            .unwrap_or_else(|e| unreachable!("the tiny config: {e:#}"))
    }

    /// Parses a complete config.
    pub fn from_toml_str(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    /// The default with `text` (any subset of sections and keys) merged over it.
    pub fn from_partial_toml(text: &str) -> anyhow::Result<Self> {
        let mut base: toml::Table = toml::from_str(DEFAULT_TOML)?;
        let over: toml::Table = toml::from_str(text)?;
        merge(&mut base, over);
        from_table(base)
    }

    /// Applies `section.key=value` overrides (the value is TOML; a bare word is a string).
    pub fn with_overrides(&self, sets: &[String]) -> anyhow::Result<Self> {
        let mut t: toml::Table = toml::Value::try_from(self)?
            .try_into()
            .context("config to table")?;
        for s in sets {
            let (path, raw) = s
                .split_once('=')
                .with_context(|| format!("--set {s:?}: expected section.key=value"))?;
            let (section, key) = path
                .trim()
                .split_once('.')
                .with_context(|| format!("--set {s:?}: the key must be section.key"))?;
            let value = parse_value(raw.trim());
            let sec = t
                .get_mut(section)
                .and_then(|v| v.as_table_mut())
                .with_context(|| format!("--set {s:?}: no section [{section}]"))?;
            ensure!(
                sec.contains_key(key),
                "--set {s:?}: [{section}] has no key {key:?}"
            );
            sec.insert(key.to_owned(), value);
        }
        from_table(t).context("applying --set overrides")
    }

    /// [`with_overrides`](Self::with_overrides) for string literals.
    pub fn set(&self, sets: &[&str]) -> anyhow::Result<Self> {
        let sets: Vec<String> = sets.iter().map(|s| (*s).to_owned()).collect();
        self.with_overrides(&sets)
    }

    /// The resolved config as TOML (written into the run directory).
    pub fn to_toml(&self) -> anyhow::Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use rolloutpipe_core::DispatchPolicy;

    use super::super::{Mode, WeightDType};
    use super::*;

    #[test]
    fn a_mistyped_override_is_one_line_naming_the_key() {
        let e = TrainConfig::default_config()
            .unwrap()
            .with_overrides(&["run.steps=-3".into()])
            .unwrap_err();
        let msg = format!("{e:#}");
        assert_eq!(msg.lines().count(), 1, "{msg}");
        assert!(msg.contains("run.steps"), "{msg}");
    }

    /// `c` without `key`'s line (as an older run directory's config holds it).
    pub(in super::super) fn toml_without(c: &TrainConfig, key: &str) -> String {
        let line = format!("{key} =");
        (c.to_toml().unwrap().lines())
            .filter(|l| !l.starts_with(&line))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    #[test]
    fn run_directories_written_before_rollout_dtype_read_as_f32() {
        let c = TrainConfig::default_config().unwrap();
        let old = toml_without(&c, "dtype");
        assert!(!old.contains("dtype"), "{old}");
        let back = TrainConfig::from_toml_str(&old).unwrap();
        assert_eq!(back.rollout.dtype, WeightDType::F32);
        let bf = c
            .with_overrides(&["rollout.dtype=\"bf16\"".into()])
            .unwrap();
        assert_eq!(bf.rollout.dtype, WeightDType::Bf16);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = TrainConfig::from_partial_toml("[rl]\nbatch_grups = 3\n").unwrap_err();
        assert!(format!("{err:#}").contains("batch_grups"), "{err:#}");
        let c = TrainConfig::default_config().unwrap();
        let err = c.with_overrides(&["rl.nope=1".into()]).unwrap_err();
        assert!(err.to_string().contains("no key \"nope\""), "{err}");
    }

    #[test]
    fn overrides_apply_typed_values() {
        let c = TrainConfig::default_config().unwrap();
        let c = c
            .with_overrides(&[
                "rl.batch_groups=4".into(),
                "run.mode=sync".into(),
                "rl.lr=0.01".into(),
            ])
            .unwrap();
        assert_eq!(c.rl.batch_groups, 4);
        assert_eq!(c.run.mode, Mode::Sync);
        assert_eq!(c.rl.lr, 0.01);
        assert_eq!(c.plan().dispatch, DispatchPolicy::Sync);
        let err = c
            .with_overrides(&["rl.batch_groups=abc".into()])
            .unwrap_err();
        assert!(format!("{err:#}").contains("batch_groups"), "{err:#}");
    }

    #[test]
    fn round_trips_through_toml() {
        for c in [TrainConfig::default_config().unwrap(), TrainConfig::tiny()] {
            let back = TrainConfig::from_toml_str(&c.to_toml().unwrap()).unwrap();
            assert_eq!(back, c);
        }
        TrainConfig::tiny().validate().unwrap();
    }
}
