//! `rolloutpipe grpo-step --model DIR --batch FILE --out DIR2`: one GRPO optimizer step on a
//! JSON batch of groups (format: `docs/batch-format.md`). Writes `DIR2/result.json` (loss, grad
//! norm before clipping, ...), the updated model directory in `DIR2`, and with `--save-grads`
//! the normalized gradient before clipping as `DIR2/grads.safetensors`. The model is loaded
//! straight into the trainer's storage and both files are written tensor by tensor from it,
//! so the step holds one copy of the weights, gradients and moments, as a training run does. Every objective and
//! optimizer setting of the trainer's is a flag, so parity checks against other trainers can pin them.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::ValueEnum;
use rolloutpipe_backends::weights::param_specs;
use rolloutpipe_backends::{
    AdamW, Aggregation, ModelConfig, Objective, Policy, StdMode, TrainBatch, TrainSequence,
    advantages, normalizer, write_model_dir, write_safetensors,
};
use serde::Deserialize;
use serde_json::json;

use super::common::{BackendArgs, ModelSource, open_backend, write_json};

/// Loss aggregation (`--agg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AggArg {
    /// Mean over all response tokens of the step (DAPO).
    TokenMean,
    /// Mean over each sequence's tokens, then over sequences.
    SeqMean,
}

/// Advantage normalization (`--std`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StdArg {
    /// Sample standard deviation (ddof 1).
    Sample,
    /// Population standard deviation.
    Pop,
    /// No division (Dr. GRPO).
    None,
}

impl From<AggArg> for Aggregation {
    fn from(a: AggArg) -> Self {
        match a {
            AggArg::TokenMean => Aggregation::TokenMean,
            AggArg::SeqMean => Aggregation::SeqMean,
        }
    }
}

impl From<StdArg> for StdMode {
    fn from(s: StdArg) -> Self {
        match s {
            StdArg::Sample => StdMode::Sample,
            StdArg::Pop => StdMode::Population,
            StdArg::None => StdMode::None,
        }
    }
}

/// Arguments of `grpo-step`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model directory to start from.
    #[arg(long)]
    pub model: PathBuf,
    /// The batch of groups (JSON, see docs/batch-format.md).
    #[arg(long)]
    pub batch: PathBuf,
    /// Output directory: result.json, the updated model, and grads.safetensors (must be new or
    /// empty unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Write into a non-empty --out (files of the same names are replaced).
    #[arg(long)]
    pub force: bool,
    /// Also write the normalized gradient before clipping to `OUT/grads.safetensors`.
    #[arg(long)]
    pub save_grads: bool,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub wd: f64,
    /// Global gradient-norm clip (0 = no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Adam β1.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    /// Adam β2.
    #[arg(long, default_value_t = 0.999)]
    pub beta2: f64,
    /// Adam ε.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// Do not decay norm weights.
    #[arg(long)]
    pub no_decay_norms: bool,
    /// Lower clip range ε_low.
    #[arg(long, default_value_t = 0.2)]
    pub eps_low: f64,
    /// Upper clip range ε_high.
    #[arg(long, default_value_t = 0.2)]
    pub eps_high: f64,
    /// KL (k3) weight β.
    #[arg(long, default_value_t = 0.0)]
    pub beta: f64,
    /// Loss aggregation.
    #[arg(long, value_enum, default_value = "token-mean")]
    pub agg: AggArg,
    /// Advantage normalization.
    #[arg(long, value_enum, default_value = "sample")]
    pub std: StdArg,
    /// Sampling temperature of the rollout (log-probs are of logits / T).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// The batch file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchFile {
    /// Groups in dispatch order.
    pub groups: Vec<GroupJson>,
}

/// One group of the batch file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupJson {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// The group's responses.
    pub responses: Vec<ResponseJson>,
}

/// One response of the batch file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseJson {
    /// Response token ids.
    pub tokens: Vec<u32>,
    /// Its reward (must be finite).
    pub reward: f64,
    /// Rollout log-probs, one per token; `null`: the current model's.
    #[serde(default)]
    pub old_logprobs: Option<Vec<f32>>,
    /// Reference log-probs, one per token; `null`: the current model's.
    #[serde(default)]
    pub ref_logprobs: Option<Vec<f32>>,
}

