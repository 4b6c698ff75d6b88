//! `rolloutpipe compare`: runs `sync` and `rolloutpipe` (optionally more modes) on the same seed
//! and workload, measures both headline metrics from real timestamps, writes a table and plots,
//! fits the simulator's parameters to what it measured, and runs the simulator on them so that
//! prediction and measurement sit side by side.
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::plot::{self, Series};
use crate::sim::{self, SimConfig};
use crate::train::{Measured, Mode, RunOutcome, StepMetrics, TrainConfig};

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
    /// Output directory (one run directory per mode inside).
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

/// Mean and median of one metric over a run's steps.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Stat {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub median: f64,
}

fn stat(v: impl Iterator<Item = f64>) -> Stat {
    let mut v: Vec<f64> = v.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return Stat {
            mean: f64::NAN,
            median: f64::NAN,
        };
    }
    v.sort_by(f64::total_cmp);
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Stat { mean, median }
}

/// One row of the comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// Mode.
    pub mode: String,
    /// `measured` or `simulated`.
    pub source: String,
    /// Rollout-to-train-end time, s.
    pub r2t: Stat,
    /// Trainer waiting ratio.
    pub wait: Stat,
    /// Rollout time, s.
    pub rollout: Stat,
    /// Ideal bound, s.
    pub ideal: Stat,
}

/// Steps whose timings count: the first step pays one-time costs (page faults, allocator
/// growth, thread start), so it is left out when there are at least three.
fn timed(ms: &[StepMetrics]) -> &[StepMetrics] {
    if ms.len() >= 3 { &ms[1..] } else { ms }
}

fn row_of(mode: &str, source: &str, ms: &[StepMetrics]) -> Row {
    let ms = timed(ms);
    Row {
        mode: mode.into(),
        source: source.into(),
        r2t: stat(ms.iter().map(|m| m.rollout_to_train_end_s)),
        wait: stat(ms.iter().map(|m| m.trainer_wait_ratio)),
        rollout: stat(ms.iter().map(|m| m.rollout_s)),
        ideal: stat(ms.iter().map(|m| m.ideal_s)),
    }
}

/// Runs `compare`.
pub fn run(args: Args) -> anyhow::Result<()> {
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
    let modes: Vec<Mode> = args
        .modes
        .iter()
        .map(|m| Mode::parse(m))
        .collect::<anyhow::Result<_>>()?;
    base.validate()?;
    // Refuse before the first run starts, not after it finished.
    for mode in &modes {
        let dir = args.out.join(mode.name());
        if !args.force && crate::rundir::has_contents(&dir) {
            anyhow::bail!(
                "{} already holds a run; pass --force to replace it or pick another --out",
                dir.display()
            );
        }
    }
    super::train::pin_gemm_threads();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut outcomes: Vec<(Mode, RunOutcome)> = Vec::new();
    for (i, &mode) in modes.iter().enumerate() {
        let mut cfg = base.clone();
        cfg.run.mode = mode;
        if mode == Mode::OneStepOff {
            cfg.rl.old_logprobs = crate::train::config::OldLogprobs::Rollout;
        }
        if i > 0 && cfg.sft.steps > 0 {
            // Every mode starts from the same warm-started weights; SFT runs once.
            cfg.model.dir = args.out.join(modes[0].name()).join("sft");
            cfg.sft.steps = 0;
        }
        cfg.validate()?;
        let dir = args.out.join(mode.name());
        tracing::info!(mode = mode.name(), "compare: running");
        let opts = crate::train::RunOptions {
            resume: false,
            force: args.force,
        };
        let o = crate::train::run_with(&cfg, &dir, opts)?;
        outcomes.push((mode, o));
    }

    let mut rows: Vec<Row> = outcomes
        .iter()
        .map(|(m, o)| row_of(m.name(), "measured", &o.metrics))
        .collect();

    // The simulator, fed what this machine measured. Its failure must not lose the measured
    // runs' table: that is written either way, with the reason.
    let simulated = simulate_measured(&args.out, &base, &modes, &outcomes);
    let sim_error = match simulated {
        Ok(sim_rows) => {
            rows.extend(sim_rows);
            None
        }
        Err(e) => Some(format!("{e:#}")),
    };

    let mut table = render(&rows, &modes, &outcomes);
    if let Some(e) = &sim_error {
        table.push_str(&format!(
            "\nThe simulation of these runs failed, so only measured rows are shown: {e}\n"
        ));
    }
    std::fs::write(args.out.join("compare.md"), &table)?;
    std::fs::write(
        args.out.join("compare.json"),
        serde_json::to_string_pretty(&rows)?,
    )?;
    plots(&args.out, &rows, &outcomes)?;
    print!("{table}");
    if let Some(e) = sim_error {
        anyhow::bail!(
            "the measured table is in {}, but simulating the measured runs failed: {e}",
            args.out.join("compare.md").display()
        );
    }
    Ok(())
}

