//! What a run checks about its directory before it writes anything: the lock, that a fresh run
//! does not land on someone else's files, and that a resume keeps every setting that cannot
//! change mid-run.
use std::path::Path;

use anyhow::{Context, bail};

use super::config::TrainConfig;
use crate::rundir::{self, RunLock};

/// How `train::run_with` treats its directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunOptions {
    /// Continue the run in the directory from its latest checkpoint.
    pub resume: bool,
    /// A fresh run may replace the artefacts of an earlier run in the directory.
    pub force: bool,
}

/// Files and directories a run writes; `--force` replaces exactly these, nothing else.
pub const RUN_ARTEFACTS: &[&str] = &[
    "checkpoints",
    "sft",
    "reference",
    "final",
    "config.toml",
    "metrics.jsonl",
    "trace.json",
    "summary.json",
    "learning_curves.svg",
    "step_times.svg",
    "step_timeline.svg",
];

/// Takes the directory's lock and checks it may be written: a fresh run needs an empty
/// directory (or `--force`, which removes only [`RUN_ARTEFACTS`]); a resume needs the run's
/// config to agree with `cfg` on every setting that cannot change mid-run.
pub fn prepare(cfg: &TrainConfig, out: &Path, opts: RunOptions) -> anyhow::Result<RunLock> {
    if out.is_file() {
        bail!("run directory {} is a file", out.display());
    }
    let lock = rundir::lock(out)?;
    if opts.resume {
        let p = out.join("config.toml");
        let text = std::fs::read_to_string(&p)
            .with_context(|| format!("reading the run's config {}", p.display()))?;
        let old = TrainConfig::from_toml_str(&text).with_context(|| format!("{}", p.display()))?;
        check_resumable(&old, cfg)?;
    } else if rundir::has_contents(out) {
        if !opts.force {
            let hint = if out.join("checkpoints").join("latest").exists() {
                format!(
                    "it holds a run; continue it with --resume {} or pass --force to replace it",
                    out.display()
                )
            } else {
                "pass --force to replace a run's files there".to_owned()
            };
            bail!(
                "run directory {} is not empty; {hint}, or pick another --out",
                out.display()
            );
        }
        for name in RUN_ARTEFACTS {
            let p = out.join(name);
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else if p.exists() {
                std::fs::remove_file(&p)
            } else {
                Ok(())
            };
            r.with_context(|| format!("--force: removing {}", p.display()))?;
        }
    }
    Ok(lock)
}

/// Refuses a resume whose config changes a setting the checkpoint depends on, naming it.
pub fn check_resumable(old: &TrainConfig, new: &TrainConfig) -> anyhow::Result<()> {
    let (o, n) = (table(old)?, table(new)?);
    // Whole sections: the problems, the model's shape and initial weights, the warm start
    // (already done) and test faults all define what the checkpoint is.
    let fixed_sections = ["task", "model", "sft"];
    // Single keys: the seed drives every draw; the mode shapes the checkpoint (one-step-off
    // keeps a pending batch); group_size shapes the pending groups; beta decides whether a
    // reference model was saved.
    let fixed_keys = [
        ("run", "seed"),
        ("run", "mode"),
        ("rl", "group_size"),
        ("rl", "beta"),
    ];
    for sec in fixed_sections {
        let (a, b) = (o.get(sec), n.get(sec));
        if a != b {
            let key = a
                .and_then(|a| a.as_table())
                .zip(b.and_then(|b| b.as_table()))
                .and_then(|(a, b)| {
                    a.keys()
                        .chain(b.keys())
                        .find(|k| a.get(*k) != b.get(*k))
                        .cloned()
                })
                .unwrap_or_default();
            bail!(
                "--resume cannot change {sec}.{key} (the run has {}, asked for {}): it is fixed for the whole run; start a new run with --out instead",
                show(a, &key),
                show(b, &key)
            );
        }
    }
    for (sec, key) in fixed_keys {
        let get = |t: &toml::Table| t.get(sec).and_then(|s| s.get(key)).cloned();
        let (a, b) = (get(&o), get(&n));
        if a != b {
            bail!(
                "--resume cannot change {sec}.{key} (the run has {}, asked for {}): it is fixed for the whole run; start a new run with --out instead",
                a.map(|v| v.to_string()).unwrap_or_default(),
                b.map(|v| v.to_string()).unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn table(c: &TrainConfig) -> anyhow::Result<toml::Table> {
    toml::Value::try_from(c)?
        .try_into()
        .context("config to table")
}

fn show(section: Option<&toml::Value>, key: &str) -> String {
    section
        .and_then(|s| s.get(key))
        .map(|v| v.to_string())
        .unwrap_or_else(|| "nothing".into())
}

/// Writes `config.toml` through a temporary file, so a crash never leaves half a config.
pub fn write_config(cfg: &TrainConfig, out: &Path) -> anyhow::Result<()> {
    let p = out.join("config.toml");
    let tmp = out.join(".config.toml.tmp");
    std::fs::write(&tmp, cfg.to_toml()?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_refuses_fixed_settings_by_name_and_accepts_the_rest() {
        let a = TrainConfig::default_config().unwrap();
        let mut b = a.clone();
        b.run.steps += 5;
        b.rl.lr *= 0.5;
        b.run.checkpoint_every = 1;
        check_resumable(&a, &b).unwrap();
        for (set, name) in [
            ("task.name=mul", "task.name"),
            ("model.layers=3", "model.layers"),
            ("run.seed=77", "run.seed"),
            ("run.mode=\"sync\"", "run.mode"),
            ("rl.group_size=3", "rl.group_size"),
        ] {
            let mut b = a.with_overrides(&[set.to_owned()]).unwrap();
            if b == a {
                // The default already has this value: change it another way.
                b = a.with_overrides(&["run.mode=\"cgp\"".to_owned()]).unwrap();
            }
            let err = check_resumable(&a, &b).unwrap_err().to_string();
            assert!(err.contains(name), "{set}: {err}");
        }
    }
}
