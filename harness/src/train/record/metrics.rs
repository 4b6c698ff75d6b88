//! `metrics.jsonl`: one line per step ([`StepMetrics`]), the trained-response records and the
//! raw timings a run returns. The timing metrics are `simulate`'s too: defined and computed by
//! `crate::driver::metrics::Timing`.
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::driver::metrics::{self, StepTimes, Timing};
use crate::train::data;
use crate::train::run::phase::TrainAgg;

/// One line of `metrics.jsonl`: what step `step` did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Step.
    pub step: u64,
    /// Mode.
    pub mode: String,
    /// Weights version of its rollout.
    pub rollout_version: u64,
    /// Mean reward of every scored response of the step.
    pub reward: f64,
    /// Share of the step's responses verified correct.
    pub train_accuracy: f64,
    /// Greedy held-out accuracy after the step (evaluation steps only).
    pub heldout_accuracy: Option<f64>,
    /// Greedy accuracy on the independent test set (`run.test_problems`) after the step
    /// (evaluation steps only).
    #[serde(default)]
    pub test_accuracy: Option<f64>,
    /// Normalised loss of the step's optimizer steps (mean).
    pub loss: f64,
    /// Mean k3 KL per token (0 without a reference).
    pub kl: f64,
    /// Mean entropy per token.
    pub entropy: f64,
    /// Pre-clip gradient norm (last optimizer step).
    pub grad_norm: f64,
    /// Share of tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Rollout start to batch final, s.
    pub rollout_s: f64,
    /// The timing metrics (`driver::metrics::Timing`, shared with `simulate`), flattened
    /// into the line.
    #[serde(flatten)]
    pub timing: Timing,
    /// Trainer busy time on this step's batch, s.
    pub train_busy_s: f64,
    /// Tail multiplexing (`rollout.multiplex`): groups whose KL reference log-probs a rollout
    /// engine computed and the trainer used.
    #[serde(default)]
    pub mux_groups: u32,
    /// Engine seconds spent on multiplexed reference passes, late (dropped) ones included.
    #[serde(default)]
    pub mux_s: f64,
    /// Long-tail migration (`rollout.migrate`): requests moved between engines.
    #[serde(default)]
    pub migrations: u32,
    /// Their prompt + generated tokens, re-prefilled on the target engines.
    #[serde(default)]
    pub migrated_tokens: u64,
    /// Seconds of the target engines' iterations that ran those re-prefills (each shared
    /// with whatever else the engine decoded in it).
    #[serde(default)]
    pub reprefill_s: f64,
    /// Weight sync after the step, s.
    pub sync_s: f64,
    /// Response tokens generated (aborted and discarded included).
    pub tokens: u64,
    /// Generated tokens per second of rollout.
    pub tokens_per_s: f64,
    /// Prompts drawn.
    pub drawn: u32,
    /// Groups trained.
    pub trained: u32,
    /// Groups filtered (all reasons).
    pub filtered: u32,
    /// Groups aborted.
    pub aborted: u32,
    /// Requests that failed and were re-admitted or filtered.
    pub requests_failed: u64,
    /// Rollouts (responses generated to the end, whatever then became of their group) this
    /// step; aborted requests are not counted (their tokens are in `tokens`).
    #[serde(default)]
    pub rollouts: u64,
    /// Rollouts of every step so far, this one included (across resumptions).
    #[serde(default)]
    pub rollouts_cum: u64,
    /// Groups the allocation policy extended (VIGOR's extra rounds, Pilot-Commit's commits).
    #[serde(default)]
    pub extended: u32,
    /// Groups the allocation policy skipped (Pilot-Commit: too easy, solved or too hard).
    #[serde(default)]
    pub skipped: u32,
    /// Seconds since the run (or its resumption) started.
    pub elapsed_s: f64,
}

