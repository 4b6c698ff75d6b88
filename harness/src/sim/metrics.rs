//! What one simulated run measures, per step ([`StepRecord`]: the step's times and counts) and
//! in total ([`RunResult`]). The timing metrics are `train`'s too: each step's come from
//! `crate::driver::metrics::Timing`, which defines them.
use serde::Serialize;

use super::config::Schedule;
use super::engine::Ns;
use crate::driver::metrics::{StepTimes, Timing};

/// Seconds from nanoseconds.
pub fn secs(ns: Ns) -> f64 {
    ns as f64 * 1e-9
}

/// One RL step's measurements (times in seconds from the run's start).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepRecord {
    /// Step index.
    pub step: u64,
    /// Policy version the rollout used.
    pub version: u64,
    /// Rollout start.
    pub rollout_start: f64,
    /// When the B-th trainable group materialized (the rollout's end).
    pub rollout_end: f64,
    /// When the step's last optimizer step finished.
    pub train_end: f64,
    /// Trainer busy (micro-batches and optimizer steps) for this step.
    pub trainer_busy: f64,
    /// The last micro-batch's duration plus the last optimizer step's (ideal-bound tail).
    pub last_tail: f64,
    /// When the first micro-batch's worth of trainable groups had materialized, s after the
    /// rollout start (no trainer can start earlier).
    pub first_micro_batch_ready: f64,
    /// Tokens generated during the rollout (finished and aborted requests).
    pub tokens_generated: u64,
    /// Time-average of requests held by the engines over the rollout, divided by the slots.
    pub slot_occupancy: f64,
    /// Prompts drawn.
    pub drawn: u32,
    /// Groups trained.
    pub trained: u32,
    /// Groups filtered (zero variance or otherwise).
    pub filtered: u32,
    /// Groups aborted as surplus once the batch was full.
    pub aborted_groups: u32,
    /// Requests aborted.
    pub aborted_requests: u32,
    /// KV retractions on the engines during the rollout.
    pub retractions: u64,
    /// Completion time of each trained group, s after rollout start (materialization order).
    pub group_completion: Vec<f64>,
    /// Weight versions between the data's policy and the weights it updates (0 = on-policy).
    pub staleness: u64,
    /// The previous step's train end (0 for the first step): Slime's wait window starts there.
    pub prev_train_end: f64,
    /// Rollout engines' idle time in this step's r2t window, s per engine.
    pub rollout_idle: f64,
    /// Log-prob work multiplexed onto rollout engines, engine-s.
    pub mux_s: f64,
    /// Groups whose log-prob pass ran on a rollout engine.
    pub mux_groups: u32,
    /// Requests migrated between engines.
    pub migrations: u32,
    /// Rollouts: responses generated to the end (aborted requests excluded).
    pub rollouts: u64,
    /// Samples of the trained groups (their final sizes under an allocation policy).
    pub trained_samples: u64,
    /// Groups the allocation policy extended.
    pub extended: u32,
    /// Groups the allocation policy skipped.
    pub skipped: u32,
}

impl StepRecord {
    /// Rollout-to-train-end time.
    pub fn r2t(&self) -> f64 {
        self.train_end - self.rollout_start
    }

    /// Rollout duration (start to batch full).
    pub fn rollout(&self) -> f64 {
        self.rollout_end - self.rollout_start
    }

    /// The step's timing metrics, as `train` computes its own.
    pub fn timing(&self) -> Timing {
        Timing::of(&StepTimes {
            rollout_s: self.rollout(),
            window_s: self.r2t(),
            // The simulated trainer does only this step's work inside its window.
            busy_in_window_s: self.trainer_busy,
            train_busy_s: self.trainer_busy,
            last_tail_s: self.last_tail,
            first_micro_batch_ready_s: self.first_micro_batch_ready,
            since_prev_train_end_s: self.train_end - self.prev_train_end,
            rollout_idle_s: self.rollout_idle,
            slot_occupancy: self.slot_occupancy,
        })
    }

    /// Trainer waiting ratio inside the rollout-to-train-end window.
    pub fn wait_ratio(&self) -> f64 {
        self.timing().trainer_wait_ratio
    }

    /// Slime's `perf/wait_time_ratio`: the trainer's idle share of the time since the previous
    /// step's training ended, which includes the weight update.
    pub fn slime_wait_ratio(&self) -> f64 {
        self.timing().slime_wait_ratio
    }

    /// The bound given this rollout.
    pub fn ideal(&self) -> f64 {
        self.timing().bound_s
    }

