//! `summary.json`, carried across a run's invocations (resumptions).
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::metrics::read_metrics;

/// `summary.json` across invocations: accuracies of the run's start come from the first
/// invocation, wall time and invocations add up, steps count every line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct SummaryBase {
    pub(crate) accuracy_initial: Option<f64>,
    pub(crate) accuracy_start: Option<f64>,
    pub(crate) test_distribution: Option<String>,
    pub(crate) test_accuracy_initial: Option<f64>,
    pub(crate) test_accuracy_start: Option<f64>,
    /// Wall time of earlier invocations, s.
    pub(crate) wall_s_before: f64,
    pub(crate) invocations: u32,
    #[serde(skip)]
    pub(crate) started: Option<Instant>,
}

impl SummaryBase {
    pub(crate) fn read(out: &Path, resume: bool, started: Instant) -> Self {
        let old: Option<serde_json::Value> = resume
            .then(|| std::fs::read_to_string(out.join("summary.json")).ok())
            .flatten()
            .and_then(|t| serde_json::from_str(&t).ok());
        let f = |k: &str| old.as_ref().and_then(|v| v.get(k)?.as_f64());
        SummaryBase {
            accuracy_initial: f("accuracy_initial"),
            accuracy_start: f("accuracy_start"),
            test_distribution: old
                .as_ref()
                .and_then(|v| v.get("test_distribution")?.as_str().map(String::from)),
            test_accuracy_initial: f("test_accuracy_initial"),
            test_accuracy_start: f("test_accuracy_start"),
            wall_s_before: f("wall_s").unwrap_or(0.0),
            invocations: f("invocations").unwrap_or(0.0) as u32 + 1,
            started: Some(started),
        }
    }

    /// The start of this invocation: accuracies before SFT and at RL start (held-out, then
    /// test) and the test set's description, each kept from an earlier invocation if it has
    /// one.
    pub(crate) fn begin(
        &mut self,
        heldout: [Option<f64>; 2],
        test: [Option<f64>; 2],
        test_distribution: Option<String>,
    ) {
        self.accuracy_initial = self.accuracy_initial.or(heldout[0]);
        self.accuracy_start = self.accuracy_start.or(heldout[1]);
        self.test_accuracy_initial = self.test_accuracy_initial.or(test[0]);
        self.test_accuracy_start = self.test_accuracy_start.or(test[1]);
        if self.test_distribution.is_none() {
            self.test_distribution = test_distribution;
        }
    }

    pub(crate) fn write(
        &self,
        out: &Path,
        accuracy_end: Option<f64>,
        test_end: Option<f64>,
        complete: bool,
    ) -> anyhow::Result<()> {
        let steps = read_metrics(out).map(|m| m.len()).unwrap_or(0);
        let wall = self.wall_s_before + self.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let v = serde_json::json!({
            "accuracy_initial": self.accuracy_initial,
            "accuracy_start": self.accuracy_start,
            "accuracy_end": accuracy_end,
            "test_distribution": self.test_distribution,
            "test_accuracy_initial": self.test_accuracy_initial,
            "test_accuracy_start": self.test_accuracy_start,
            "test_accuracy_end": test_end,
            "steps": steps,
            "wall_s": wall,
            "invocations": self.invocations,
            "complete": complete,
        });
        let (p, tmp) = (out.join("summary.json"), out.join(".summary.json.tmp"));
        std::fs::write(&tmp, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
    }
}
