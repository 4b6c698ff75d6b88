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

use crate::plot::{self, Series};
use crate::sim::config::{Mode, QueueOrder, Schedule, SimConfig};
use crate::sim::report;
use crate::sim::{RunResult, Simulated, simulate};

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

/// Mean of the r2t cut of `mode` against sync over the runs of one sweep point.
fn mean_cut(results: &[RunResult], sync: &[RunResult], mode: Mode) -> f64 {
    let cuts: Vec<f64> = results
        .iter()
        .filter(|r| r.mode == mode)
        .filter_map(|r| {
            let s = sync
                .iter()
                .find(|s| s.profile == r.profile && s.setting == r.setting)?;
            Some((s.mean_r2t() - r.mean_r2t()) / s.mean_r2t())
        })
        .collect();
    cuts.iter().sum::<f64>() / cuts.len().max(1) as f64
}

/// A point of the swept axes: (over-sampling draw factor, concurrency).
type SweepPoint = (u32, u32);
/// One mode's r2t cuts over the settings.
type ModeCuts = (Schedule, Vec<f64>);

/// The swept axes: the baseline's over-sampling chunk (`draw_batch` B or 2B) and the per-engine
/// concurrency (`sglang_server_concurrency`), for every setting and the on-policy modes. Writes
/// `sweep_axes.csv` (one line per run) and `sweep_axes.txt` (per mode: the range of the r2t cut
/// over all settings at each axis point, and over everything).
fn sweep_axes(cfg: &SimConfig, out: &Path, threads: usize) -> anyhow::Result<()> {
    // The on-policy overlapping modes: CGP and RolloutPipe, and CGP with its tail policies.
    let modes: Vec<Schedule> = (Schedule::NAMED.into_iter())
        .filter(|m| m.mode.pipelined() && cfg.run.modes.contains(m))
        .collect();
    let mut csv = String::from(
        "draw_factor,concurrency,profile,setting,mode,r2t_s,r2t_cut,bound_cut,wait_ratio,slime_wait\n",
    );
    let mut summary: Vec<(SweepPoint, Vec<ModeCuts>)> = Vec::new();
    for draw in [1u32, 2] {
        for conc in [32u32, 128, 512] {
            let mut c = cfg.clone();
            c.rollout.max_running = conc;
            for s in c.setting.values_mut() {
                s.max_running = None;
                s.draw_batch = s.batch * draw;
            }
            c.run.modes = std::iter::once(Mode::Sync.into())
                .chain(modes.iter().copied())
                .collect();
            let results: Vec<RunResult> = run_all(&c, &jobs_of(&c, None), threads)?
                .into_iter()
                .map(|s| s.result)
                .collect();
            let mut per_mode: Vec<ModeCuts> = modes.iter().map(|&m| (m, vec![])).collect();
            for r in results.iter().filter(|r| r.mode != Mode::Sync) {
                let Some(s) = results.iter().find(|s| {
                    s.mode == Mode::Sync && s.profile == r.profile && s.setting == r.setting
                }) else {
                    continue;
                };
                let cut = (s.mean_r2t() - r.mean_r2t()) / s.mean_r2t();
                let bound = (s.mean_r2t() - s.mean_ideal()) / s.mean_r2t();
                csv.push_str(&format!(
                    "{draw},{conc},{},{},{},{:.6},{:.6},{:.6},{:.6},{:.6}\n",
                    r.profile,
                    r.setting,
                    r.mode,
                    r.mean_r2t(),
                    cut,
                    bound,
                    r.mean_wait_ratio(),
                    r.mean_slime_wait_ratio()
                ));
                if let Some((_, v)) = per_mode.iter_mut().find(|(m, _)| *m == r.mode) {
                    v.push(cut);
                }
            }
            summary.push(((draw, conc), per_mode));
        }
    }
    std::fs::write(out.join("sweep_axes.csv"), csv).context("writing sweep_axes.csv")?;
    let txt = axes_summary(cfg, &modes, &summary);
    std::fs::write(out.join("sweep_axes.txt"), &txt).context("writing sweep_axes.txt")?;
    print!("{txt}");
    Ok(())
}

