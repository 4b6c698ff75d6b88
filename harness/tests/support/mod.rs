//! Shared helpers of the harness's integration tests.
pub mod cli;
pub mod loopback;
pub mod train;
