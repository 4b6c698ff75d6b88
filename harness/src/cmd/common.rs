//! What the model-facing subcommands share: choosing and opening a backend in both roles,
//! finding a model directory's tokenizer, batched generation over many prompts, and writing
//! JSON.
//!
//! Every command names its backend by a [`BackendSpec`] ([`BackendArgs::spec`]) and opens it
//! with [`open_backend`].

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rolloutpipe_backends::{
    BackendKind, BackendSpec, GenOutput, GenRequest, ModelConfig, Policy, RequestKey,
    RolloutEngine, SamplingParams, Weights,
};

use crate::tasks::{CharTokenizer, HfTokenizer, Tokenizer};

/// Backend selection flags shared by the model subcommands: the [`BackendSpec`] they build.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArgs {
    /// Policy backend.
    #[arg(long, default_value = "cpu", value_parser = backend_kind())]
    pub backend: BackendKind,
    /// Worker threads of the CPU backend (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

impl BackendArgs {
    /// The backend these flags name.
    pub fn spec(&self) -> BackendSpec {
        BackendSpec {
            threads: self.threads,
            ..BackendSpec::of(self.backend)
        }
    }
}

/// `--backend`'s values: the backends' own names.
fn backend_kind() -> impl clap::builder::TypedValueParser<Value = BackendKind> {
    use clap::builder::TypedValueParser;
    let names = BackendKind::ALL.map(BackendKind::name);
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<BackendKind>())
}

/// Where a backend's model comes from.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// A model directory (`config.json` + `model.safetensors`, HF names).
    Dir(PathBuf),
    /// A fresh model with random weights drawn from `seed`.
    Random {
        /// Its configuration.
        config: ModelConfig,
        /// Initialisation seed.
        seed: u64,
    },
    /// Given weights.
    Weights {
        /// Its configuration.
        config: ModelConfig,
        /// The weights (validated against `config` by the backend).
        weights: Weights,
    },
}

/// Opens the backend `spec` names on a model, in both seam roles (engine and trainer). A model
/// directory is read the way `spec`'s backend holds it in the least memory
/// ([`BackendSpec::open_dir`]: the CPU backend converts the memory-mapped tensors straight
/// into its own storage).
///
/// ```no_run
/// use rolloutpipe_backends::BackendSpec;
/// use rolloutpipe_harness::cmd::common::{open_backend, ModelSource};
/// let be = open_backend(&BackendSpec::cpu(0), &ModelSource::Dir("model".into())).unwrap();
/// println!("{} layers", be.config().num_hidden_layers);
/// ```
pub fn open_backend(spec: &BackendSpec, source: &ModelSource) -> anyhow::Result<Box<dyn Policy>> {
    if let Some(why) = spec.kind.unavailable() {
        bail!("--backend {}: {why}", spec.kind);
    }
    let what = match spec.kind {
        BackendKind::Cpu => "creating the CPU backend",
        BackendKind::Wgpu => "creating the wgpu backend",
        BackendKind::Cuda => "creating the CUDA backend",
    };
    // Weights, gradients and two optimizer moments: refuse absurd shapes before allocating.
    let fits = |c: &ModelConfig| crate::limits::check_model_fits(c, 4, "the model's size");
    match source {
        ModelSource::Dir(dir) => {
            let path = dir.join("config.json");
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!(
                    "loading model directory {}: reading {}",
                    dir.display(),
                    path.display()
                )
            })?;
            let config = ModelConfig::from_json_str(&text)
                .with_context(|| format!("loading model directory {}", dir.display()))?;
            fits(&config)?;
            spec.open_dir(dir)
                .with_context(|| format!("loading model directory {}", dir.display()))
                .context(what)
        }
        ModelSource::Random { config, seed } => {
            fits(config)?;
            let weights = Weights::random(config, *seed).context("initialising random weights")?;
            spec.open(config, &weights).context(what)
        }
        ModelSource::Weights { config, weights } => {
            fits(config)?;
            spec.open(config, weights).context(what)
        }
    }
}

/// The tokenizer of a model directory: its `tokenizer.json` when it has one, else the
/// built-in character tokenizer. Fails when the model's vocabulary is too small for it.
pub fn tokenizer_for(
    model_dir: Option<&Path>,
    cfg: &ModelConfig,
) -> anyhow::Result<Box<dyn Tokenizer>> {
    let tok: Box<dyn Tokenizer> = match model_dir.map(|d| d.join("tokenizer.json")) {
        Some(path) if path.exists() => Box::new(HfTokenizer::from_path(&path)?),
        _ => Box::new(CharTokenizer),
    };
    if tok.vocab_size() > cfg.vocab_size {
        bail!(
            "the tokenizer has {} ids but the model's vocab_size is {}",
            tok.vocab_size(),
            cfg.vocab_size
        );
    }
    Ok(tok)
}

/// Generates a continuation for every prompt with continuous batching, at most `concurrency`
/// requests at once; request `i` samples with seed `params.seed + i`. Outputs are returned in
/// prompt order. `on_done` is called once per finished request (progress bars).
pub fn generate_all(
    be: &mut dyn RolloutEngine,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
    concurrency: usize,
    mut on_done: impl FnMut(),
) -> anyhow::Result<Vec<GenOutput>> {
    let concurrency = concurrency.max(1);
    let mut out: Vec<Option<GenOutput>> = vec![None; prompts.len()];
    let mut next = 0usize;
    let mut finished = 0usize;
    while finished < prompts.len() {
        while next < prompts.len() && be.active_requests() < concurrency {
            let mut p = params.clone();
            p.seed = params.seed.wrapping_add(next as u64);
            be.add_request(GenRequest {
                id: RequestKey(next as u64),
                prompt: prompts[next].clone(),
                params: p,
            })
            .with_context(|| format!("adding request for prompt {next}"))?;
            next += 1;
        }
        for done in be.decode_step().context("decode step")? {
            let i = done.id.0 as usize;
            if i >= out.len() || out[i].is_some() {
                bail!("backend returned an unexpected request {}", done.id);
            }
            out[i] = Some(done);
            finished += 1;
            on_done();
        }
    }
    // Every slot was filled exactly once above (finished counts distinct indices).
    Ok(out.into_iter().flatten().collect())
}

/// The response text of a generation: its tokens up to (not including) the stop token.
pub fn response_text(tok: &dyn Tokenizer, out: &GenOutput) -> anyhow::Result<String> {
    let mut ids = out.tokens.as_slice();
    if let (Some(eos), Some((&last, rest))) = (tok.eos_id(), ids.split_last())
        && last == eos
    {
        ids = rest;
    }
    Ok(tok.decode(ids)?)
}

/// Writes pretty JSON to `path`, creating its directory.
pub fn write_json(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// A progress bar on stderr for `len` items (hidden when stderr is not a terminal).
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(
        "{msg:>10} [{elapsed_precise}] {bar:30} {pos}/{len} ({per_sec}, eta {eta})",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(what.to_owned());
    crate::logging::add(bar)
}
