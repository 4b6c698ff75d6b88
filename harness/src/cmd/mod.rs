//! One module per subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.
pub mod alloc_report;
pub mod common;
pub mod compare;
pub mod eval;
pub mod grpo_step;
pub mod logits;
pub mod sft;
pub mod simulate;
pub mod simulate_alloc;
pub mod train;
