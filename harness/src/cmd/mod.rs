//! One module per subcommand: each has `Args` (clap) and `run(Args) -> anyhow::Result<()>`.
pub mod simulate;
