//! `rolloutpipe compare`: a measurement of `sync` against `rolloutpipe` (optionally more modes)
//! on the same seed, workload and SFT weights.
//!
//! - The modes run **interleaved** (A B A B …, `--repeats` rounds), so slow drifts of the
//!   machine's load hit every mode alike; each round's runs are adjacent and form a pair.
//! - Each run is summarised by the **medians** over its timed steps; a mode by the median over
//!   its runs with a percentile-bootstrap **95% confidence interval**; the effect by the paired
//!   per-round cut `1 − mode/baseline`, with its own interval.
//! - The simulator is **fitted on the baseline runs only** and predicts every mode, so the
//!   prediction's error against the measured cut is a real out-of-sample check.
//! - The table says what share of a sync step the rollout is: pipelining can only hide training
//!   behind a rollout tail, so a workload whose rollout is a small share measures little.
//!
//! SIGINT/SIGTERM stop after the run in progress (which itself stops after its current step)
//! and write the table of the runs that finished.
mod fit;
mod report;
mod stats;

use std::path::PathBuf;

use anyhow::Context;

use crate::train::{Mode, RunOutcome, TrainConfig};

pub use stats::Interval;

/// Arguments of `compare`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A TOML file layered over the embedded default run config.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Overrides one value of the run config: `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Modes to run, comma-separated; the first is the baseline.
    #[arg(long, default_value = "sync,rolloutpipe", value_delimiter = ',')]
    pub modes: Vec<String>,
    /// Rounds: every mode runs this many times, interleaved (A B A B …). At least 5 gives a
    /// usable confidence interval; 1 gives point values only.
    #[arg(long, default_value_t = 5)]
    pub repeats: u32,
    /// Output directory: `MODE/repK/` run directories, `compare.md`, `compare.json`, plots.
    #[arg(long, default_value = "runs/compare")]
    pub out: PathBuf,
    /// Backend of the engines and the trainer: cpu or wgpu (overrides run.backend).
    #[arg(long)]
    pub backend: Option<String>,
    /// Replace the runs already in --out (only the files a run writes); without it an
    /// existing run there is refused, never deleted.
    #[arg(long)]
    pub force: bool,
}

/// Most rounds `compare` accepts (each round runs every mode once).
const MAX_REPEATS: u32 = 100;

/// One finished run.
pub struct Run {
    /// Its mode.
    pub mode: Mode,
    /// Its round (0-based).
    pub repeat: u32,
    /// What it measured.
    pub outcome: RunOutcome,
}

