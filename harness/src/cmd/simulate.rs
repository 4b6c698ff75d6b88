//! `rolloutpipe simulate`: the discrete-event simulator (see `crate::sim`).
use anyhow::bail;

/// Arguments of `simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs the simulator.
pub fn run(_args: Args) -> anyhow::Result<()> {
    bail!("the simulator is not built yet")
}