/// The simulator's rows for every mode, from the parameters the real runs measured.
fn simulate_measured(
    out: &Path,
    base: &TrainConfig,
    modes: &[Mode],
    outcomes: &[(Mode, RunOutcome)],
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let mut all = Measured::default();
    for (_, o) in outcomes {
        merge_measured(&mut all, &o.measured);
    }
    let first = &outcomes[0].1.metrics;
    let (acc0, acc1) = (
        first.first().map(|m| m.train_accuracy).unwrap_or(0.5),
        first.last().map(|m| m.train_accuracy).unwrap_or(0.5),
    );
    let sim_toml = simulator_config(base, &all, acc0, acc1, modes)?;
    let sim_path = out.join("sim_measured.toml");
    std::fs::write(&sim_path, &sim_toml)?;
    let sim_cfg = SimConfig::load(&[(sim_path.display().to_string(), sim_toml)], &[])
        .context("the measured simulator config")?;
    for &mode in modes {
        let sm = match mode {
            Mode::Sync => sim::Mode::Sync,
            Mode::Cgp => sim::Mode::Cgp,
            Mode::Rolloutpipe => sim::Mode::Rolloutpipe,
            Mode::OneStepOff => sim::Mode::OneStepOff,
        };
        let s = sim::simulate(&sim_cfg, "measured", "measured", sm, false)?;
        let ms: Vec<StepMetrics> = s
            .result
            .steps
            .iter()
            .map(|st| StepMetrics {
                step: st.step,
                rollout_s: st.rollout(),
                rollout_to_train_end_s: st.r2t(),
                trainer_wait_ratio: st.wait_ratio(),
                ideal_s: st.rollout() + st.last_tail,
                ..StepMetrics::default()
            })
            .collect();
        rows.push(row_of(mode.name(), "simulated", &ms));
    }
    Ok(rows)
}

fn merge_measured(a: &mut Measured, b: &Measured) {
    a.decode.extend(&b.decode);
    a.verify_s.extend(&b.verify_s);
    a.micro_batches.extend(&b.micro_batches);
    a.opt_s.extend(&b.opt_s);
    a.sync_s.extend(&b.sync_s);
    a.prompt_tokens.extend(&b.prompt_tokens);
    a.response_tokens.extend(&b.response_tokens);
    a.slots = b.slots;
    a.engines = b.engines;
}

