//! Turning runs into the comparison table (stdout, CSV, JSON), plots and traces.
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use serde_json::json;

use super::config::Mode;
use super::engine::Ns;
use super::metrics::{RunResult, secs};

mod plots;
mod trace;
pub use plots::{plot_bars, plot_cdf, plot_gantt};
pub use trace::write_trace;

/// Window of one step: from its rollout start to its train end.
fn window(r: &RunResult, step: u64) -> Option<(f64, f64)> {
    r.steps
        .iter()
        .find(|s| s.step == step)
        .map(|s| (s.rollout_start, s.train_end))
}

fn overlaps(a: Ns, b: Ns, lo: f64, hi: f64) -> bool {
    secs(b) >= lo && secs(a) <= hi
}

/// One line of the comparison table: a (profile, setting) in one mode, or its ideal bound.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Profile key.
    pub profile: String,
    /// Setting key.
    pub setting: String,
    /// Mode name, or `ideal`.
    pub mode: String,
    /// Mean rollout-to-train-end time, s.
    pub r2t_s: f64,
    /// Mean step period (train end to train end, weight sync included), s.
    pub period_s: f64,
    /// Mean rollout duration (start to batch final), s.
    pub rollout_s: f64,
    /// Mean trainer busy time per step, s.
    pub train_s: f64,
    /// Mean trainer waiting ratio inside the r2t window.
    pub wait_ratio: f64,
    /// Mean of Slime's `perf/wait_time_ratio`: train end to train end, weight update included.
    pub slime_wait: f64,
    /// Cut of r2t against sync (0.3 = 30% shorter).
    pub r2t_cut: f64,
    /// Cut of the waiting ratio against sync.
    pub wait_cut: f64,
    /// Cut of the step period against sync.
    pub period_cut: f64,
    /// Overlap efficiency: (T_sync - T) / (T_sync - T_bound), T_bound the bound given this
    /// rollout (above 1 when a policy moves the bound).
    pub overlap_eff: f64,
    /// Rollout throughput, tokens/s.
    pub tok_per_s: f64,
    /// Mean slot occupancy during rollout.
    pub occupancy: f64,
    /// Mean rollout idle time between steps (training tail and weight sync), s.
    pub rollout_idle_s: f64,
    /// Mean rollout engines' idle time inside the r2t window, s per engine.
    pub engine_idle_s: f64,
    /// Groups whose log-prob pass ran on a rollout engine (all steps).
    pub mux_groups: u64,
    /// Requests migrated between engines (all steps).
    pub migrations: u64,
    /// Prompts drawn (all steps).
    pub drawn: u64,
    /// Groups trained.
    pub trained: u64,
    /// Groups filtered.
    pub filtered: u64,
    /// Groups aborted.
    pub aborted: u64,
    /// Requests aborted.
    pub aborted_requests: u64,
    /// Mean staleness (versions).
    pub staleness: f64,
    /// KV retractions (all steps).
    pub retractions: u64,
}

fn row(r: &RunResult, sync: Option<&RunResult>) -> Row {
    let (drawn, trained, filtered, aborted, aborted_requests) = r.totals();
    let (_, mux_groups, migrations) = r.policy_totals();
    let cut = |base: f64, x: f64| {
        if base > 0.0 {
            (base - x) / base
        } else {
            f64::NAN
        }
    };
    let (r2t, wait, period) = (r.mean_r2t(), r.mean_wait_ratio(), r.mean_period());
    let (r2t_cut, wait_cut, period_cut, overlap_eff) = match sync {
        Some(s) => {
            let (ts, ti) = (s.mean_r2t(), s.mean_ideal());
            let eff = if ts - ti > 1e-9 {
                (ts - r2t) / (ts - ti)
            } else {
                f64::NAN
            };
            (
                cut(ts, r2t),
                cut(s.mean_wait_ratio(), wait),
                cut(s.mean_period(), period),
                eff,
            )
        }
        None => (f64::NAN, f64::NAN, f64::NAN, f64::NAN),
    };
    Row {
        profile: r.profile.clone(),
        setting: r.setting.clone(),
        mode: r.mode.name().to_owned(),
        r2t_s: r2t,
        period_s: period,
        rollout_s: r.mean_rollout(),
        train_s: r.mean_trainer_busy(),
        wait_ratio: wait,
        slime_wait: r.mean_slime_wait_ratio(),
        r2t_cut,
        wait_cut,
        period_cut,
        overlap_eff,
        tok_per_s: r.mean_throughput(),
        occupancy: r.mean_occupancy(),
        rollout_idle_s: r.mean_rollout_idle(),
        engine_idle_s: r.mean_engine_idle(),
        mux_groups,
        migrations,
        drawn,
        trained,
        filtered,
        aborted,
        aborted_requests,
        staleness: r.mean_staleness(),
        retractions: r.steps.iter().map(|s| s.retractions).sum(),
    }
}