impl BatchFile {
    /// Reads and parses a batch file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("parsing batch file {}", path.display()))
    }

    /// Checks token ids and lengths against the model, naming the group and response at fault
    /// (the backend checks too, but only knows the flattened sequence index).
    pub fn check_model(&self, cfg: &ModelConfig) -> anyhow::Result<()> {
        for (g, group) in self.groups.iter().enumerate() {
            if let Some(&t) = group.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                bail!(
                    "group {g} prompt: token {t} >= vocab_size {}",
                    cfg.vocab_size
                );
            }
            for (j, r) in group.responses.iter().enumerate() {
                if let Some(&t) = r.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                    bail!(
                        "group {g} response {j}: token {t} >= vocab_size {}",
                        cfg.vocab_size
                    );
                }
                let len = group.prompt.len() + r.tokens.len();
                if len > cfg.max_position_embeddings {
                    bail!(
                        "group {g} response {j}: prompt + response is {len} tokens, more than max_position_embeddings {}",
                        cfg.max_position_embeddings
                    );
                }
            }
        }
        Ok(())
    }

    /// The training batch: advantages per group, per-token weights of `agg`. Checks the
    /// structure (non-empty groups and responses, finite rewards, log-prob lengths) and names
    /// the group and response at fault.
    pub fn to_train_batch(&self, agg: Aggregation, std: StdMode) -> anyhow::Result<TrainBatch> {
        if self.groups.is_empty() {
            bail!("the batch has no groups");
        }
        let mut batch = TrainBatch::default();
        for (g, group) in self.groups.iter().enumerate() {
            if group.prompt.is_empty() {
                bail!("group {g}: empty prompt");
            }
            if group.responses.is_empty() {
                bail!("group {g}: no responses");
            }
            let rewards: Vec<f64> = group.responses.iter().map(|r| r.reward).collect();
            let adv = advantages(&rewards, std).with_context(|| format!("group {g}"))?;
            for (j, r) in group.responses.iter().enumerate() {
                if r.tokens.is_empty() {
                    bail!("group {g} response {j}: no tokens");
                }
                for (what, lp) in [
                    ("old_logprobs", &r.old_logprobs),
                    ("ref_logprobs", &r.ref_logprobs),
                ] {
                    if let Some(lp) = lp {
                        if lp.len() != r.tokens.len() {
                            bail!(
                                "group {g} response {j}: {what} has {} values for {} tokens",
                                lp.len(),
                                r.tokens.len()
                            );
                        }
                        if let Some(i) = lp.iter().position(|x| !x.is_finite() || *x > 0.0) {
                            bail!(
                                "group {g} response {j}: {what}[{i}] = {} is not a log-probability",
                                lp[i]
                            );
                        }
                    }
                }
                let mut s = TrainSequence::new(group.prompt.clone(), r.tokens.clone(), adv[j], agg);
                s.old_logprobs = r.old_logprobs.clone();
                s.ref_logprobs = r.ref_logprobs.clone();
                batch.sequences.push(s);
            }
        }
        Ok(batch)
    }
}

/// The first group's prompt and first response: the sequence whose logits probe the model.
fn probe_ids(file: &BatchFile) -> Vec<u32> {
    let mut ids = Vec::new();
    if let Some(g) = file.groups.first() {
        ids.extend(&g.prompt);
        if let Some(r) = g.responses.first() {
            ids.extend(&r.tokens);
        }
    }
    ids
}

/// Whether the model's logits on the probe sequence are finite and not all equal.
fn probe(be: &mut dyn Policy, file: &BatchFile) -> anyhow::Result<bool> {
    let ids = probe_ids(file);
    if ids.is_empty() {
        return Ok(true);
    }
    let l = be.logits(&ids).context("probing the model's logits")?;
    let finite = l.iter().all(|x| x.is_finite());
    let (lo, hi) = l
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    Ok(finite && hi > lo)
}

