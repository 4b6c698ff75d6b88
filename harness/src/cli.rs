//! Command-line entry point: one subcommand per job, each in its own module under `cmd/`.
use clap::{Parser, Subcommand};
use std::process::ExitCode;

use crate::cmd;

/// RolloutPipe: pipelined on-policy RLVR (GRPO) with complete-group pipelining and
/// frontier-group dispatch.
#[derive(Debug, Parser)]
#[command(name = "rolloutpipe", version, about, long_about = None)]
pub struct Cli {
    /// Log filter (tracing's env-filter syntax), e.g. `info` or `rolloutpipe_harness=debug`.
    #[arg(long, global = true, default_value = "info", env = "ROLLOUTPIPE_LOG")]
    pub log: String,
    /// The job to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The jobs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Discrete-event simulation of a disaggregated cluster, driving the real scheduling core.
    Simulate(cmd::simulate::Args),
}

/// Parses arguments, sets up logging and runs the chosen job.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let result = match cli.command {
        Command::Simulate(args) => cmd::simulate::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