/// The row of the bound given this rollout, from the sync run (see `RunResult::mean_ideal`); in
/// that schedule the trainer waits only for what it cannot overlap.
fn ideal_row(sync: &RunResult) -> Row {
    let ideal = sync.mean_ideal();
    let mut r = row(sync, Some(sync));
    r.mode = BOUND.into();
    r.r2t_s = ideal;
    r.period_s = f64::NAN;
    r.rollout_idle_s = f64::NAN;
    r.engine_idle_s = f64::NAN;
    r.slime_wait = f64::NAN;
    // In the ideal schedule the trainer waits only for what it cannot overlap; averaged per
    // step like every other waiting ratio.
    let ratios: Vec<f64> = sync
        .steps
        .iter()
        .map(|s| {
            if s.ideal() > 0.0 {
                ((s.ideal() - s.trainer_busy) / s.ideal()).max(0.0)
            } else {
                0.0
            }
        })
        .collect();
    r.wait_ratio = ratios.iter().sum::<f64>() / ratios.len().max(1) as f64;
    r.r2t_cut = (sync.mean_r2t() - ideal) / sync.mean_r2t();
    r.wait_cut = (sync.mean_wait_ratio() - r.wait_ratio) / sync.mean_wait_ratio();
    r.period_cut = f64::NAN;
    r.overlap_eff = 1.0;
    r
}

/// The table's name for the bound given this rollout (the ideal `T_rollout + T_train(last
/// micro-batch)`, tightened).
pub const BOUND: &str = "bound";

/// Table rows for every run, grouped by (profile, setting) in run order, the ideal after sync.
pub fn rows(results: &[RunResult]) -> Vec<Row> {
    let mut out = Vec::new();
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in results {
        if !keys.contains(&(r.profile.as_str(), r.setting.as_str())) {
            keys.push((&r.profile, &r.setting));
        }
    }
    for (p, s) in keys {
        let group: Vec<&RunResult> = results
            .iter()
            .filter(|r| r.profile == p && r.setting == s)
            .collect();
        let sync = group.iter().copied().find(|r| r.mode == Mode::Sync);
        for r in &group {
            out.push(row(r, sync));
            if r.mode == Mode::Sync {
                out.push(ideal_row(r));
            }
        }
    }
    out
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:+.1}%", -100.0 * x)
    } else {
        "-".into()
    }
}

fn num(x: f64, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:.prec$}")
    } else {
        "-".into()
    }
}

/// The text table's column headings.
const HEADER: [&str; 22] = [
    "profile",
    "set",
    "mode",
    "r2t s",
    "vs sync",
    "wait",
    "vs sync",
    "slime wait",
    "overlap",
    "period s",
    "rollout s",
    "train s",
    "tok/s",
    "occ",
    "idle s",
    "eng idle s",
    "filtered",
    "aborted",
    "retract",
    "mux",
    "migr",
    "stale",
];

/// One row's cells of the text table.
fn cells(r: &Row) -> Vec<String> {
    vec![
        r.profile.clone(),
        r.setting.clone(),
        r.mode.clone(),
        num(r.r2t_s, 1),
        if r.mode == "sync" {
            String::new()
        } else {
            pct(r.r2t_cut)
        },
        num(r.wait_ratio, 3),
        if r.mode == "sync" {
            String::new()
        } else {
            pct(r.wait_cut)
        },
        num(r.slime_wait, 3),
        if r.mode == "sync" {
            String::new()
        } else {
            num(r.overlap_eff, 2)
        },
        num(r.period_s, 1),
        num(r.rollout_s, 1),
        num(r.train_s, 1),
        format!("{:.0}", r.tok_per_s),
        num(r.occupancy, 2),
        num(r.rollout_idle_s, 1),
        num(r.engine_idle_s, 1),
        r.filtered.to_string(),
        r.aborted.to_string(),
        r.retractions.to_string(),
        r.mux_groups.to_string(),
        r.migrations.to_string(),
        num(r.staleness, 1),
    ]
}

