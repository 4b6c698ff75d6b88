//! `rolloutpipe sft --task add --steps N --out DIR`: the SFT warm start. Cross-entropy on correct solutions (prompt → answer + `<eos>`) of the task's training
//! split, AdamW with linear warm-up and cosine decay, then a greedy evaluation on the held-out
//! split. Writes the model directory and `DIR/sft.json` (loss curve, timing, held-out accuracy),
//! so that RL starts from a model with a non-trivial accuracy, i.e. with reward variance.

use std::path::PathBuf;

use anyhow::Context;
use clap::ValueEnum;
use rolloutpipe_backends::{
    AdamW, Aggregation, ModelConfig, Objective, SamplingParams, TrainBatch, TrainSequence, Trainer,
};
use serde_json::json;

use super::common::{BackendArgs, ModelSource, open_backend, progress, tokenizer_for, write_json};
use super::eval::{TaskArgs, evaluate};
use crate::tasks::{CharTokenizer, Split, Task, Tokenizer, generate, task_by_name};

/// Model size of a fresh model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// `ModelConfig::small()`: ~0.8 M parameters, the default for CPU runs.
    Small,
    /// `ModelConfig::tiny()`: for tests only (a few hundred parameters).
    Tiny,
}

/// Arguments of `sft`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Task and difficulty.
    #[command(flatten)]
    pub task: TaskArgs,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// Problems per step.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Peak learning rate (1e-2 trains the small preset fastest on `add`; 3e-3 is ~3x slower).
    #[arg(long, default_value_t = 1e-2)]
    pub lr: f64,
    /// Linear warm-up steps before the cosine decay (to 10% of the peak).
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Decoupled weight decay (norm weights excluded).
    #[arg(long, default_value_t = 0.01)]
    pub wd: f64,
    /// Global gradient-norm clip.
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// Seed of the data draw and of a fresh model's initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Start from this model directory instead of a fresh model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Size of a fresh model (its vocabulary is widened to the tokenizer's if needed).
    #[arg(long, value_enum, default_value = "small")]
    pub preset: Preset,
    /// Held-out problems evaluated (greedy) at the end; 0 skips it.
    #[arg(long, default_value_t = 200)]
    pub eval_n: usize,
    /// Output model directory (must be new or empty unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Write into a non-empty --out (files of the same names are replaced).
    #[arg(long)]
    pub force: bool,
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Learning rate at `step`: linear warm-up to `peak`, then cosine decay to `peak / 10`.
fn lr_at(step: usize, steps: usize, warmup: usize, peak: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = steps.saturating_sub(warmup).max(1) as f64;
    let t = ((step - warmup) as f64 / span).min(1.0);
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// Runs `sft`.
pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    crate::rundir::ensure_empty_dir(&args.out, args.force, "--out")?;
    let task = task_by_name(&args.task.task, &args.task.options())?;
    let source = model_source(&args);
    let mut be = open_backend(&args.backend.spec(), &source)?;
    let tok = tokenizer_for(args.model.as_deref(), be.config())?;
    let eos = tok
        .eos_id()
        .context("SFT needs a tokenizer with an end-of-sequence token")?;
    let examples = examples(&args, task.as_ref(), tok.as_ref(), eos)?;
    let start = std::time::Instant::now();
    let (curve, tokens_total) = train(&args, be.as_mut(), &examples)?;
    let train_seconds = start.elapsed().as_secs_f64();

    let weights = be.export_weights()?;
    crate::rundir::save_model(&args.out, be.config(), &weights, args.model.as_deref())?;

    let mut eval = serde_json::Value::Null;
    if args.eval_n > 0 {
        let held = generate(task.as_ref(), args.seed, Split::HeldOut, args.eval_n)?;
        let params = SamplingParams {
            temperature: 0.0,
            max_new_tokens: 48,
            stop_tokens: vec![eos],
            ..SamplingParams::default()
        };
        let r = evaluate(
            be.as_mut(),
            tok.as_ref(),
            task.as_ref(),
            &held,
            &params,
            64,
            true,
        )?;
        eval = json!({ "n": r.n, "correct": r.correct, "accuracy": r.accuracy(), "malformed": r.malformed, "examples": r.examples });
    }
    let value = json!({
        "task": task.name(),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "parameters": be.config().num_parameters(),
        "final_loss": curve.last().and_then(|v| v.get(1)).cloned(),
        "loss_curve": curve,
        "train_seconds": train_seconds,
        "train_tokens_per_second": tokens_total as f64 / train_seconds.max(1e-9),
        "heldout_eval": eval,
    });
    write_json(&args.out.join("sft.json"), &value)?;
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// Refuses arguments that cannot work, before anything is written.
fn check(args: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.steps > 0 && args.batch_size > 0,
        "--steps and --batch-size must be positive"
    );
    args.task.check()?;
    crate::limits::finite_positive("--lr", args.lr)?;
    crate::limits::finite_nonneg("--wd", args.wd)?;
    crate::limits::finite_nonneg("--clip", args.clip)?;
    // Every step's problems are generated and tokenized up front: a few hundred bytes each.
    let problems_n = (args.steps as u128).saturating_mul(args.batch_size as u128);
    crate::limits::check_fits("--steps x --batch-size", problems_n, 512)?;
    crate::limits::check_fits("--eval-n", args.eval_n as u128, 1024)
}

