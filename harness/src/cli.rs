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
    /// End-to-end RLVR training: rollout engines, verifiers and a trainer driven by the core.
    #[command(after_help = cmd::train::config_help())]
    Train(cmd::train::Args),
    /// Runs sync and rolloutpipe on the same workload; measured vs simulated headline metrics.
    Compare(cmd::compare::Args),
    /// Logits of one token sequence as JSON (sequence × vocab).
    Logits(cmd::logits::Args),
    /// One GRPO optimizer step on a JSON batch of groups (docs/batch-format.md).
    GrpoStep(cmd::grpo_step::Args),
    /// SFT warm start on a task; writes a model directory.
    Sft(cmd::sft::Args),
    /// Accuracy of a model on a task's held-out split or a JSONL file, as JSON.
    Eval(cmd::eval::Args),
    /// Rollouts-to-target table and accuracy plots of allocation-policy runs (docs/allocation.md).
    AllocReport(cmd::alloc_report::Args),
}

/// Parses arguments, sets up logging and runs the chosen job.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    crate::logging::init(&cli.log);
    let result = match cli.command {
        Command::Simulate(args) => cmd::simulate::run(args),
        Command::Train(args) => cmd::train::run(args),
        Command::Compare(args) => cmd::compare::run(args),
        Command::Logits(args) => cmd::logits::run(args),
        Command::GrpoStep(args) => cmd::grpo_step::run(args),
        Command::Sft(args) => cmd::sft::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::AllocReport(args) => cmd::alloc_report::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