/// The table as aligned text: reductions are shown as signed changes against sync.
pub fn table_text(rows: &[Row]) -> String {
    let header = HEADER;
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for r in rows {
        lines.push(cells(r));
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| lines.iter().map(|l| l[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for (n, l) in lines.iter().enumerate() {
        let cells: Vec<String> = l
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i < 3 {
                    format!("{c:<w$}", w = widths[i])
                } else {
                    format!("{c:>w$}", w = widths[i])
                }
            })
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        if n == 0 {
            let _ = writeln!(
                out,
                "{}",
                "-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1))
            );
        }
    }
    out
}

/// The table as CSV (one row per line, the fields of [`Row`]).
pub fn table_csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "profile,setting,mode,r2t_s,period_s,rollout_s,train_s,wait_ratio,slime_wait,r2t_cut,wait_cut,period_cut,overlap_eff,tok_per_s,occupancy,rollout_idle_s,engine_idle_s,drawn,trained,filtered,aborted,aborted_requests,staleness,retractions,mux_groups,migrations\n",
    );
    for r in rows {
        let f = |x: f64| {
            if x.is_finite() {
                format!("{x:.6}")
            } else {
                String::new()
            }
        };
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.profile,
            r.setting,
            r.mode,
            f(r.r2t_s),
            f(r.period_s),
            f(r.rollout_s),
            f(r.train_s),
            f(r.wait_ratio),
            f(r.slime_wait),
            f(r.r2t_cut),
            f(r.wait_cut),
            f(r.period_cut),
            f(r.overlap_eff),
            f(r.tok_per_s),
            f(r.occupancy),
            f(r.rollout_idle_s),
            f(r.engine_idle_s),
            r.drawn,
            r.trained,
            r.filtered,
            r.aborted,
            r.aborted_requests,
            f(r.staleness),
            r.retractions,
            r.mux_groups,
            r.migrations
        );
    }
    out
}

/// Ranges of the cuts over all settings for each mode: (mode, min, max) of r2t and wait cuts.
pub fn headline(rows: &[Row]) -> Vec<(String, f64, f64, f64, f64)> {
    let mut modes: Vec<String> = Vec::new();
    for r in rows {
        if r.mode != "sync" && !modes.contains(&r.mode) {
            modes.push(r.mode.clone());
        }
    }
    modes
        .into_iter()
        .map(|m| {
            let sel: Vec<&Row> = rows.iter().filter(|r| r.mode == m).collect();
            let lo = |f: &dyn Fn(&Row) -> f64| {
                sel.iter()
                    .map(|r| f(r))
                    .filter(|x| x.is_finite())
                    .fold(f64::INFINITY, f64::min)
            };
            let hi = |f: &dyn Fn(&Row) -> f64| {
                sel.iter()
                    .map(|r| f(r))
                    .filter(|x| x.is_finite())
                    .fold(f64::NEG_INFINITY, f64::max)
            };
            (
                m,
                lo(&|r| r.r2t_cut),
                hi(&|r| r.r2t_cut),
                lo(&|r| r.wait_cut),
                hi(&|r| r.wait_cut),
            )
        })
        .collect()
}

/// Writes table.txt, table.csv and table.json (rows plus the per-step metrics and the config).
pub fn write_tables(
    dir: &Path,
    rows: &[Row],
    results: &[RunResult],
    config: &impl Serialize,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("table.txt"), table_text(rows)).context("writing table.txt")?;
    std::fs::write(dir.join("table.csv"), table_csv(rows)).context("writing table.csv")?;
    let doc = json!({ "rows": rows, "runs": results, "config": config });
    std::fs::write(
        dir.join("table.json"),
        serde_json::to_string_pretty(&doc).context("serializing table.json")?,
    )
    .context("writing table.json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::config::SimConfig;
    use crate::sim::simulate;

    fn results() -> Vec<RunResult> {
        let cfg = SimConfig::load(&[], &["run.steps=2".into()]).unwrap();
        [Mode::Sync, Mode::Cgp, Mode::OneStepOff]
            .into_iter()
            .map(|m| simulate(&cfg, "gsm8k", "R1", m, false).unwrap().result)
            .collect()
    }

    #[test]
    fn rows_put_the_ideal_after_sync_and_cut_against_it() {
        let rows = rows(&results());
        let modes: Vec<&str> = rows.iter().map(|r| r.mode.as_str()).collect();
        assert_eq!(modes, ["sync", "bound", "cgp", "one-step-off"]);
        let (sync, ideal, cgp) = (&rows[0], &rows[1], &rows[2]);
        assert!((cgp.r2t_cut - (sync.r2t_s - cgp.r2t_s) / sync.r2t_s).abs() < 1e-12);
        // CGP lies between sync and the ideal bound.
        assert!(ideal.r2t_s <= cgp.r2t_s && cgp.r2t_s < sync.r2t_s);
        assert!(cgp.overlap_eff > 0.0 && cgp.overlap_eff <= 1.0 + 1e-9);
        assert_eq!(
            rows[3].staleness, 0.5,
            "step 0 fresh, step 1 one version stale"
        );
    }

    #[test]
    fn text_and_csv_have_one_cell_per_column() {
        let rows = rows(&results());
        let text = table_text(&rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines.len(),
            rows.len() + 2,
            "header, rule, one line per row"
        );
        let csv = table_csv(&rows);
        let header_cols = csv.lines().next().unwrap().split(',').count();
        for line in csv.lines() {
            assert_eq!(line.split(',').count(), header_cols, "{line}");
        }
    }
}
