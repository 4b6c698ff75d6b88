//! `rolloutpipe simulate`: the discrete-event simulator (see `crate::sim`).
//!
//! Runs every selected (profile, setting) in every selected mode, prints the comparison table
//! and writes it (CSV, JSON) with plots and a Chrome trace under `--out`. `--sweep` adds the
//! sensitivity sweeps (over-sampling chunk and concurrency, frontier width, trainer pool size); `--bench` only times the runs.
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};

use crate::sim::config::{Mode, Schedule, SimConfig};
use crate::sim::report;
use crate::sim::{RunResult, Simulated, simulate};

mod sweeps;
use sweeps::sweeps;

/// Arguments of `simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// TOML file deep-merged over the built-in defaults (repeatable; later files win).
    #[arg(long = "config", value_name = "FILE")]
    pub configs: Vec<PathBuf>,
    /// Override one value, e.g. `--set trainer.gpus=4` or `--set run.modes='["sync","cgp"]'`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Directory for the table, plots and trace.
    #[arg(long, default_value = "sim-out")]
    pub out: PathBuf,
    /// The `profile/setting` whose Gantt timelines, completion CDF and trace are drawn.
    #[arg(long, default_value = "math/R1")]
    pub focus: String,
    /// Also run the sensitivity sweeps (frontier width; trainer pool size).
    #[arg(long)]
    pub sweep: bool,
    /// Only time all settings in all modes (no files written) and report the speed.
    #[arg(long)]
    pub bench: bool,
    /// Skip plots and the trace (tables only).
    #[arg(long)]
    pub no_plots: bool,
    /// Worker threads (default: available parallelism).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Print the resolved configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Write into a non-empty --out (files of the same names are replaced); without it a
    /// non-empty --out is refused.
    #[arg(long)]
    pub force: bool,
    /// Compare the allocation policies (GRPO, DAPO-style filter, VIGOR, Pilot-Commit) under
    /// CGP+FGD instead of the modes; writes `alloc.md` and `alloc.csv` (docs/allocation.md).
    #[arg(long)]
    pub alloc: bool,
    /// With `--alloc`: a policy's rollouts to the target accuracy over fixed G's, measured by
    /// real runs, e.g. `vigor=0.8` (repeatable); fills the time-to-target column.
    #[arg(long = "rollouts-to-target", value_name = "POLICY=RATIO")]
    pub rollouts_to_target: Vec<String>,
    /// With `--alloc`: use `[alloc]`'s n0/increment/n_pilot/n_commit as given instead of
    /// scaling them to each setting's G (n0 = n_pilot = n_commit = G/2, increment = G/4).
    #[arg(long)]
    pub alloc_unscaled: bool,
}

/// One unit of work.
#[derive(Debug, Clone)]
struct Job {
    profile: String,
    setting: String,
    mode: Schedule,
    record: bool,
}

/// Runs jobs on `jobs` threads; results come back in job order.
fn run_all(cfg: &SimConfig, work: &[Job], jobs: usize) -> anyhow::Result<Vec<Simulated>> {
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<anyhow::Result<Simulated>>>> =
        work.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1).min(work.len().max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(j) = work.get(i) else { break };
                    let r = simulate(cfg, &j.profile, &j.setting, j.mode, j.record);
                    if let Ok(mut slot) = slots[i].lock() {
                        *slot = Some(r);
                    }
                }
            });
        }
    });
    slots
        .into_iter()
        .zip(work)
        .map(|(m, j)| {
            let r = m.into_inner().ok().flatten();
            r.with_context(|| format!("{}/{}/{}: no result", j.profile, j.setting, j.mode))?
                .with_context(|| {
                    format!("simulating {}/{} in mode {}", j.profile, j.setting, j.mode)
                })
        })
        .collect()
}

/// All (profile, setting, mode) jobs of a config, in table order.
fn jobs_of(cfg: &SimConfig, focus: Option<(&str, &str)>) -> Vec<Job> {
    let mut modes = cfg.run.modes.clone();
    // The reductions and the ideal bound are against sync: always run it, first.
    modes.retain(|m| *m != Mode::Sync);
    modes.insert(0, Mode::Sync.into());
    let mut out = Vec::new();
    for p in &cfg.run.profiles {
        for s in &cfg.run.settings {
            for &mode in &modes {
                let record = focus == Some((p.as_str(), s.as_str()));
                out.push(Job {
                    profile: p.clone(),
                    setting: s.clone(),
                    mode,
                    record,
                });
            }
        }
    }
    out
}

fn load(args: &Args) -> anyhow::Result<SimConfig> {
    let mut texts = Vec::new();
    for path in &args.configs {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        texts.push((path.display().to_string(), text));
    }
    SimConfig::load(&texts, &args.sets)
}