/// Least-squares line `y = a + b x`.
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    if points.is_empty() {
        return (0.0, 0.0);
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - b * mx, b)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// The measured parameters in the simulator's config format (docs/simulator.md).
fn simulator_config(
    cfg: &TrainConfig,
    m: &Measured,
    acc_start: f64,
    acc_late: f64,
    modes: &[Mode],
) -> anyhow::Result<String> {
    let decode: Vec<(f64, f64)> = m.decode.iter().map(|&(r, s)| (r as f64, s * 1e3)).collect();
    let (base_ms, per_seq_ms) = fit(&decode);
    let mbs: Vec<(f64, f64)> = m
        .micro_batches
        .iter()
        .map(|&(_, all, s)| (all as f64, s))
        .collect();
    let (mb_overhead, per_tok) = fit(&mbs);
    let lens: Vec<f64> = m.response_tokens.iter().map(|&t| t.max(1) as f64).collect();
    let mean_len = mean(&lens).max(1.0);
    let logs: Vec<f64> = lens.iter().map(|l| l.ln()).collect();
    let ml = mean(&logs);
    let sigma =
        (logs.iter().map(|l| (l - ml).powi(2)).sum::<f64>() / logs.len().max(1) as f64).sqrt();
    let cap = cfg.rl.max_new_tokens as f64;
    let runaway = lens.iter().filter(|&&l| l >= cap).count() as f64 / lens.len().max(1) as f64;
    let prompt = mean(
        &m.prompt_tokens
            .iter()
            .map(|&t| t as f64)
            .collect::<Vec<_>>(),
    )
    .round()
    .max(1.0);
    let clampacc = |a: f64| a.clamp(0.01, 0.99);
    let mut s = String::new();
    writeln!(
        s,
        "# Measured by `rolloutpipe compare` on this machine (see docs/training.md)."
    )?;
    writeln!(
        s,
        "# Decode: {} iterations fitted; micro-batches: {}; verifier: {} responses.",
        m.decode.len(),
        m.micro_batches.len(),
        m.verify_s.len()
    )?;
    writeln!(
        s,
        "[run]\nseed = {}\nsteps = {}\nprofiles = [\"measured\"]\nsettings = [\"measured\"]",
        cfg.run.seed, cfg.run.steps
    )?;
    let names: Vec<String> = modes.iter().map(|m| format!("\"{}\"", m.name())).collect();
    writeln!(s, "modes = [{}]\ntrace_step = 0\n", names.join(", "))?;
    writeln!(
        s,
        "[rollout]\nengines = {}\nmax_running = {}",
        cfg.rollout.engines, cfg.rollout.slots
    )?;
    writeln!(
        s,
        "kv_capacity_tokens = 100000000  # the CPU engine has no KV limit that binds"
    )?;
    writeln!(s, "kv_new_token_ratio = 0.0")?;
    writeln!(
        s,
        "decode_base_ms = {:.6}  # fitted: iteration time vs running requests",
        base_ms.max(1e-6)
    )?;
    writeln!(s, "decode_per_seq_ms = {:.6}", per_seq_ms.max(0.0))?;
    writeln!(
        s,
        "decode_per_kilo_kv_ms = 0.0  # not separable from per-sequence cost at these lengths"
    )?;
    writeln!(
        s,
        "prefill_tok_per_s = 1e9  # prefill is inside the measured iteration times"
    )?;
    writeln!(s, "verifier_latency_s = {:.9}\n", mean(&m.verify_s))?;
    writeln!(s, "[trainer]\ngpus = 1")?;
    writeln!(
        s,
        "fwd_bwd_tok_per_s_per_gpu = {:.3}  # fitted: micro-batch time vs prompt+response tokens",
        if per_tok > 0.0 { 1.0 / per_tok } else { 1e9 }
    )?;
    writeln!(
        s,
        "logprob_tok_per_s_per_gpu = 1e9\nlogprob_passes = 0  # log-probs are recomputed inside the same forward pass"
    )?;
    writeln!(s, "micro_batch_overhead_s = {:.6}", mb_overhead.max(0.0))?;
    writeln!(s, "optimizer_step_s = {:.6}", mean(&m.opt_s))?;
    writeln!(s, "weight_sync_s = {:.6}\n", mean(&m.sync_s))?;
    let order = &cfg.rollout.submit_order;
    writeln!(
        s,
        "[scheduler]\nfrontier_width = {}\nsubmit_order = \"{order}\"\nmax_attempts = {}\nmax_groups_factor = {}\n",
        cfg.rollout.frontier_width, cfg.rollout.max_attempts, cfg.rollout.max_groups_factor
    )?;
    writeln!(
        s,
        "[profile.measured]\nlabel = \"{} (measured)\"\nprompt_tokens = {}",
        cfg.task.name, prompt as u32
    )?;
    writeln!(
        s,
        "mean_tokens_start = {mean_len:.3}\nmean_tokens_late = {mean_len:.3}\nsigma = {sigma:.4}\nrunaway = {:.4}",
        runaway.min(0.99)
    )?;
    writeln!(
        s,
        "acc_start = {:.4}\nacc_late = {:.4}\nbeta_k = 1.5  # est. (not measured)\nwrong_length_factor = 1.0  # not measured\n",
        clampacc(acc_start),
        clampacc(acc_late)
    )?;
    writeln!(
        s,
        "[setting.measured]\nbatch = {}\ngroup = {}\ncap = {}\nmax_running = {}\nmicro_batch = {}\ndraw_batch = {}\nopt_steps = {}",
        cfg.rl.batch_groups,
        cfg.rl.group_size,
        cfg.rl.max_new_tokens,
        cfg.rollout.slots,
        cfg.rl.micro_batch,
        cfg.rollout.draw_batch,
        cfg.rl.opt_steps
    )?;
    Ok(s)
}

