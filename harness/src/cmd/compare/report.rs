//! `compare`'s summaries, table and plots: per-run medians, per-mode medians with 95%
//! intervals over runs, paired per-round cuts, and the sync-fitted simulator's prediction.
use std::fmt::Write as _;
use std::path::Path;

use super::Run;
use super::stats::{self, Interval};
use crate::plot::{self, Series};
use crate::train::{Mode, StepMetrics};

/// Steps whose timings count: the first step pays one-time costs (page faults, allocator
/// growth, thread start), so it is left out when there are at least three.
fn timed(ms: &[StepMetrics]) -> &[StepMetrics] {
    if ms.len() >= 3 { &ms[1..] } else { ms }
}

/// The medians over one run's timed steps.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct RunMedians {
    /// Rollout-to-train-end time, s.
    pub r2t: f64,
    /// Trainer waiting ratio (inside the rollout-to-train-end window).
    pub wait: f64,
    /// Rollout time, s.
    pub rollout: f64,
    /// Trainer busy time per step, s.
    pub busy: f64,
    /// The bound given this rollout, s.
    pub ideal: f64,
}

fn medians(ms: &[StepMetrics]) -> RunMedians {
    let ms = timed(ms);
    let m = |f: fn(&StepMetrics) -> f64| stats::median(&ms.iter().map(f).collect::<Vec<_>>());
    RunMedians {
        r2t: m(|s| s.timing.rollout_to_train_end_s),
        wait: m(|s| s.timing.trainer_wait_ratio),
        rollout: m(|s| s.rollout_s),
        busy: m(|s| s.train_busy_s),
        ideal: m(|s| s.timing.ideal_s),
    }
}

/// One mode's summary: the median over its runs (measured) or over its steps (simulated),
/// with a 95% interval.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeRow {
    /// Mode.
    pub mode: String,
    /// `measured` (over runs) or `simulated` (over steps).
    pub source: String,
    /// Rollout-to-train-end time, s.
    pub r2t: Interval,
    /// Trainer waiting ratio.
    pub wait: Interval,
    /// Rollout time, s.
    pub rollout: Interval,
    /// Trainer busy time per step, s.
    pub busy: Interval,
    /// Bound given this rollout, s.
    pub ideal: Interval,
}

fn row(mode: &str, source: &str, ms: &[RunMedians], seed: u64) -> ModeRow {
    let ci =
        |f: fn(&RunMedians) -> f64| stats::median_ci(&ms.iter().map(f).collect::<Vec<_>>(), seed);
    ModeRow {
        mode: mode.into(),
        source: source.into(),
        r2t: ci(|m| m.r2t),
        wait: ci(|m| m.wait),
        rollout: ci(|m| m.rollout),
        busy: ci(|m| m.busy),
        ideal: ci(|m| m.ideal),
    }
}

/// One row per mode over its runs' medians.
pub fn measured_rows(modes: &[Mode], runs: &[Run], seed: u64) -> Vec<ModeRow> {
    modes
        .iter()
        .filter_map(|&mode| {
            let ms: Vec<RunMedians> = runs
                .iter()
                .filter(|r| r.mode == mode)
                .map(|r| medians(&r.outcome.metrics))
                .collect();
            (!ms.is_empty()).then(|| row(mode.name(), "measured", &ms, seed))
        })
        .collect()
}

/// One row per simulated mode, over its steps (one value per step).
pub fn simulated_rows(sim: &[(Mode, Vec<StepMetrics>)], seed: u64) -> Vec<ModeRow> {
    sim.iter()
        .map(|(mode, steps)| {
            let per_step: Vec<RunMedians> = timed(steps)
                .iter()
                .map(|s| medians(std::slice::from_ref(s)))
                .collect();
            row(
                mode.name(),
                "simulated (fitted on the baseline)",
                &per_step,
                seed,
            )
        })
        .collect()
}

/// The paired effect of one mode against the baseline: per round, `mode / baseline − 1`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cut {
    /// The mode compared with the baseline.
    pub mode: String,
    /// Relative change of the rollout-to-train-end time (negative = faster).
    pub r2t: Interval,
    /// Relative change of the trainer waiting ratio.
    pub wait: Interval,
}

/// The paired per-round cuts of every non-baseline mode (rounds where both ran).
pub fn paired_cuts(modes: &[Mode], runs: &[Run], seed: u64) -> Vec<Cut> {
    let of = |mode: Mode, repeat: u32| {
        runs.iter()
            .find(|r| r.mode == mode && r.repeat == repeat)
            .map(|r| medians(&r.outcome.metrics))
    };
    modes[1..]
        .iter()
        .map(|&mode| {
            let pairs: Vec<(RunMedians, RunMedians)> = runs
                .iter()
                .filter(|r| r.mode == mode)
                .filter_map(|r| Some((of(modes[0], r.repeat)?, medians(&r.outcome.metrics))))
                .collect();
            let rel = |f: fn(&RunMedians) -> f64| {
                let v: Vec<f64> = pairs.iter().map(|(b, m)| f(m) / f(b) - 1.0).collect();
                stats::median_ci(&v, seed)
            };
            Cut {
                mode: mode.name().into(),
                r2t: rel(|m| m.r2t),
                wait: rel(|m| m.wait),
            }
        })
        .collect()
}

/// One run's line in `compare.json`.
pub fn run_json(r: &Run) -> serde_json::Value {
    serde_json::json!({
        "mode": r.mode.name(),
        "repeat": r.repeat,
        "steps": r.outcome.metrics.len(),
        "medians": medians(&r.outcome.metrics),
        "heldout_accuracy": [r.outcome.accuracy_start, r.outcome.accuracy_end],
        "dir": r.outcome.dir.display().to_string(),
    })
}