/// One trained response: which step trained it and which weights generated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainedRecord {
    /// The step whose optimizer step(s) it fed (its trainer held `v_step` when it started).
    pub step: u64,
    /// Rollout step that generated it.
    pub rollout_step: u64,
    /// Group id within that rollout step.
    pub group: u32,
    /// Sample index.
    pub sample: u16,
    /// The weights version that generated it.
    pub version: u64,
}

/// Raw timings for `compare` and the simulator calibration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Measured {
    /// Decode iterations: (running requests, seconds).
    pub decode: Vec<(u32, f64)>,
    /// Verifier latency per response, s.
    pub verify_s: Vec<f64>,
    /// Micro-batches: (response tokens, prompt+response tokens, seconds).
    pub micro_batches: Vec<(usize, usize, f64)>,
    /// Optimizer steps, s.
    pub opt_s: Vec<f64>,
    /// Weight syncs, s.
    pub sync_s: Vec<f64>,
    /// Prompt lengths, tokens.
    pub prompt_tokens: Vec<u32>,
    /// Response lengths, tokens.
    pub response_tokens: Vec<u32>,
    /// Responses per engine slot (S) and engines (E) of the run.
    pub slots: u32,
    /// Engines.
    pub engines: u16,
}

/// The windows and busy intervals one step's timing metrics are computed over.
pub(crate) struct Window<'a> {
    /// The step's rollout start.
    pub start: Instant,
    /// Its train end (`None`: now).
    pub end: Option<Instant>,
    /// The previous step's train end (Slime's window starts there).
    pub prev_end: Instant,
    /// The trainer's busy intervals (micro-batches, optimizer steps).
    pub trainer: &'a [(Instant, Instant)],
    /// The rollout engines' busy intervals (at least one request held).
    pub engines: &'a [(Instant, Instant)],
    /// Rollout engines.
    pub engine_count: usize,
}

/// Seconds of `spans` inside `[start, end]`.
fn overlap(spans: &[(Instant, Instant)], start: Instant, end: Instant) -> f64 {
    spans
        .iter()
        .map(|&(a, b)| {
            let (a, b) = (a.max(start), b.min(end));
            if b > a { (b - a).as_secs_f64() } else { 0.0 }
        })
        .sum()
}

/// Training fields of a step's metrics, from its trainer aggregate and window (the rollout
/// fields, `first_micro_batch_ready_s` and `slot_occupancy` are set already); returns the train
/// end used.
pub(crate) fn fill_train(m: &mut StepMetrics, t: &TrainAgg, w: &Window<'_>) -> Instant {
    let end = w.end.unwrap_or_else(Instant::now);
    let window = (end - w.start).as_secs_f64().max(1e-9);
    let engines = w.engine_count.max(1) as f64;
    let times = StepTimes {
        rollout_s: m.rollout_s,
        window_s: window,
        busy_in_window_s: overlap(w.trainer, w.start, end),
        train_busy_s: t.busy_s,
        last_tail_s: t.last_mb_s,
        first_micro_batch_ready_s: m.timing.first_micro_batch_ready_s,
        since_prev_train_end_s: end.saturating_duration_since(w.prev_end).as_secs_f64(),
        rollout_idle_s: metrics::rollout_idle(window, overlap(w.engines, w.start, end), engines),
        slot_occupancy: m.timing.slot_occupancy,
    };
    m.timing = Timing::of(&times);
    m.train_busy_s = t.busy_s;
    let tok = t.accum.tokens.max(1) as f64;
    m.loss = t.loss_sum / t.opt_steps.max(1) as f64;
    m.kl = t.accum.kl_sum / tok;
    m.entropy = t.accum.entropy_sum / tok;
    m.grad_norm = t.grad_norm;
    m.clip_fraction = t.accum.clip_fraction();
    end
}