/// `sweep_axes.txt`: per mode, the range of the r2t cut over the settings at each axis point
/// and over all of them, after which axis point the main table ran at.
fn axes_summary(
    cfg: &SimConfig,
    modes: &[Schedule],
    summary: &[(SweepPoint, Vec<ModeCuts>)],
) -> String {
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{:.1}% .. {:.1}%", 100.0 * lo, 100.0 * hi)
    };
    let mut txt = String::from(
        "r2t cut vs sync (same draw_batch and concurrency), range over the selected settings\n",
    );
    // Which axis point the main table ran at, if any.
    let draw_default = cfg
        .setting
        .values()
        .all(|s| s.draw_batch == s.batch)
        .then_some(1)
        .or_else(|| {
            cfg.setting
                .values()
                .all(|s| s.draw_batch == 2 * s.batch)
                .then_some(2)
        });
    let conc = cfg.rollout.max_running;
    let conc_default = cfg
        .setting
        .values()
        .all(|s| s.max_running(&cfg.rollout) == conc);
    match draw_default {
        Some(d) if conc_default && [32, 128, 512].contains(&conc) => txt.push_str(&format!(
            "default (table.txt): draw_batch {d}B, {conc} per engine\n"
        )),
        _ => txt.push_str("default (table.txt): not an axis point of this sweep\n"),
    }
    for &m in modes {
        txt.push_str(&format!("\n{m}\n"));
        let mut all = Vec::new();
        for ((draw, conc), per_mode) in summary {
            if let Some((_, v)) = per_mode.iter().find(|(x, _)| *x == m) {
                txt.push_str(&format!(
                    "  draw_batch {draw}B, {conc:>3} per engine: {}\n",
                    range(v)
                ));
                all.extend_from_slice(v);
            }
        }
        txt.push_str(&format!("  over all axis points: {}\n", range(&all)));
    }
    txt
}

fn sweeps(cfg: &SimConfig, out: &Path, threads: usize, base: &[RunResult]) -> anyhow::Result<()> {
    sweep_axes(cfg, out, threads)?;
    let sync: Vec<RunResult> = base
        .iter()
        .filter(|r| r.mode == Mode::Sync)
        .cloned()
        .collect();
    sweep_frontier(cfg, out, threads, &sync)?;
    sweep_trainer(cfg, out, threads)
}

/// The frontier widths swept.
const WIDTHS: [u32; 7] = [0, 1, 2, 4, 8, 16, 64];

/// Frontier width: RolloutPipe only (the other modes do not use it), per setting. Under a
/// group-major baseline order FIFO already admits the frontier first, so the sweep also runs
/// with the interleaved order, where admission order matters.
fn sweep_frontier(
    cfg: &SimConfig,
    out: &Path,
    threads: usize,
    sync: &[RunResult],
) -> anyhow::Result<()> {
    let mut csv =
        String::from("submit_order,width,profile,setting,mode,r2t_s,r2t_cut,wait_ratio\n");
    let mut lines_fw: Vec<Series<(f64, f64)>> = Vec::new();
    let mut orders = vec![cfg.scheduler.submit_order];
    if cfg.scheduler.submit_order != QueueOrder::Interleaved {
        orders.push(QueueOrder::Interleaved);
    }
    for order in orders {
        let (rp_lines, cgp_lines) = frontier_order(cfg, threads, sync, order, &mut csv)?;
        lines_fw.extend(rp_lines);
        if order == QueueOrder::Interleaved {
            lines_fw.extend(cgp_lines);
        }
    }
    std::fs::write(out.join("sweep_frontier.csv"), csv).context("writing sweep_frontier.csv")?;
    plot::lines(
        &out.join("sweep_frontier.svg"),
        "Frontier width: r2t cut vs sync (mean over profiles)",
        "frontier width (extra groups)",
        "cut, percent",
        &lines_fw,
    )
}

/// Per-setting lines of the cut against sync over the frontier widths.
type CutLines = Vec<Series<(f64, f64)>>;