fn iv(i: &Interval, digits: usize) -> String {
    if i.n > 1 {
        format!("{:.d$} [{:.d$}, {:.d$}]", i.median, i.lo, i.hi, d = digits)
    } else {
        format!("{:.d$}", i.median, d = digits)
    }
}

fn pct(i: &Interval) -> String {
    if i.n > 1 {
        format!(
            "{:+.1}% [{:+.1}, {:+.1}]",
            100.0 * i.median,
            100.0 * i.lo,
            100.0 * i.hi
        )
    } else {
        format!("{:+.1}%", 100.0 * i.median)
    }
}

/// The Markdown table `compare` prints and writes to `compare.md`.
pub fn render(
    modes: &[Mode],
    runs: &[Run],
    measured: &[ModeRow],
    cuts: &[Cut],
    simulated: &[ModeRow],
) -> String {
    let mut s = String::new();
    let rounds = runs.iter().map(|r| r.repeat + 1).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "Medians with 95% bootstrap intervals [lo, hi]; measured: over {rounds} interleaved round(s), each run summarised by the median of its timed steps; simulated: over steps.\n"
    );
    let _ = writeln!(
        s,
        "| mode | source | rollout-to-train-end s | trainer waiting ratio | rollout s | trainer busy s | bound given this rollout s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    for r in measured.iter().chain(simulated) {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            r.mode,
            r.source,
            iv(&r.r2t, 3),
            iv(&r.wait, 3),
            iv(&r.rollout, 3),
            iv(&r.busy, 3),
            iv(&r.ideal, 3)
        );
    }
    let _ = writeln!(s);
    let base = modes[0].name();
    cuts_table(&mut s, base, cuts, simulated);
    if let Some(b) = measured.iter().find(|r| r.mode == base) {
        let share = b.rollout.median / b.r2t.median;
        let _ = writeln!(
            s,
            "\nRollout share of a {base} step (median rollout / median rollout-to-train-end): {:.2}{}",
            share,
            if share < 0.5 {
                " - below 0.5: the rollout has little tail for pipelining to hide training behind, so this workload understates what CGP does on GPUs"
            } else {
                ""
            }
        );
    }
    for r in runs {
        let _ = writeln!(
            s,
            "{} round {}: held-out accuracy {:.3} -> {:.3} over {} steps",
            r.mode.name(),
            r.repeat,
            r.outcome.accuracy_start,
            r.outcome.accuracy_end,
            r.outcome.metrics.len()
        );
    }
    s
}

/// The cuts against the baseline, paired by round, beside the simulator's predictions.
fn cuts_table(s: &mut String, base: &str, cuts: &[Cut], simulated: &[ModeRow]) {
    let sim_of = |m: &str| simulated.iter().find(|r| r.mode == m);
    if !cuts.is_empty() {
        let _ = writeln!(
            s,
            "| vs {base} (paired by round) | rollout-to-train-end | interval excludes 0 | trainer waiting ratio | simulator's prediction (r2t) | prediction error, points |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
    }
    for c in cuts {
        let predicted = match (sim_of(&c.mode), sim_of(base)) {
            (Some(m), Some(b)) => Some(m.r2t.median / b.r2t.median - 1.0),
            _ => None,
        };
        let (p, e) = match predicted {
            Some(p) => (
                format!("{:+.1}%", 100.0 * p),
                format!("{:+.1}", 100.0 * (p - c.r2t.median)),
            ),
            None => ("-".into(), "-".into()),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {p} | {e} |",
            c.mode,
            pct(&c.r2t),
            if c.r2t.excludes_zero() { "yes" } else { "no" },
            pct(&c.wait)
        );
    }
}

/// Bars of the medians (measured and simulated) and the per-step medians over rounds.
pub fn plots(
    out: &Path,
    measured: &[ModeRow],
    simulated: &[ModeRow],
    runs: &[Run],
) -> anyhow::Result<()> {
    let rows: Vec<&ModeRow> = measured.iter().chain(simulated).collect();
    let cats: Vec<String> = rows
        .iter()
        .map(|r| format!("{} ({})", r.mode, r.source.split(' ').next().unwrap_or("")))
        .collect();
    plot::bars(
        &out.join("compare_r2t.svg"),
        "Rollout-to-train-end time (median)",
        "seconds",
        &cats,
        &[
            Series::new(
                "rollout-to-train-end",
                rows.iter().map(|r| r.r2t.median).collect(),
            ),
            Series::new(
                "bound given this rollout",
                rows.iter().map(|r| r.ideal.median).collect(),
            ),
        ],
    )?;
    plot::bars(
        &out.join("compare_wait.svg"),
        "Trainer waiting ratio (median)",
        "wait / (wait + busy)",
        &cats,
        &[Series::new(
            "waiting ratio",
            rows.iter().map(|r| r.wait.median).collect(),
        )],
    )?;
    let mut series: Vec<Series<(f64, f64)>> = Vec::new();
    for m in measured {
        let of_mode: Vec<&Run> = runs.iter().filter(|r| r.mode.name() == m.mode).collect();
        let steps = of_mode
            .iter()
            .map(|r| r.outcome.metrics.len())
            .max()
            .unwrap_or(0);
        let pts = (0..steps)
            .map(|k| {
                let v: Vec<f64> = of_mode
                    .iter()
                    .filter_map(|r| r.outcome.metrics.get(k))
                    .map(|x| x.timing.rollout_to_train_end_s)
                    .collect();
                (k as f64, stats::median(&v))
            })
            .collect();
        series.push(Series::new(&m.mode, pts));
    }
    plot::lines(
        &out.join("compare_steps.svg"),
        "Rollout-to-train-end time per step (median over rounds, measured)",
        "step",
        "seconds",
        &series,
    )
}
