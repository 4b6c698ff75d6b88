//! End-to-end RLVR training with disaggregated rollout and trainer pools (`rolloutpipe train`).
//!
//! Threads: `rollout.engines` rollout engines, each owning a backend that continuously batches up
//! to `rollout.slots` requests; `rollout.verifiers` verifier workers; one trainer with its own
//! backend; and the scheduler (the calling thread), which owns the `rolloutpipe-core` scheduler
//! and the clock. The core decides everything (which request takes a free slot, what to abort,
//! how many prompts to draw, when a group goes to the trainer, when to step the optimizer); the
//! harness only moves data. See `docs/training.md`.
//!
//! By layer:
//!
//! | module | what |
//! |---|---|
//! | [`config`] | the typed config: sections, loading and `--set`, validation, the plan |
//! | [`run`] | the run: setup, the step loop (`run::steps`), one phase as the step driver's workers (`run::phase`), tail multiplexing and long-tail migration |
//! | [`msg`] | the messages between the scheduler and the workers, one vocabulary for channels, wire and checkpoints |
//! | [`workers`] | the workers (engine, trainer, verifier), their backends, and the [`Transport`] that starts them |
//! | [`remote`] | the workers behind a caller's `send`: hosts, proxies, protocol and wire framing |
//! | [`record`] | what a run writes: metrics, checkpoints, plots, the summary |
//! | [`data`], [`guard`] | problems, SFT and evaluation; the run directory's checks |
pub mod config;
pub mod data;
pub mod guard;
pub mod msg;
pub mod record;
pub mod remote;
pub mod run;
pub mod workers;

pub use config::{Mode, TrainConfig};
pub use guard::RunOptions;
pub use record::metrics::{Measured, StepMetrics, TrainedRecord, read_metrics};
pub use run::{RunOutcome, run, run_with, run_with_transport};
pub use workers::transport::{Local, Transport};
