//! `rolloutpipe train`: an end-to-end RLVR run (see `crate::train` and docs/training.md).
use std::path::PathBuf;

use anyhow::Context;

use crate::train::{Mode, TrainConfig};

/// Arguments of `train`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A TOML file (any subset of the default's sections and keys) layered over the embedded
    /// default; with --resume, defaults to the run directory's resolved config.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Overrides one value: `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Backend of the engines and the trainer: cpu, wgpu or cuda (overrides run.backend).
    #[arg(long)]
    pub backend: Option<String>,
    /// Scheduling mode: sync, cgp, rolloutpipe or one-step-off (overrides run.mode).
    #[arg(long)]
    pub mode: Option<String>,
    /// Run directory (overrides run.out).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in this directory from its latest checkpoint.
    #[arg(long, conflicts_with = "out")]
    pub resume: Option<PathBuf>,
    /// Print the resolved config (every section and key, with the values this run would use)
    /// and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Let a fresh run replace an earlier run's files in --out (only the files a run writes).
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,
}

/// The `--help` epilogue: every config section with its keys and default values, and where to
/// see them resolved.
pub fn config_help() -> String {
    let mut s = String::from(
        "Config: TOML sections and keys with their defaults. Change them with --config FILE (any\n\
         subset) or --set section.key=value; --print-config shows the resolved config.\n",
    );
    let table: toml::Table = match toml::from_str(crate::train::config::DEFAULT_TOML) {
        Ok(t) => t,
        Err(_) => return s,
    };
    for (section, keys) in &table {
        let Some(keys) = keys.as_table() else {
            continue;
        };
        let items: Vec<String> = keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
        s.push_str(&format!("  [{section}] {}\n", items.join(" ")));
    }
    s
}

/// Resolves the config of `args` (default, file or resumed run's, then flags and --set).
pub fn resolve(args: &Args) -> anyhow::Result<TrainConfig> {
    let mut cfg = match (&args.config, &args.resume) {
        (Some(p), _) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading config {}", p.display()))?;
            TrainConfig::from_partial_toml(&text)
                .with_context(|| format!("config {}", p.display()))?
        }
        (None, Some(dir)) => {
            let p = dir.join("config.toml");
            let text = std::fs::read_to_string(&p)
                .with_context(|| format!("reading the run's config {}", p.display()))?;
            TrainConfig::from_toml_str(&text).with_context(|| format!("config {}", p.display()))?
        }
        (None, None) => TrainConfig::default_config()?,
    };
    let mut sets = args.sets.clone();
    if let Some(b) = &args.backend {
        sets.push(format!("run.backend=\"{b}\""));
    }
    if let Some(m) = &args.mode {
        Mode::parse(m)?;
        sets.push(format!("run.mode=\"{m}\""));
    }
    cfg = cfg.with_overrides(&sets)?;
    if let Some(dir) = args.resume.as_ref().or(args.out.as_ref()) {
        cfg.run.out = dir.clone();
    }
    cfg.validate()?;
    Ok(cfg)
}

/// Runs `train`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let cfg = resolve(&args)?;
    if args.print_config {
        print!("{}", cfg.to_toml()?);
        return Ok(());
    }
    // Ctrl-C / SIGTERM now end the current step with a checkpoint instead of killing the run.
    crate::interrupt::install()?;
    let out = cfg.run.out.clone();
    let opts = crate::train::RunOptions {
        resume: args.resume.is_some(),
        force: args.force,
    };
    let o = crate::train::run_with(&cfg, &out, opts)?;
    let last = o.metrics.last();
    println!(
        "run {}: {} steps, held-out accuracy {}{:.3} -> {:.3}; last step: reward {:.3}, rollout-to-train-end {:.2}s, trainer waiting {:.2}",
        out.display(),
        o.metrics.len(),
        o.accuracy_initial
            .map(|a| format!("{a:.3} (before SFT) -> "))
            .unwrap_or_default(),
        o.accuracy_start,
        o.accuracy_end,
        last.map(|m| m.reward).unwrap_or(f64::NAN),
        last.map(|m| m.timing.rollout_to_train_end_s)
            .unwrap_or(f64::NAN),
        last.map(|m| m.timing.trainer_wait_ratio)
            .unwrap_or(f64::NAN),
    );
    if let [initial, Some(start), Some(end)] = o.test_accuracy {
        println!(
            "independent test set ({} problems, operands uniform, seed {}): accuracy {}{start:.3} -> {end:.3} (RL {:+.1} points)",
            cfg.run.test_problems,
            cfg.run.test_seed,
            initial
                .map(|a| format!("{a:.3} (before SFT) -> "))
                .unwrap_or_default(),
            100.0 * (end - start),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> Args {
        Args {
            config: None,
            sets: Vec::new(),
            backend: None,
            mode: None,
            out: None,
            resume: None,
            print_config: false,
            force: false,
        }
    }

    #[test]
    fn flags_override_the_default_and_bad_values_say_why() {
        let mut a = args();
        a.mode = Some("sync".into());
        a.out = Some(PathBuf::from("/tmp/x"));
        a.sets = vec!["rl.batch_groups=4".into()];
        let c = resolve(&a).unwrap();
        assert_eq!((c.run.mode, c.rl.batch_groups), (Mode::Sync, 4));
        assert_eq!(c.run.out, PathBuf::from("/tmp/x"));
        a.mode = Some("async".into());
        assert!(
            resolve(&a)
                .unwrap_err()
                .to_string()
                .contains("unknown mode")
        );
        let mut a = args();
        a.backend = Some("tpu".into());
        assert!(resolve(&a).unwrap_err().to_string().contains("tpu"));
    }

    #[test]
    fn resume_reads_the_run_directory_config() {
        let dir = std::env::temp_dir().join(format!("rp-train-resolve-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = TrainConfig::default_config().unwrap();
        c.rl.batch_groups = 4;
        std::fs::write(dir.join("config.toml"), c.to_toml().unwrap()).unwrap();
        let mut a = args();
        a.resume = Some(dir.clone());
        a.sets = vec!["run.steps=7".into()];
        let r = resolve(&a).unwrap();
        assert_eq!((r.rl.batch_groups, r.run.steps), (4, 7));
        assert_eq!(r.run.out, dir);
        let mut a = args();
        a.resume = Some(dir.join("missing"));
        assert!(format!("{:#}", resolve(&a).unwrap_err()).contains("config.toml"));
    }
}
