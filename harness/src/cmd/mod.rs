//! One module per subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.
pub mod common;
pub mod compare;
pub mod eval;
pub mod grpo_step;
pub mod logits;
pub mod sft;
pub mod simulate;
pub mod train;