/// Runs the simulator.
pub fn run(args: Args) -> anyhow::Result<()> {
    let cfg = load(&args)?;
    if args.print_config {
        print!(
            "{}",
            toml::to_string(&cfg).context("serializing the config")?
        );
        return Ok(());
    }
    let threads = args
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if args.bench {
        return bench(&cfg, threads);
    }
    // Held until the tables and plots are written; a refused or failed start leaves --out as
    // it was.
    let _lock = crate::rundir::claim_dir(&args.out, args.force, "--out")?;
    if args.alloc {
        return super::simulate_alloc::run(
            &cfg,
            &args.out,
            threads,
            &args.rollouts_to_target,
            !args.alloc_unscaled,
        );
    }
    let (fp, fs) = args
        .focus
        .split_once('/')
        .context("--focus must be profile/setting, e.g. math/R1")?;
    if !cfg.profile.contains_key(fp) || !cfg.setting.contains_key(fs) {
        bail!("--focus {}: unknown profile or setting", args.focus);
    }
    let work = focus_jobs(&cfg, (fp, fs));
    let t0 = Instant::now();
    let sims = run_all(&cfg, &work, threads)?;
    let elapsed = t0.elapsed();
    let in_table: Vec<RunResult> = sims
        .iter()
        .filter(|s| {
            cfg.run.profiles.contains(&s.result.profile)
                && cfg.run.settings.contains(&s.result.setting)
        })
        .map(|s| s.result.clone())
        .collect();
    for r in &in_table {
        if !r.conserved {
            bail!(
                "{}/{}/{}: the core's conservation check failed",
                r.profile,
                r.setting,
                r.mode
            );
        }
    }
    let rows = report::rows(&in_table);
    print_table(&rows);
    println!(
        "simulated {} runs in {:.2} s on {threads} threads",
        sims.len(),
        elapsed.as_secs_f64()
    );
    report::write_tables(&args.out, &rows, &in_table, &cfg)?;
    if !args.no_plots {
        report::plot_bars(&args.out, &rows)?;
        plot_focus(&cfg, &args.out, &sims, (fp, fs))?;
    }
    if args.sweep {
        sweeps(&cfg, &args.out, threads, &in_table)?;
    }
    println!("wrote {}", args.out.display());
    Ok(())
}

/// Every job of the table, the focus setting's recorded (run as extra jobs when it is outside
/// the selected table).
fn focus_jobs(cfg: &SimConfig, (fp, fs): (&str, &str)) -> Vec<Job> {
    let mut work = jobs_of(cfg, None);
    for j in &mut work {
        j.record = j.profile == fp && j.setting == fs;
    }
    if !work.iter().any(|j| j.record) {
        let mut extra = jobs_of(cfg, Some((fp, fs)));
        extra.retain(|j| j.profile == fp && j.setting == fs);
        extra.iter_mut().for_each(|j| j.record = true);
        work.extend(extra);
    }
    work
}

/// The table on stdout, then each mode's range of cuts against sync.
fn print_table(rows: &[report::Row]) {
    print!("{}", report::table_text(rows));
    println!();
    for (mode, lo, hi, wlo, whi) in report::headline(rows) {
        println!(
            "{mode:>13}: rollout-to-train-end {:+.1}% .. {:+.1}%, trainer waiting {:+.1}% .. {:+.1}% vs sync",
            -100.0 * hi,
            -100.0 * lo,
            -100.0 * whi,
            -100.0 * wlo
        );
    }
}

/// The focus setting's completion CDF, and per mode its Gantt plot and Chrome trace.
fn plot_focus(
    cfg: &SimConfig,
    out: &Path,
    sims: &[Simulated],
    (fp, fs): (&str, &str),
) -> anyhow::Result<()> {
    let focus: Vec<&Simulated> = sims
        .iter()
        .filter(|s| s.result.profile == fp && s.result.setting == fs)
        .collect();
    let results: Vec<&RunResult> = focus.iter().map(|s| &s.result).collect();
    report::plot_cdf(
        out,
        &results,
        &format!("Group completion times, {fp}/{fs} (all steps)"),
    )?;
    let step = u64::from(cfg.run.trace_step);
    let engines = cfg.rollout.engines as usize;
    for s in &focus {
        let name = s.result.mode.name();
        report::plot_gantt(
            &out.join(format!("gantt_{name}.svg")),
            &s.result,
            &s.recording,
            step,
            engines,
        )?;
        report::write_trace(
            &out.join(format!("trace_{name}.json")),
            &s.result,
            &s.recording,
            step,
            engines,
        )?;
    }
    Ok(())
}

fn bench(cfg: &SimConfig, threads: usize) -> anyhow::Result<()> {
    let mut c = cfg.clone();
    c.run.modes = Schedule::NAMED.to_vec();
    let work = jobs_of(&c, None);
    for t in [1, threads] {
        let t0 = Instant::now();
        let sims = run_all(&c, &work, t)?;
        let dt = t0.elapsed().as_secs_f64();
        let events: u64 = sims.iter().map(|s| s.result.events).sum();
        println!(
            "simulate --bench: {} runs ({} settings x {} modes, {} steps each), {events} events in {dt:.2} s on {t} thread(s) ({:.1} M events/s)",
            sims.len(),
            c.run.profiles.len() * c.run.settings.len(),
            c.run.modes.len(),
            c.run.steps,
            events as f64 / dt / 1e6
        );
        if t == threads {
            break;
        }
    }
    Ok(())
}
