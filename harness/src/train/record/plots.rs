//! The run's plots: learning curves, step times and the last step's timeline.
use std::path::Path;
use std::time::Instant;

use super::metrics::{StepMetrics, read_metrics};
use crate::plot::{self, GanttRow, Series, Span};

pub(crate) fn write_plots(
    out: &Path,
    all: &[StepMetrics],
    timeline: Option<&Vec<GanttRow>>,
) -> anyhow::Result<()> {
    // The file holds every step of the run, resumed parts included.
    let ms = read_metrics(out).unwrap_or_else(|_| all.to_vec());
    if ms.is_empty() {
        return Ok(());
    }
    let pts = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
        ms.iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    plot::lines(
        &out.join("learning_curves.svg"),
        "Learning curves",
        "step",
        "share",
        &learning_series(&ms),
    )?;
    plot::lines(
        &out.join("step_times.svg"),
        "Step times",
        "step",
        "seconds",
        &[
            Series::new(
                "rollout-to-train-end",
                pts(&|m| Some(m.timing.rollout_to_train_end_s)),
            ),
            Series::new("rollout", pts(&|m| Some(m.rollout_s))),
            Series::new("ideal bound", pts(&|m| Some(m.timing.ideal_s))),
            // Lines without the field read 0: left out.
            Series::new(
                "bound given this rollout",
                pts(&|m| Some(m.timing.bound_s).filter(|&b| b > 0.0)),
            ),
        ],
    )?;
    if let Some(rows) = timeline
        && rows.iter().any(|r| !r.spans.is_empty())
    {
        plot::gantt(
            &out.join("step_timeline.svg"),
            "Last step: requests per engine, trainer micro-batches",
            "seconds since rollout start",
            rows,
            &[(0, "request".into()), (1, "train".into())],
        )?;
    }
    Ok(())
}

/// The learning-curve series: reward and held-out accuracy always; train accuracy only where
/// it differs from the reward (without a format penalty they are equal, and one line would
/// hide the other).
fn learning_series(ms: &[StepMetrics]) -> Vec<Series<(f64, f64)>> {
    let pts = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
        ms.iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    let mut s = vec![
        Series::new("reward", pts(&|m| Some(m.reward))),
        Series::new("held-out accuracy", pts(&|m| m.heldout_accuracy)),
    ];
    if ms.iter().any(|m| m.test_accuracy.is_some()) {
        s.push(Series::new(
            "test accuracy (uniform)",
            pts(&|m| m.test_accuracy),
        ));
    }
    if ms
        .iter()
        .any(|m| (m.reward - m.train_accuracy).abs() > 1e-9)
    {
        s.push(Series::new(
            "train accuracy",
            pts(&|m| Some(m.train_accuracy)),
        ));
    }
    s
}

/// The last step's timeline: each engine's requests, then the trainer's work.
pub(crate) fn gantt(
    engines: usize,
    spans: &[(u16, f64, f64)],
    start: Instant,
    busy: &[(Instant, Instant)],
) -> Vec<GanttRow> {
    let mut rows: Vec<GanttRow> = (0..engines)
        .map(|e| GanttRow {
            label: format!("engine {e}"),
            spans: Vec::new(),
        })
        .collect();
    for &(e, a, b) in spans {
        if let Some(row) = rows.get_mut(e as usize) {
            row.spans.push(Span {
                start: a,
                end: b,
                color: 0,
            });
        }
    }
    let spans = busy
        .iter()
        .filter(|(_, b)| *b > start)
        .map(|(a, b)| Span {
            start: a.saturating_duration_since(start).as_secs_f64(),
            end: (*b - start).as_secs_f64(),
            color: 1,
        })
        .collect();
    rows.push(GanttRow {
        label: "trainer".into(),
        spans,
    });
    rows
}