fn render(rows: &[Row], modes: &[Mode], outcomes: &[(Mode, RunOutcome)]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| mode | source | rollout-to-train-end s (mean / median) | trainer waiting ratio (mean / median) | rollout s | ideal bound s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} / {:.3} | {:.3} / {:.3} | {:.3} | {:.3} |",
            r.mode,
            r.source,
            r.r2t.mean,
            r.r2t.median,
            r.wait.mean,
            r.wait.median,
            r.rollout.mean,
            r.ideal.mean
        );
    }
    let _ = writeln!(s);
    let base = modes[0].name();
    for source in ["measured", "simulated"] {
        let b = rows.iter().find(|r| r.mode == base && r.source == source);
        for r in rows.iter().filter(|r| r.source == source && r.mode != base) {
            if let Some(b) = b {
                let _ = writeln!(
                    s,
                    "{source}: {} vs {base}: rollout-to-train-end {:+.1}% (medians {:+.1}%), trainer waiting ratio {:+.1}% (medians {:+.1}%), overlap efficiency {:.2}",
                    r.mode,
                    100.0 * (r.r2t.mean / b.r2t.mean - 1.0),
                    100.0 * (r.r2t.median / b.r2t.median - 1.0),
                    100.0 * (r.wait.mean / b.wait.mean - 1.0),
                    100.0 * (r.wait.median / b.wait.median - 1.0),
                    (b.r2t.mean - r.r2t.mean) / (b.r2t.mean - b.ideal.mean),
                );
            }
        }
    }
    for (m, o) in outcomes {
        let _ = writeln!(
            s,
            "{}: held-out accuracy {:.3} -> {:.3} over {} steps",
            m.name(),
            o.accuracy_start,
            o.accuracy_end,
            o.metrics.len()
        );
    }
    s
}

fn plots(out: &Path, rows: &[Row], outcomes: &[(Mode, RunOutcome)]) -> anyhow::Result<()> {
    let cats: Vec<String> = rows
        .iter()
        .map(|r| format!("{} ({})", r.mode, r.source))
        .collect();
    plot::bars(
        &out.join("compare_r2t.svg"),
        "Rollout-to-train-end time (mean over steps)",
        "seconds",
        &cats,
        &[
            Series::new(
                "rollout-to-train-end",
                rows.iter().map(|r| r.r2t.mean).collect(),
            ),
            Series::new("ideal bound", rows.iter().map(|r| r.ideal.mean).collect()),
        ],
    )?;
    plot::bars(
        &out.join("compare_wait.svg"),
        "Trainer waiting ratio (mean over steps)",
        "wait / (wait + busy)",
        &cats,
        &[Series::new(
            "waiting ratio",
            rows.iter().map(|r| r.wait.mean).collect(),
        )],
    )?;
    let series: Vec<Series<(f64, f64)>> = outcomes
        .iter()
        .map(|(m, o)| {
            Series::new(
                m.name(),
                o.metrics
                    .iter()
                    .map(|x| (x.step as f64, x.rollout_to_train_end_s))
                    .collect(),
            )
        })
        .collect();
    plot::lines(
        &out.join("compare_steps.svg"),
        "Rollout-to-train-end time per step (measured)",
        "step",
        "seconds",
        &series,
    )
}