/// Opens `metrics.jsonl` for appending, dropping lines of steps at or after `from` (a resumed
/// run redoes them).
pub(crate) fn open_metrics(out: &Path, from: u64) -> anyhow::Result<std::fs::File> {
    let path = out.join("metrics.jsonl");
    let kept: Vec<String> = match std::fs::read_to_string(&path) {
        Ok(text) => text
            .lines()
            .filter(|l| {
                serde_json::from_str::<StepMetrics>(l)
                    .map(|m| m.step < from)
                    .unwrap_or(false)
            })
            .map(str::to_owned)
            .collect(),
        Err(_) => Vec::new(),
    };
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("writing {}", path.display()))?;
    for l in kept {
        writeln!(f, "{l}")?;
    }
    Ok(f)
}

/// Reads a run's `metrics.jsonl`.
pub fn read_metrics(dir: &Path) -> anyhow::Result<Vec<StepMetrics>> {
    let path = dir.join("metrics.jsonl");
    let text = data::read(&path)?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sim::StepRecord;

    /// `train`'s metrics line and `simulate`'s step record, fed the same spans, give the same
    /// timing metrics: one definition (`driver::metrics::Timing`) serves both.
    #[test]
    fn train_and_simulate_agree_on_the_same_spans() {
        let t0 = Instant::now() + Duration::from_secs(100);
        let at = |s: f64| t0 + Duration::from_secs_f64(s);
        // Previous train end at 1 s; rollout 2..12 s; micro-batches at 5..8 and 11..13, the
        // optimizer step 13..14 (train end). The trainer's 0.5..1 work belongs to the step
        // before and is outside the window.
        let trainer = [
            (at(0.5), at(1.0)),
            (at(5.0), at(8.0)),
            (at(11.0), at(13.0)),
            (at(13.0), at(14.0)),
        ];
        // Two engines: busy 2..12 and 2..7.
        let engines = [(at(2.0), at(12.0)), (at(2.0), at(7.0))];
        let agg = TrainAgg {
            busy_s: 6.0,
            last_mb_s: 3.0,
            ..TrainAgg::default()
        };
        let line = |rollout_s: f64| {
            let mut m = StepMetrics {
                rollout_s,
                ..StepMetrics::default()
            };
            m.timing.first_micro_batch_ready_s = 3.0;
            let w = Window {
                start: at(2.0),
                end: Some(at(14.0)),
                prev_end: at(1.0),
                trainer: &trainer,
                engines: &engines,
                engine_count: 2,
            };
            fill_train(&mut m, &agg, &w);
            m.timing
        };
        let sim = StepRecord {
            rollout_start: 2.0,
            rollout_end: 12.0,
            train_end: 14.0,
            trainer_busy: 6.0,
            last_tail: 3.0,
            first_micro_batch_ready: 3.0,
            prev_train_end: 1.0,
            ..StepRecord::default()
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let m = line(10.0);
        // By hand: window 12 s, 6 s busy in it.
        assert!(close(m.rollout_to_train_end_s, 12.0));
        assert!(close(m.trainer_wait_ratio, 0.5), "{}", m.trainer_wait_ratio);
        assert!(close(m.trainer_wait_ratio, sim.wait_ratio()));
        // Slime: 13 s since the previous train end, 6 s busy.
        assert!(
            close(m.slime_wait_ratio, 7.0 / 13.0),
            "{}",
            m.slime_wait_ratio
        );
        assert!(close(m.slime_wait_ratio, sim.slime_wait_ratio()));
        // Bound: max(10 + 3, 3 + 6) = 13 s; the untightened one is also 13 here.
        assert!(close(m.bound_s, 13.0));
        assert!(close(m.bound_s, sim.ideal()));
        assert!(close(m.ideal_s, 13.0));
        // Engines: 24 engine-s of window, 15 busy: 4.5 s idle each.
        assert!(close(m.rollout_idle_s, 4.5), "{}", m.rollout_idle_s);
        // Trainer-bound: the tightening term binds.
        let m2 = line(4.0);
        let sim2 = StepRecord {
            rollout_end: 6.0,
            ..sim
        };
        assert!(close(m2.bound_s, 9.0));
        assert!(close(m2.bound_s, sim2.ideal()));
        assert!(close(m2.ideal_s, 7.0));
    }
}
