//! End-to-end RLVR training with disaggregated rollout and trainer pools (`rolloutpipe train`).
//!
//! Threads: `rollout.engines` rollout engines, each owning a backend that continuously batches up
//! to `rollout.slots` requests; `rollout.verifiers` verifier workers; one trainer with its own
//! backend; and the scheduler (the calling thread), which owns the `rolloutpipe-core` scheduler
//! and the clock. The core decides everything (which request takes a free slot, what to abort,
//! how many prompts to draw, when a group goes to the trainer, when to step the optimizer); the
//! harness only moves data. See `docs/training.md`.
pub mod config;
pub mod data;
pub mod guard;
pub mod remote;
pub mod run;
pub mod steps;
pub mod transport;
pub mod wire;
pub mod workers;

pub use config::{Mode, TrainConfig};
pub use guard::RunOptions;
pub use run::{
    Measured, RunOutcome, StepMetrics, TrainedRecord, read_metrics, run, run_with,
    run_with_transport,
};
pub use transport::{Local, Transport};
