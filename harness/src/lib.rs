//! The harness glues RolloutPipe together: it drives `rolloutpipe-core` (scheduling decisions)
//! with `rolloutpipe-backends` (generation and training) for end-to-end runs, runs the
//! discrete-event simulator, evaluates models and writes metrics, plots and traces.
#![deny(missing_docs)]

pub mod alloc;
pub mod cli;
pub mod cmd;
pub mod driver;
pub mod interrupt;
pub mod limits;
pub mod logging;
pub mod plot;
pub mod rundir;
pub mod sim;
pub mod tasks;
pub mod toml_config;
pub mod trace;
pub mod train;
