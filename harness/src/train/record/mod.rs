//! What a run writes into its directory: `metrics.jsonl` and the raw timings
//! ([`metrics`]), checkpoints ([`checkpoint`]), plots ([`plots`]) and `summary.json`
//! ([`summary`]); the trace is `crate::trace`'s.
pub mod checkpoint;
pub mod metrics;
pub mod plots;
pub mod summary;