/// The frontier sweep under one baseline order: its CSV lines, and per setting the
/// RolloutPipe and CGP lines of the cut against sync.
fn frontier_order(
    cfg: &SimConfig,
    threads: usize,
    sync: &[RunResult],
    order: QueueOrder,
    csv: &mut String,
) -> anyhow::Result<(CutLines, CutLines)> {
    let oname = format!("{order:?}").to_lowercase();
    let mut c = cfg.clone();
    c.scheduler.submit_order = order;
    let cgp = run_mode(&mut c, Mode::Cgp, threads)?;
    let lines = |m: Mode| -> CutLines {
        (cfg.run.settings.iter())
            .map(|s| Series::new(format!("{m} {s} {oname}"), Vec::new()))
            .collect()
    };
    let (mut rp_lines, mut cgp_lines) = (lines(Mode::Rolloutpipe), lines(Mode::Cgp));
    for w in WIDTHS {
        c.scheduler.frontier_width = w;
        let res = run_mode(&mut c, Mode::Rolloutpipe, threads)?;
        for r in res
            .iter()
            .chain(if w == 0 { cgp.iter() } else { [].iter() })
        {
            let s = sync
                .iter()
                .find(|s| s.profile == r.profile && s.setting == r.setting);
            let cut = s.map_or(f64::NAN, |s| (s.mean_r2t() - r.mean_r2t()) / s.mean_r2t());
            csv.push_str(&format!(
                "{oname},{w},{},{},{},{:.4},{:.5},{:.5}\n",
                r.profile,
                r.setting,
                r.mode,
                r.mean_r2t(),
                cut,
                r.mean_wait_ratio()
            ));
        }
        for (i, s) in cfg.run.settings.iter().enumerate() {
            let sel: Vec<RunResult> = res.iter().filter(|r| &r.setting == s).cloned().collect();
            rp_lines[i].values.push((
                f64::from(w),
                100.0 * mean_cut(&sel, sync, Mode::Rolloutpipe),
            ));
            let sel: Vec<RunResult> = cgp.iter().filter(|r| &r.setting == s).cloned().collect();
            cgp_lines[i]
                .values
                .push((f64::from(w), 100.0 * mean_cut(&sel, sync, Mode::Cgp)));
        }
    }
    Ok((rp_lines, cgp_lines))
}

/// `c`'s table in `mode` only.
fn run_mode(c: &mut SimConfig, mode: Mode, threads: usize) -> anyhow::Result<Vec<RunResult>> {
    c.run.modes = vec![mode.into()];
    let mut work = jobs_of(c, None);
    work.retain(|j| j.mode == mode);
    Ok(run_all(c, &work, threads)?
        .into_iter()
        .map(|s| s.result)
        .collect())
}

/// Trainer pool: the training share of a sync step bounds any overlap.
fn sweep_trainer(cfg: &SimConfig, out: &Path, threads: usize) -> anyhow::Result<()> {
    let gpus = [1u32, 2, 3, 4, 6, 8];
    let mut csv = String::from(
        "trainer_gpus,profile,setting,mode,r2t_s,r2t_cut,wait_ratio,rollout_s,train_s\n",
    );
    let modes = [Mode::Cgp, Mode::Rolloutpipe];
    let mut lines: Vec<Series<(f64, f64)>> = modes
        .iter()
        .map(|m| Series::new(m.name(), Vec::new()))
        .collect();
    let mut bound = Series::new("ideal bound", Vec::new());
    let mut share = Series::new("training share of sync step", Vec::new());
    for &g in &gpus {
        let mut c = cfg.clone();
        c.trainer.gpus = g;
        c.run.modes = [Mode::Sync, Mode::Cgp, Mode::Rolloutpipe]
            .map(Schedule::of)
            .to_vec();
        let res: Vec<RunResult> = run_all(&c, &jobs_of(&c, None), threads)?
            .into_iter()
            .map(|s| s.result)
            .collect();
        let sync_g: Vec<RunResult> = res
            .iter()
            .filter(|r| r.mode == Mode::Sync)
            .cloned()
            .collect();
        for r in &res {
            let s = sync_g
                .iter()
                .find(|s| s.profile == r.profile && s.setting == r.setting);
            let cut = s.map_or(f64::NAN, |s| (s.mean_r2t() - r.mean_r2t()) / s.mean_r2t());
            csv.push_str(&format!(
                "{g},{},{},{},{:.4},{:.5},{:.5},{:.4},{:.4}\n",
                r.profile,
                r.setting,
                r.mode,
                r.mean_r2t(),
                cut,
                r.mean_wait_ratio(),
                r.mean_rollout(),
                r.mean_trainer_busy()
            ));
        }
        for (i, m) in modes.iter().enumerate() {
            lines[i]
                .values
                .push((f64::from(g), 100.0 * mean_cut(&res, &sync_g, *m)));
        }
        let n = sync_g.len().max(1) as f64;
        let ideal = sync_g
            .iter()
            .map(|s| (s.mean_r2t() - s.mean_ideal()) / s.mean_r2t())
            .sum::<f64>()
            / n;
        let tshare = sync_g
            .iter()
            .map(|s| s.mean_trainer_busy() / s.mean_r2t())
            .sum::<f64>()
            / n;
        bound.values.push((f64::from(g), 100.0 * ideal));
        share.values.push((f64::from(g), 100.0 * tshare));
    }
    std::fs::write(out.join("sweep_trainer.csv"), csv).context("writing sweep_trainer.csv")?;
    lines.push(bound);
    lines.push(share);
    plot::lines(
        &out.join("sweep_trainer.svg"),
        "Trainer pool size: r2t cut vs sync (mean over 12 settings)",
        "trainer GPUs",
        "percent",
        &lines,
    )
}
