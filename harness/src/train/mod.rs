//! End-to-end RLVR training with disaggregated rollout and trainer pools (`rolloutpipe train`).
//!
//! Threads: `rollout.engines` rollout engines, each owning a backend that continuously batches up
//! to `rollout.slots` requests; `rollout.verifiers` verifier workers; one trainer with its own
//! backend; and the scheduler (the calling thread), which owns the `rolloutpipe-core` scheduler
//! and the clock. The core decides everything (which request takes a free slot, what to abort,
//! how many prompts to draw, when a group goes to the trainer, when to step the optimizer); the
//! harness only moves data. See `docs/training.md`.
mod checkpoint;
pub mod config;
mod ctx;
pub mod data;
mod events;
pub mod guard;
pub mod metrics;
mod migrate;
mod mux;
mod phase;
mod plots;
pub mod remote;
pub mod run;
mod step_loop;
pub mod steps;
mod summary;
pub mod transport;
pub mod wire;
pub mod workers;

pub use config::{Mode, TrainConfig};
pub use guard::RunOptions;
pub use metrics::{Measured, StepMetrics, TrainedRecord, read_metrics};
pub use run::{RunOutcome, run, run_with, run_with_transport};
pub use transport::{Local, Transport};
