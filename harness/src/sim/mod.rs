//! The discrete-event simulator behind `rolloutpipe simulate`.
//!
//! It models a disaggregated GRPO system: E rollout engines with continuous batching
//! (`engine`), a verifier, and a trainer pool (`trainer`), driven by events in time order
//! (`queue`, `driver`). Every scheduling decision (admission, filtering, over-sampling, abort,
//! dispatch) comes from the real `rolloutpipe-core`; the simulator only supplies time and costs.
//! Workloads (`workload`) are seeded and identical across modes, so modes differ only in
//! scheduling. `report` turns runs into the table, plots and traces.
pub mod config;
pub mod driver;
pub mod engine;
pub mod metrics;
pub mod queue;
pub mod recording;
pub mod report;
pub mod trainer;
pub mod workload;

pub use config::{Mode, SimConfig};
pub use driver::{Simulated, simulate};
pub use metrics::{RunResult, StepRecord};
