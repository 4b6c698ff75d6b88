//! `rolloutpipe logits --model DIR --ids 1,2,3`: the raw logits of one sequence as JSON
//! (`{"ids": [...], "vocab_size": V, "logits": [[V floats] per position]}`), for inspection and
//! for parity checks against other implementations (e.g. transformers on the same directory).

use std::path::PathBuf;

use anyhow::{Context, bail};
use serde_json::json;

use super::common::{BackendArgs, ModelSource, open_backend, write_json};

/// Arguments of `logits`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model directory (`config.json` + `model.safetensors`).
    #[arg(long)]
    pub model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', num_args = 1.., required = true)]
    pub ids: Vec<u32>,
    /// Write the JSON here instead of stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Runs `logits`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ids.is_empty() {
        bail!("--ids needs at least one token id");
    }
    let mut be = open_backend(&args.backend.spec(), &ModelSource::Dir(args.model.clone()))?;
    let vocab = be.config().vocab_size;
    let flat = be.logits(&args.ids).context("computing logits")?;
    let rows: Vec<&[f32]> = flat.chunks(vocab).collect();
    let value = json!({ "ids": args.ids, "vocab_size": vocab, "logits": rows });
    match &args.out {
        Some(path) => write_json(path, &value),
        None => {
            println!("{}", serde_json::to_string(&value)?);
            Ok(())
        }
    }
}