/// Runs `compare`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (base, modes) = setup(&args)?;
    // Refuse before the first run starts, not after it finished: the per-mode run
    // directories and the top-level compare.md, compare.json, plots and fitted config.
    let _lock = crate::rundir::claim_dir(&args.out, args.force, "--out")?;
    crate::interrupt::install()?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let (runs, stopped) = rounds(&args, &base, &modes)?;
    anyhow::ensure!(
        !runs.is_empty(),
        "interrupted before any run finished: {}",
        stopped.unwrap_or_default()
    );
    let seed = base.run.seed;
    let measured = report::measured_rows(&modes, &runs, seed);
    let cuts = report::paired_cuts(&modes, &runs, seed);
    // The simulator, fitted on the baseline runs only. Its failure must not lose the measured
    // table: that is written either way, with the reason.
    let fitted: Vec<&RunOutcome> = runs
        .iter()
        .filter(|r| r.mode == modes[0])
        .map(|r| &r.outcome)
        .collect();
    let simulated = fit::simulate_measured(&args.out, &base, &modes, &fitted);
    let (sim_rows, sim_error) = match simulated {
        Ok(s) => (report::simulated_rows(&s, seed), None),
        Err(e) => (Vec::new(), Some(format!("{e:#}"))),
    };
    let mut table = report::render(&modes, &runs, &measured, &cuts, &sim_rows);
    if let Some(e) = &sim_error {
        table.push_str(&format!(
            "\nThe simulation of these runs failed, so only measured rows are shown: {e}\n"
        ));
    }
    if let Some(why) = &stopped {
        table.push_str(&format!(
            "\nStopped early ({why}): the table covers the {} runs that finished.\n",
            runs.len()
        ));
    }
    std::fs::write(args.out.join("compare.md"), &table)?;
    let json = serde_json::json!({
        "repeats": args.repeats,
        "measured": measured,
        "paired_cuts": cuts,
        "simulated_fitted_on": modes[0].name(),
        "simulated": sim_rows,
        "runs": runs.iter().map(report::run_json).collect::<Vec<_>>(),
    });
    std::fs::write(
        args.out.join("compare.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    report::plots(&args.out, &measured, &sim_rows, &runs)?;
    print!("{table}");
    if let Some(e) = sim_error {
        anyhow::bail!(
            "the measured table is in {}, but simulating the measured runs failed: {e}",
            args.out.join("compare.md").display()
        );
    }
    if let Some(why) = stopped {
        anyhow::bail!(
            "stopped early: {why}; the table of the finished runs is in {}",
            args.out.join("compare.md").display()
        );
    }
    Ok(())
}

/// The base config (default or `--config`, with `--set` and `--backend`) and the modes, the
/// first the baseline; refused before anything runs.
fn setup(args: &Args) -> anyhow::Result<(TrainConfig, Vec<Mode>)> {
    let mut base = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading config {}", p.display()))?;
            TrainConfig::from_partial_toml(&text)?
        }
        None => TrainConfig::default_config()?,
    };
    let mut sets = args.sets.clone();
    if let Some(b) = &args.backend {
        sets.push(format!("run.backend=\"{b}\""));
    }
    base = base.with_overrides(&sets)?;
    anyhow::ensure!(!args.modes.is_empty(), "--modes is empty");
    anyhow::ensure!(
        (1..=MAX_REPEATS).contains(&args.repeats),
        "--repeats must be in 1..={MAX_REPEATS}, got {}",
        args.repeats
    );
    let modes: Vec<Mode> = args
        .modes
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<anyhow::Result<_>>()?;
    for (i, m) in modes.iter().enumerate() {
        anyhow::ensure!(!modes[..i].contains(m), "--modes names {} twice", m.name());
    }
    base.validate()?;
    Ok((base, modes))
}

/// The runs, mode after mode in each round; with the reason when a signal stopped them early.
fn rounds(
    args: &Args,
    base: &TrainConfig,
    modes: &[Mode],
) -> anyhow::Result<(Vec<Run>, Option<String>)> {
    let sft_dir = args.out.join(modes[0].name()).join("rep0").join("sft");
    let mut runs: Vec<Run> = Vec::new();
    for repeat in 0..args.repeats {
        for &mode in modes {
            let mut cfg = base.clone();
            cfg.run.mode = mode;
            if mode == Mode::OneStepOff {
                cfg.rl.old_logprobs = crate::train::config::OldLogprobs::Rollout;
            }
            if !runs.is_empty() && cfg.sft.steps > 0 {
                // Every run starts from the same warm-started weights; SFT runs once.
                cfg.model.dir = sft_dir.clone();
                cfg.sft.steps = 0;
            }
            cfg.validate()?;
            let dir = args.out.join(mode.name()).join(format!("rep{repeat}"));
            tracing::info!(mode = mode.name(), repeat, "compare: running");
            let opts = crate::train::RunOptions {
                resume: false,
                force: args.force,
            };
            match crate::train::run_with(&cfg, &dir, opts) {
                Ok(outcome) => runs.push(Run {
                    mode,
                    repeat,
                    outcome,
                }),
                Err(e) if crate::interrupt::requested() => {
                    return Ok((runs, Some(format!("{e:#}"))));
                }
                Err(e) => return Err(e),
            }
            if crate::interrupt::requested() {
                let why = format!("interrupted after {} {}", mode.name(), dir.display());
                return Ok((runs, Some(why)));
            }
        }
    }
    Ok((runs, None))
}