    /// Rollout throughput, generated tokens per second of rollout.
    pub fn throughput(&self) -> f64 {
        let r = self.rollout();
        if r <= 0.0 {
            0.0
        } else {
            self.tokens_generated as f64 / r
        }
    }
}

/// One (profile, setting, mode) run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RunResult {
    /// Profile key.
    pub profile: String,
    /// Setting key.
    pub setting: String,
    /// Mode (with its tail policies).
    pub mode: Schedule,
    /// Per-step measurements.
    pub steps: Vec<StepRecord>,
    /// Total simulated time, s.
    pub makespan: f64,
    /// Simulated events processed (for the speed report).
    pub events: u64,
    /// Conservation held at every step's end (drawn = trained + filtered + aborted).
    pub conserved: bool,
}

fn mean(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { f64::NAN } else { s / n as f64 }
}

impl RunResult {
    /// Mean rollout-to-train-end time, s.
    pub fn mean_r2t(&self) -> f64 {
        mean(self.steps.iter().map(StepRecord::r2t))
    }

    /// Mean trainer waiting ratio.
    pub fn mean_wait_ratio(&self) -> f64 {
        mean(self.steps.iter().map(StepRecord::wait_ratio))
    }

    /// Mean rollout duration, s.
    pub fn mean_rollout(&self) -> f64 {
        mean(self.steps.iter().map(StepRecord::rollout))
    }

    /// Mean throughput, tokens/s.
    pub fn mean_throughput(&self) -> f64 {
        mean(self.steps.iter().map(StepRecord::throughput))
    }

    /// Mean slot occupancy.
    pub fn mean_occupancy(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.slot_occupancy))
    }

    /// Mean time between consecutive train ends (the steady-state step period), s.
    pub fn mean_period(&self) -> f64 {
        match (self.steps.first(), self.steps.last()) {
            (Some(a), Some(b)) if self.steps.len() > 1 => {
                (b.train_end - a.train_end) / (self.steps.len() - 1) as f64
            }
            (Some(a), _) => a.train_end,
            _ => f64::NAN,
        }
    }

    /// Mean of Slime's `perf/wait_time_ratio` (includes the weight update).
    pub fn mean_slime_wait_ratio(&self) -> f64 {
        mean(self.steps.iter().map(StepRecord::slime_wait_ratio))
    }

    /// Mean rollout engines' idle time inside the r2t window, s per engine.
    pub fn mean_engine_idle(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.rollout_idle))
    }

    /// Totals of the bound-moving policies: (multiplexed engine-s, groups, migrations).
    pub fn policy_totals(&self) -> (f64, u64, u64) {
        self.steps.iter().fold((0.0, 0, 0), |t, s| {
            (
                t.0 + s.mux_s,
                t.1 + u64::from(s.mux_groups),
                t.2 + u64::from(s.migrations),
            )
        })
    }

    /// Mean trainer busy time per step, s.
    pub fn mean_trainer_busy(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.trainer_busy))
    }

    /// Mean ideal bound: `T_rollout + T_train(last micro-batch)` (plus the optimizer step),
    /// tightened by the trainer's own work: no schedule ends before the first micro-batch
    /// is ready plus all training. The second term binds when training outlasts the rollout.
    pub fn mean_ideal(&self) -> f64 {
        mean(self.steps.iter().map(StepRecord::ideal))
    }

    /// Mean rollout idle time between steps: from a step's batch being final to the next
    /// step's rollout start (training tail and weight sync for on-policy modes), s.
    pub fn mean_rollout_idle(&self) -> f64 {
        mean(
            self.steps
                .windows(2)
                .map(|w| w[1].rollout_start - w[0].rollout_end),
        )
    }

    /// Mean staleness in versions.
    pub fn mean_staleness(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.staleness as f64))
    }

    /// Mean rollouts per step.
    pub fn mean_rollouts(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.rollouts as f64))
    }

    /// Mean trained samples per step.
    pub fn mean_trained_samples(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.trained_samples as f64))
    }

    /// Totals over steps: (drawn, trained, filtered, aborted groups, aborted requests).
    pub fn totals(&self) -> (u64, u64, u64, u64, u64) {
        self.steps.iter().fold((0, 0, 0, 0, 0), |t, s| {
            (
                t.0 + u64::from(s.drawn),
                t.1 + u64::from(s.trained),
                t.2 + u64::from(s.filtered),
                t.3 + u64::from(s.aborted_groups),
                t.4 + u64::from(s.aborted_requests),
            )
        })
    }
}
