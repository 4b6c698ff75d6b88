//! Per-step metrics, defined once for `simulate` (its table, from `sim::StepRecord`) and
//! `train` (`metrics.jsonl`): [`Timing`] holds a step's timing metrics, [`Timing::of`] derives
//! them from the [`StepTimes`] either driver measured, and the functions below are their
//! formulae. Times are seconds; each function says which window it measures.
//!
//! A new timing metric is a field of [`Timing`] and its line in [`Timing::of`]: `train` writes
//! it into every `metrics.jsonl` line (and so to TensorBoard), `simulate` shows it once its
//! table has a column for it (`sim::report`).
use rolloutpipe_core::Counters;
use serde::{Deserialize, Serialize};

/// What a step's timing metrics are derived from, measured by its driver.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Rollout start to batch final.
    pub rollout_s: f64,
    /// Rollout start to train end (the rollout-to-train-end window).
    pub window_s: f64,
    /// The trainer's busy time inside that window.
    pub busy_in_window_s: f64,
    /// The step's own trainer work (micro-batches and optimizer steps).
    pub train_busy_s: f64,
    /// The last micro-batch plus the optimizer step after it.
    pub last_tail_s: f64,
    /// When the first micro-batch's worth of trainable groups had materialized, after the
    /// rollout start ([`first_micro_batch_ready`]).
    pub first_micro_batch_ready_s: f64,
    /// The previous step's train end to this one's (Slime's window).
    pub since_prev_train_end_s: f64,
    /// Engines' idle time in the window, per engine ([`rollout_idle`], in the driver's clock).
    pub rollout_idle_s: f64,
    /// Slot occupancy over the rollout ([`slot_occupancy`], from the driver's [`Occupancy`]).
    pub slot_occupancy: f64,
}

/// One step's timing metrics (a `metrics.jsonl` line's, flattened into it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Rollout start to train end, s (headline metric 1).
    pub rollout_to_train_end_s: f64,
    /// The trainer's idle share of that window ([`wait_ratio`]; headline metric 2).
    pub trainer_wait_ratio: f64,
    /// The untightened bound `T_rollout + T_train(last micro-batch)` (the optimizer step
    /// after it included), s; `bound_s` is the tightened one.
    pub ideal_s: f64,
    /// The bound given this rollout ([`bound`]), s after the rollout start.
    #[serde(default)]
    pub bound_s: f64,
    /// When the first micro-batch's worth of trainable groups had materialized, s after the
    /// rollout start.
    #[serde(default)]
    pub first_micro_batch_ready_s: f64,
    /// Slime's `perf/wait_time_ratio` ([`slime_wait_ratio`]): the trainer's idle share of
    /// the time since the previous step's train end, weight sync included.
    #[serde(default)]
    pub slime_wait_ratio: f64,
    /// Time-average of the requests the engines held over the rollout, divided by the slots.
    #[serde(default)]
    pub slot_occupancy: f64,
    /// Rollout engines' idle time inside the rollout-to-train-end window, s per engine.
    #[serde(default)]
    pub rollout_idle_s: f64,
}

impl Timing {
    /// The timing metrics of a step that measured `t`.
    pub fn of(t: &StepTimes) -> Self {
        Timing {
            rollout_to_train_end_s: t.window_s,
            trainer_wait_ratio: wait_ratio(t.busy_in_window_s, t.window_s),
            ideal_s: t.rollout_s + t.last_tail_s,
            bound_s: bound(
                t.rollout_s,
                t.last_tail_s,
                t.first_micro_batch_ready_s,
                t.train_busy_s,
            ),
            first_micro_batch_ready_s: t.first_micro_batch_ready_s,
            slime_wait_ratio: wait_ratio(t.train_busy_s, t.since_prev_train_end_s),
            slot_occupancy: t.slot_occupancy,
            rollout_idle_s: t.rollout_idle_s,
        }
    }
}

/// The in-window trainer waiting ratio: the trainer's idle share of the rollout-to-train-end
/// window, `1 - busy / window`. `busy` is micro-batches plus optimizer steps inside the window.
/// 0 for an empty window.
pub fn wait_ratio(busy: f64, window: f64) -> f64 {
    if window <= 0.0 {
        0.0
    } else {
        ((window - busy) / window).clamp(0.0, 1.0)
    }
}

/// Slime's `perf/wait_time_ratio` (`slime/observability/train_metric_utils.py`, from
/// `inverse_timer("train_wait")` around `timer("train")` in
/// `slime/backends/megatron_utils/actor.py`): the trainer's idle share of the time since the
/// previous step's training ended, so the weight update (and, for sync, the whole rollout) is
/// inside the window. `busy` is the step's own training.
pub fn slime_wait_ratio(busy: f64, train_end: f64, prev_train_end: f64) -> f64 {
    wait_ratio(busy, train_end - prev_train_end)
}

