//! What the model-facing subcommands share: choosing and opening a backend in both roles,
//! finding a model directory's tokenizer, batched generation over many prompts, and writing
//! JSON.
//!
//! [`open_backend`] serves these commands (`sft`, `eval`, `logits`, `grpo-step`); `train`
//! builds its engines and trainer from `run.backend` in `train::workers` instead.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::ValueEnum;
use rolloutpipe_backends::{
    CpuBackend, GenOutput, GenRequest, ModelConfig, Policy, RequestKey, RolloutEngine,
    SamplingParams, Weights, load_model_dir,
};

use crate::tasks::{CharTokenizer, HfTokenizer, Tokenizer};

/// Which policy backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The f32 CPU reference.
    Cpu,
    /// The portable GPU backend (WGSL on any wgpu adapter: Vulkan, Metal, DX12, GL, lavapipe).
    #[cfg(feature = "wgpu")]
    Wgpu,
    /// The CUDA backend (PTX kernels through cudarc; device 0). Needs a build with the
    /// `cuda` feature and an NVIDIA driver; otherwise it fails with a one-line error.
    Cuda,
}

/// Backend selection flags shared by the model subcommands.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArgs {
    /// Policy backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// Worker threads of the CPU backend (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
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

/// Opens a backend of `kind` on a model, in both seam roles (engine and trainer).
///
/// ```no_run
/// use rolloutpipe_harness::cmd::common::{open_backend, BackendKind, ModelSource};
/// let be = open_backend(BackendKind::Cpu, &ModelSource::Dir("model".into()), 0).unwrap();
/// println!("{} layers", be.config().num_hidden_layers);
/// ```
pub fn open_backend(
    kind: BackendKind,
    source: &ModelSource,
    threads: usize,
) -> anyhow::Result<Box<dyn Policy>> {
    let (config, weights) = match source {
        ModelSource::Dir(dir) => load_model_dir(dir)
            .with_context(|| format!("loading model directory {}", dir.display()))?,
        ModelSource::Random { config, seed } => (
            config.clone(),
            Weights::random(config, *seed).context("initialising random weights")?,
        ),
        ModelSource::Weights { config, weights } => (config.clone(), weights.clone()),
    };
    // Weights, gradients and two optimizer moments: refuse absurd shapes before allocating.
    crate::limits::check_model_fits(&config, 4, "the model's size")?;
    if kind == BackendKind::Cuda
        && let Some(why) = rolloutpipe_backends::cuda::availability()
    {
        bail!("--backend cuda: {why}");
    }
    match kind {
        BackendKind::Cpu => Ok(Box::new(
            CpuBackend::new(&config, &weights, threads).context("creating the CPU backend")?,
        )),
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(Box::new(
            rolloutpipe_backends::wgpu::WgpuBackend::new(&config, &weights)
                .context("creating the wgpu backend")?,
        )),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => Ok(Box::new(
            rolloutpipe_backends::cuda::CudaBackend::new(&config, &weights, 0)
                .context("creating the CUDA backend")?,
        )),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => bail!(
            "--backend cuda: {}",
            rolloutpipe_backends::cuda::availability().unwrap_or_default()
        ),
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
