//! The simulator's state besides the engines: its events, its requests and each step's
//! bookkeeping (the core holds the protocol state), and the cores' slot storage.
use rolloutpipe_core::{GroupId, GroupSlot, PolicyVersion, RequestId, RequestSlot};

use super::super::engine::Ns;
use super::super::metrics::StepRecord;
use super::super::workload::{GroupDraw, Workload};
use crate::driver::metrics::Occupancy;

#[derive(Debug, Clone, Copy)]
pub(super) enum Ev {
    Boundary {
        engine: usize,
        epoch: u64,
    },
    /// A multiplexed log-prob pass ended on an engine: wake the loop to reuse the engine.
    MuxDone,
    Reward {
        key: usize,
    },
    MicroBatchDone {
        step: u64,
    },
    OptimizerDone {
        step: u64,
    },
    StartRollout {
        step: u64,
    },
    StartTrain {
        step: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReqStatus {
    Running,
    Generated,
    Done,
    Aborted,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct ReqInfo {
    pub(super) id: RequestId,
    pub(super) version: PolicyVersion,
    pub(super) engine: u16,
    pub(super) start: Ns,
    pub(super) tokens: u32,
    pub(super) reward: f32,
    pub(super) status: ReqStatus,
}

/// Per-step bookkeeping on the simulator's side (the core holds the protocol state).
#[derive(Debug)]
pub(super) struct StepCtx {
    pub(super) version: u64,
    pub(super) workload: Workload,
    pub(super) groups: Vec<GroupDraw>,
    pub(super) completed: Vec<bool>,
    pub(super) dispatched: Vec<GroupId>,
    pub(super) start: Ns,
    pub(super) rollout_end: Option<Ns>,
    pub(super) train_end: Option<Ns>,
    pub(super) trainer_busy: Ns,
    pub(super) last_mb: Ns,
    pub(super) last_opt: Ns,
    pub(super) tokens_generated: u64,
    /// Requests the engines held over the rollout (slot occupancy).
    pub(super) occupancy: Occupancy,
    pub(super) retractions_at_start: u64,
    pub(super) retractions: u64,
    pub(super) completions: Vec<Ns>,
    /// Per group: when its data has reached the trainer.
    pub(super) data_ready: Vec<Ns>,
    /// Per group: when an engine finished its log-prob pass (tail multiplexing).
    pub(super) logprob_ready: Vec<Option<Ns>>,
    /// Per group: its micro-batch has started (no engine may take its log-prob pass).
    pub(super) mb_started: Vec<bool>,
    /// Engines' busy time when the step started (for its rollout idle time).
    pub(super) engine_busy_at_start: Ns,
    pub(super) mux_ns: Ns,
    pub(super) mux_groups: u32,
    pub(super) migrations: u32,
    /// Samples of the groups dispatched to the trainer.
    pub(super) trained_samples: u64,
    /// Groups the allocation policy extended.
    pub(super) extended: u32,
    pub(super) metrics: Option<StepRecord>,
    /// One-step-off: the barrier after this step's rollout has fired.
    pub(super) barrier_passed: bool,
}

/// Storage for the core: two schedulers, so one-step-off can train step k while rolling out k+1.
pub(super) struct CoreStorage {
    pub(super) groups: [Vec<GroupSlot>; 2],
    pub(super) requests: [Vec<RequestSlot>; 2],
}

impl CoreStorage {
    pub(super) fn new(max_groups: u32, requests: usize) -> Self {
        let g = max_groups as usize;
        let r = requests;
        Self {
            groups: [vec![GroupSlot::EMPTY; g], vec![GroupSlot::EMPTY; g]],
            requests: [vec![RequestSlot::EMPTY; r], vec![RequestSlot::EMPTY; r]],
        }
    }
}