/// The bound given this rollout: `T_rollout + T_train(last micro-batch) + T_opt`
/// (`last_tail` is the last micro-batch plus the optimizer step after it), tightened by
/// `t(first micro-batch ready) + T_train(all)`, since no trainer finishes its own work sooner.
/// It holds for schedules that keep this rollout and this trainer work, not for every
/// on-policy schedule. All times are relative to the rollout start.
pub fn bound(rollout: f64, last_tail: f64, first_micro_batch_ready: f64, busy: f64) -> f64 {
    (rollout + last_tail).max(first_micro_batch_ready + busy)
}

/// When the first micro-batch's worth (`micro_batch` groups) of trainable groups had
/// materialized, from their completion times in materialization order (the last one when fewer
/// completed; 0 when none did).
pub fn first_micro_batch_ready(completions: &[f64], micro_batch: usize) -> f64 {
    completions
        .get(micro_batch.saturating_sub(1))
        .or(completions.last())
        .copied()
        .unwrap_or(0.0)
}

/// Rollouts: responses generated to the end, whatever then became of their group (aborted
/// requests excluded).
pub fn rollouts(c: &Counters) -> u64 {
    c.requests_generated + c.requests_discarded
}

/// Slot occupancy: the time-average of requests held by the engines over the rollout
/// (`area` = held x time, in the same unit as `rollout`), divided by the slots.
pub fn slot_occupancy(area: f64, rollout: f64, slots: u32) -> f64 {
    if rollout <= 0.0 {
        0.0
    } else {
        area / (rollout * f64::from(slots))
    }
}

/// Rollout engines' idle time inside a window, per engine: `window - busy / engines`, where
/// `busy` is the engines' busy time summed (it can include work outside the step, so the
/// result is clamped at 0).
pub fn rollout_idle(window: f64, busy: f64, engines: f64) -> f64 {
    ((window * engines - busy) / engines).max(0.0)
}

/// Held requests integrated over time, for [`slot_occupancy`]: `change` at every admission and
/// release, `stop` at the rollout's end (later changes are not counted).
#[derive(Debug, Clone, Default)]
pub struct Occupancy {
    held: u64,
    since: u64,
    area: f64,
    stopped: bool,
}

impl Occupancy {
    /// Starts counting at `now` with nothing held.
    pub fn start(now: u64) -> Self {
        Self {
            since: now,
            ..Self::default()
        }
    }

    /// `delta` requests were admitted (positive) or released (negative) at `now`.
    pub fn change(&mut self, now: u64, delta: i64) {
        self.advance(now);
        self.held = self.held.saturating_add_signed(delta);
    }

    /// The rollout ended at `now`.
    pub fn stop(&mut self, now: u64) {
        self.advance(now);
        self.stopped = true;
    }

    /// Whether [`stop`](Self::stop) was called.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Held x time so far.
    pub fn area(&self) -> f64 {
        self.area
    }

    fn advance(&mut self, now: u64) {
        if !self.stopped {
            self.area += self.held as f64 * now.saturating_sub(self.since) as f64;
        }
        self.since = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_idle_shares_of_their_windows() {
        assert_eq!(wait_ratio(3.0, 4.0), 0.25);
        assert_eq!(wait_ratio(5.0, 4.0), 0.0);
        assert_eq!(wait_ratio(1.0, 0.0), 0.0);
        // Slime's window runs from the previous train end: 10 s, 3 s busy.
        assert!((slime_wait_ratio(3.0, 25.0, 15.0) - 0.7).abs() < 1e-12);
    }

    #[test]
    fn bound_takes_the_binding_term() {
        // Rollout-bound: 10 s rollout + 1 s tail.
        assert_eq!(bound(10.0, 1.0, 2.0, 5.0), 11.0);
        // Trainer-bound: first micro-batch at 2 s, then 12 s of training.
        assert_eq!(bound(10.0, 1.0, 2.0, 12.0), 14.0);
        assert_eq!(first_micro_batch_ready(&[1.0, 2.0, 3.0], 2), 2.0);
        assert_eq!(first_micro_batch_ready(&[1.0], 4), 1.0);
        assert_eq!(first_micro_batch_ready(&[], 4), 0.0);
    }

    #[test]
    fn occupancy_integrates_until_stopped() {
        let mut o = Occupancy::start(10);
        o.change(10, 2); // 2 held from 10
        o.change(14, -1); // 1 held from 14: 8 so far
        o.stop(20); // + 6
        o.change(30, -1); // after the end: not counted
        assert_eq!(o.area(), 14.0);
        assert_eq!(slot_occupancy(o.area(), 10.0, 2), 0.7);
        assert_eq!(rollout_idle(10.0, 15.0, 2.0), 2.5);
        assert_eq!(rollout_idle(10.0, 25.0, 2.0), 0.0);
    }
}