/// Refuses to save a step that broke the model: non-finite weights, or logits that were
/// informative before the step and are non-finite or constant after it (a huge `--lr`). The
/// weights are checked tensor by tensor where the trainer keeps them (no copy of the model).
fn check_usable(be: &mut dyn Policy, file: &BatchFile, before: bool) -> anyhow::Result<()> {
    let mut broken = None;
    be.visit_weights(&mut |name, values| {
        if broken.is_none() && values.iter().any(|x| !x.is_finite()) {
            broken = Some(name.to_string());
        }
        Ok(())
    })?;
    if let Some(name) = broken {
        bail!("the step made weight {name} non-finite (is --lr too large?); nothing was saved");
    }
    if before && !probe(be, file)? {
        bail!(
            "after the step the model's logits are non-finite or all equal (is --lr too large?); nothing was saved"
        );
    }
    Ok(())
}

/// Runs `grpo-step`.
pub fn run(args: Args) -> anyhow::Result<()> {
    crate::rundir::ensure_empty_dir(&args.out, args.force, "--out")?;
    for (name, x) in [("--lr", args.lr), ("--wd", args.wd), ("--clip", args.clip)] {
        crate::limits::finite_nonneg(name, x)?;
    }
    let agg: Aggregation = args.agg.into();
    let file = BatchFile::load(&args.batch)?;
    let batch = file.to_train_batch(agg, args.std.into())?;
    let mut be = open_backend(&args.backend.spec(), &ModelSource::Dir(args.model.clone()))?;
    file.check_model(be.config())?;
    let before = probe(be.as_mut(), &file)?;
    let obj = Objective::Grpo {
        eps_low: args.eps_low,
        eps_high: args.eps_high,
        beta: args.beta,
        temperature: args.temperature,
    };
    let opt = AdamW {
        lr: args.lr,
        beta1: args.beta1,
        beta2: args.beta2,
        eps: args.adam_eps,
        weight_decay: args.wd,
        max_grad_norm: (args.clip > 0.0).then_some(args.clip),
        exclude_norms_from_decay: args.no_decay_norms,
    };
    opt.validate().context("optimizer settings")?;

    be.zero_grad()?;
    let stats = be
        .accumulate(&batch, &obj)
        .context("GRPO forward/backward")?;
    let norm = normalizer(agg, std::slice::from_ref(&batch));
    if args.save_grads {
        // Written one normalized tensor at a time from the trainer's own sums.
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))?;
        let path = args.out.join("grads.safetensors");
        write_safetensors(&path, &param_specs(be.config()), |put| {
            be.visit_gradients(&mut |name, g| {
                let scaled: Vec<f32> = g.iter().map(|x| (f64::from(*x) / norm) as f32).collect();
                put(name, &scaled)
            })
        })
        .with_context(|| format!("writing {}", path.display()))?;
    }
    let opt_stats = be.optimizer_step(norm, &opt).context("optimizer step")?;
    check_usable(be.as_mut(), &file, before)?;
    // The updated model, one tensor at a time from the trainer's own weights.
    write_model_dir(&args.out, be.config(), |put| be.visit_weights(put))
        .with_context(|| format!("saving the model to {}", args.out.display()))?;
    crate::rundir::copy_tokenizer(Some(&args.model), &args.out)?;

    let tokens = stats.tokens.max(1) as f64;
    let result = json!({
        "loss": stats.loss_sum / norm,
        "grad_norm": opt_stats.grad_norm,
        "clip_scale": opt_stats.clip_scale,
        "normalizer": norm,
        "groups": file.groups.len(),
        "sequences": stats.sequences,
        "tokens": stats.tokens,
        "kl_mean": stats.kl_sum / tokens,
        "entropy_mean": stats.entropy_sum / tokens,
        "clip_fraction": stats.clip_fraction(),
        "settings": {
            "backend": be.name(),
            "lr": args.lr, "wd": args.wd, "clip": args.clip, "beta1": args.beta1, "beta2": args.beta2,
            "adam_eps": args.adam_eps, "no_decay_norms": args.no_decay_norms,
            "eps_low": args.eps_low, "eps_high": args.eps_high, "beta": args.beta,
            "agg": value_name(args.agg), "std": value_name(args.std), "temperature": args.temperature,
        },
    });
    write_json(&args.out.join("result.json"), &result)?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// The flag spelling of a value (`token-mean`), for result files that mirror the command line.
fn value_name(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_owned())
        .unwrap_or_default()
}