/// The model to start from: `--model`'s directory, or a fresh model of `--preset`'s shape
/// that speaks the built-in character vocabulary.
fn model_source(args: &Args) -> ModelSource {
    match &args.model {
        Some(dir) => ModelSource::Dir(dir.clone()),
        None => {
            let mut config = match args.preset {
                Preset::Small => ModelConfig::small(),
                Preset::Tiny => ModelConfig::tiny(),
            };
            let tok = CharTokenizer;
            config.vocab_size = config.vocab_size.max(tok.vocab_size());
            config.bos_token_id = tok.bos_id();
            config.eos_token_id = tok.eos_id();
            ModelSource::Random {
                config,
                seed: args.seed,
            }
        }
    }
}

/// Every step's (prompt, answer + eos) token ids, in step order.
fn examples(
    args: &Args,
    task: &dyn Task,
    tok: &dyn Tokenizer,
    eos: u32,
) -> anyhow::Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let problems = generate(task, args.seed, Split::Train, args.steps * args.batch_size)?;
    let mut examples = Vec::with_capacity(problems.len());
    for (i, p) in problems.iter().enumerate() {
        let prompt = tok
            .encode_prompt(&p.prompt)
            .with_context(|| format!("encoding problem {i} prompt"))?;
        let mut response = tok
            .encode(&p.answer)
            .with_context(|| format!("encoding problem {i} answer"))?;
        response.push(eos);
        examples.push((prompt, response));
    }
    Ok(examples)
}

/// The SFT steps over `examples`; returns the loss curve (about 50 points) and the tokens
/// trained on.
fn train(
    args: &Args,
    be: &mut dyn Trainer,
    examples: &[(Vec<u32>, Vec<u32>)],
) -> anyhow::Result<(Vec<serde_json::Value>, usize)> {
    let bar = progress(args.steps as u64, "sft");
    let mut curve = Vec::new();
    let mut tokens_total = 0usize;
    let log_every = (args.steps / 50).max(1);
    let mut window = (0.0f64, 0usize);
    for (step, chunk) in examples.chunks(args.batch_size).enumerate() {
        let batch = TrainBatch {
            sequences: chunk
                .iter()
                .map(|(p, r)| TrainSequence::new(p.clone(), r.clone(), 0.0, Aggregation::TokenMean))
                .collect(),
        };
        be.zero_grad()?;
        let stats = be
            .accumulate(&batch, &Objective::Sft)
            .with_context(|| format!("SFT step {step}"))?;
        let norm = stats.tokens.max(1) as f64;
        let opt = AdamW {
            lr: lr_at(step, args.steps, args.warmup, args.lr),
            weight_decay: args.wd,
            max_grad_norm: (args.clip > 0.0).then_some(args.clip),
            exclude_norms_from_decay: true,
            ..AdamW::default()
        };
        be.optimizer_step(norm, &opt)
            .with_context(|| format!("SFT step {step}"))?;
        let loss = stats.loss_sum / norm;
        anyhow::ensure!(
            loss.is_finite(),
            "SFT loss diverged at step {step} ({loss}); lower --lr"
        );
        tokens_total += stats.tokens;
        window = (window.0 + loss, window.1 + 1);
        if (step + 1) % log_every == 0 || step + 1 == args.steps {
            let mean = window.0 / window.1 as f64;
            curve.push(json!([step + 1, mean]));
            bar.set_message(format!("loss {mean:.3}"));
            tracing::debug!(step = step + 1, loss = mean, "sft");
            window = (0.0, 0);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok((curve, tokens_total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_a_tenth() {
        assert!((lr_at(0, 100, 10, 1.0) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 100, 10, 1.0) - 1.0).abs() < 1e-12);
        assert!((lr_at(10, 100, 10, 1.0) - 1.0).abs() < 1e-12);
        assert!((lr_at(55, 100, 10, 1.0) - 0.55).abs() < 1e-12);
        assert!((lr_at(100, 100, 10, 1.0) - 0.1).abs() < 1e-12);
        assert!(lr_at(1, 5, 0, 1.0) < 1.0);
    }
}
