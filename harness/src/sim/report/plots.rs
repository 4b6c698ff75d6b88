//! The simulator's plots: per-setting bars, the completion CDF, and one step's Gantt timeline.
use std::path::Path;

use anyhow::Context;

use super::super::driver::Recording;
use super::super::engine::Ns;
use super::super::metrics::{RunResult, secs};
use super::{BOUND, Row, overlaps, window};
use crate::plot::{self, GanttRow, Series, Span};

/// Per-setting grouped bars of r2t and waiting ratio (modes plus the ideal bound).
pub fn plot_bars(dir: &Path, rows: &[Row]) -> anyhow::Result<()> {
    let mut cats: Vec<(String, String)> = Vec::new();
    let mut modes: Vec<String> = Vec::new();
    for r in rows {
        let k = (r.profile.clone(), r.setting.clone());
        if !cats.contains(&k) {
            cats.push(k);
        }
        if !modes.contains(&r.mode) {
            modes.push(r.mode.clone());
        }
    }
    let names: Vec<String> = cats.iter().map(|(p, s)| format!("{p}/{s}")).collect();
    let series = |f: &dyn Fn(&Row) -> f64, skip: &[&str]| -> Vec<Series<f64>> {
        modes
            .iter()
            .filter(|m| !skip.contains(&m.as_str()))
            .map(|m| {
                let vals = cats
                    .iter()
                    .map(|(p, s)| {
                        rows.iter()
                            .find(|r| &r.profile == p && &r.setting == s && &r.mode == m)
                            .map_or(f64::NAN, f)
                    })
                    .collect();
                Series::new(m.clone(), vals)
            })
            .collect()
    };
    plot::bars(
        &dir.join("r2t.svg"),
        "Rollout-to-train-end time per step (lower is better)",
        "seconds",
        &names,
        &series(&|r| r.r2t_s, &["one-step-off"]),
    )?;
    plot::bars(
        &dir.join("wait_ratio.svg"),
        "Trainer waiting ratio (lower is better)",
        "wait / (wait + busy)",
        &names,
        &series(&|r| r.wait_ratio, &["one-step-off"]),
    )?;
    plot::bars(
        &dir.join("r2t_cut.svg"),
        "Cut of rollout-to-train-end time vs sync (paper: 30.7-42.3%)",
        "percent",
        &names,
        &series(&|r| 100.0 * r.r2t_cut, &["sync", "one-step-off"]),
    )?;
    plot::bars(
        &dir.join("period.svg"),
        "Step period incl. weight sync (one-step-off is asynchronous)",
        "seconds",
        &names,
        &series(&|r| r.period_s, &[BOUND]),
    )
}

/// The CDF of group completion times (s after rollout start) of one setting, per mode.
pub fn plot_cdf(dir: &Path, results: &[&RunResult], title: &str) -> anyhow::Result<()> {
    let series: Vec<Series<f64>> = results
        .iter()
        .map(|r| {
            Series::new(
                r.mode.name(),
                r.steps
                    .iter()
                    .flat_map(|s| s.group_completion.iter().copied())
                    .collect(),
            )
        })
        .collect();
    plot::cdf(
        &dir.join("group_completion_cdf.svg"),
        title,
        "seconds after rollout start",
        &series,
    )
}

/// Gantt timeline of engines and trainer for one step of one run.
pub fn plot_gantt(
    path: &Path,
    r: &RunResult,
    rec: &Recording,
    step: u64,
    engines: usize,
) -> anyhow::Result<()> {
    let (lo, hi) = window(r, step).context("trace step not simulated")?;
    let mut rows = engine_rows(rec, engines, (lo, hi));
    rows.extend(trainer_rows(rec, step, (lo, hi)));
    let legend = vec![
        (0, "engine busy".to_owned()),
        (1, format!("micro-batch (step {step})")),
        (7, "micro-batch (other step)".to_owned()),
        (2, "optimizer".to_owned()),
        (3, "weight sync".to_owned()),
        (4, "group materialized".to_owned()),
    ];
    plot::gantt(
        path,
        &format!("{} {}/{} step {step}", r.mode, r.profile, r.setting),
        "seconds after rollout start",
        &rows,
        &legend,
    )
}

/// Per engine, where it held at least one request.
fn engine_rows(rec: &Recording, engines: usize, (lo, hi): (f64, f64)) -> Vec<GanttRow> {
    let mut rows = Vec::new();
    for e in 0..engines {
        // Busy intervals: where the engine held at least one request.
        let mut spans = Vec::new();
        let mut open: Option<Ns> = None;
        for &(t, eng, held) in rec.held.iter().filter(|h| h.1 as usize == e) {
            let _ = eng;
            match (open, held) {
                (None, h) if h > 0 => open = Some(t),
                (Some(s), 0) => {
                    spans.push((s, t));
                    open = None;
                }
                _ => {}
            }
        }
        if let Some(s) = open {
            spans.push((s, s.max((hi * 1e9) as Ns)));
        }
        rows.push(GanttRow {
            label: format!("engine {e}"),
            spans: spans
                .into_iter()
                .filter(|&(a, b)| overlaps(a, b, lo, hi))
                .map(|(a, b)| Span {
                    start: secs(a).max(lo) - lo,
                    end: secs(b).min(hi) - lo,
                    color: 0,
                })
                .collect(),
        });
    }
    rows
}

/// The trainer's work (this step's micro-batches, other steps', optimizer steps), the weight
/// syncs and the step's group completions.
fn trainer_rows(rec: &Recording, step: u64, (lo, hi): (f64, f64)) -> Vec<GanttRow> {
    let mut rows = Vec::new();
    let mut train = Vec::new();
    for (s, label, a, b) in &rec.trainer {
        if overlaps(*a, *b, lo, hi) {
            let color = if label == "optimizer" {
                2
            } else if *s == step {
                1
            } else {
                7
            };
            train.push(Span {
                start: secs(*a).max(lo) - lo,
                end: secs(*b).min(hi) - lo,
                color,
            });
        }
    }
    rows.push(GanttRow {
        label: "trainer".into(),
        spans: train,
    });
    let syncs = rec
        .syncs
        .iter()
        .filter(|&&(a, b)| overlaps(a, b, lo, hi))
        .map(|&(a, b)| Span {
            start: secs(a).max(lo) - lo,
            end: secs(b).min(hi) - lo,
            color: 3,
        })
        .collect();
    rows.push(GanttRow {
        label: "weight sync".into(),
        spans: syncs,
    });
    let marks = rec
        .completions
        .iter()
        .filter(|c| c.0 == step)
        .map(|c| {
            let t = secs(c.2) - lo;
            Span {
                start: t,
                end: t + (hi - lo) * 0.002,
                color: 4,
            }
        })
        .collect();
    rows.push(GanttRow {
        label: "group ready".into(),
        spans: marks,
    });
    rows
}
