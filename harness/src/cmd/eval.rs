//! `rolloutpipe eval --model DIR --task add`: accuracy of a model on a task's held-out split (or,
//! with `--data FILE.jsonl`, on the user's own problems, checked by the task's verifier), as
//! JSON. Greedy decoding by default, so the number is reproducible.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rolloutpipe_backends::{RolloutEngine, SamplingParams};
use serde_json::json;

use super::common::{
    BackendArgs, ModelSource, generate_all, open_backend, progress, response_text, tokenizer_for,
    write_json,
};
use crate::tasks::{
    JsonlKeys, Problem, Split, Task, TaskOptions, Tokenizer, Verdict, Verifier, generate,
    load_jsonl_with, task_by_name, uniform_test_set,
};

/// Task selection and difficulty flags shared by `sft` and `eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct TaskArgs {
    /// Task: add, mul or countdown.
    #[arg(long)]
    pub task: String,
    /// add/mul only: most digits per operand [default: 3 for add, 2 for mul].
    #[arg(long)]
    pub digits: Option<u32>,
    /// countdown only: how many numbers are given [default: 4].
    #[arg(long)]
    pub numbers: Option<usize>,
    /// Penalty for a malformed response (reward −penalty instead of 0).
    #[arg(long)]
    pub format_penalty: Option<f32>,
    /// add/mul: answers are written least-significant digit first (a model trained with
    /// `task.reverse = true`).
    #[arg(long)]
    pub reverse: bool,
}

impl TaskArgs {
    /// Refuses a difficulty flag the chosen task would ignore.
    pub fn check(&self) -> anyhow::Result<()> {
        let arith = matches!(self.task.as_str(), "add" | "mul");
        anyhow::ensure!(
            !(arith && self.numbers.is_some()),
            "--numbers applies to countdown only; {} takes --digits",
            self.task
        );
        anyhow::ensure!(
            !(self.task == "countdown" && self.digits.is_some()),
            "--digits applies to add and mul only; countdown takes --numbers"
        );
        Ok(())
    }

    /// The task's options.
    pub fn options(&self) -> TaskOptions {
        TaskOptions {
            digits: self.digits,
            numbers: self.numbers,
            format_penalty: self.format_penalty,
            heldout_per_mille: None,
            reverse: Some(self.reverse),
            uniform_operands: None,
        }
    }
}

/// Arguments of `eval`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Task and difficulty.
    #[command(flatten)]
    pub task: TaskArgs,
    /// Evaluate on these problems (JSONL, `{"prompt": ..., "answer": ...}` per line) instead of
    /// the task's held-out split.
    #[arg(long, conflicts_with = "uniform")]
    pub data: Option<PathBuf>,
    /// Field of --data holding the prompt.
    #[arg(long, default_value = "prompt")]
    pub input_key: String,
    /// Field of --data holding the answer.
    #[arg(long, default_value = "answer")]
    pub label_key: String,
    /// add/mul: evaluate on the independent test distribution instead of the held-out split:
    /// `--n` problems with both operands uniform in 0..10^digits, drawn from `--seed`, not
    /// filtered by the split (the training generator draws the digit count first, so half of its
    /// operands have fewer digits).
    #[arg(long)]
    pub uniform: bool,
    /// Also write the evaluated problems here as JSONL (`{"prompt", "answer"}` per line), so
    /// another stack (scripts/rl/trl_compare.py) can score itself on exactly the same set. The
    /// file must not exist.
    #[arg(long)]
    pub write_problems: Option<PathBuf>,
    /// Number of held-out problems.
    #[arg(long, default_value_t = 200)]
    pub n: usize,
    /// Seed of the held-out draw (and of sampling when `--temperature` > 0).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Responses sampled per problem (needs --temperature > 0 when above 1): the report adds
    /// `pass_at_k`, the fraction of problems with at least one correct response among them, and
    /// `accuracy` is the mean over all responses.
    #[arg(long, default_value_t = 1)]
    pub samples: usize,
    /// Most generated tokens per problem.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Concurrent requests.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Write the JSON report here too (it always goes to stdout); must be a new file unless
    /// --force.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Replace an existing --out file.
    #[arg(long)]
    pub force: bool,
    /// Backend selection.
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// Accuracy of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Problems evaluated.
    pub n: usize,
    /// Verified correct.
    pub correct: usize,
    /// Not in the expected format.
    pub malformed: usize,
    /// Mean reward (with the format penalty).
    pub mean_reward: f64,
    /// Mean generated tokens per problem.
    pub mean_tokens: f64,
    /// The first few problems with the model's response and verdict.
    pub examples: Vec<serde_json::Value>,
    /// Whether each problem's response was verified correct, in problem order.
    pub correct_each: Vec<bool>,
}

impl EvalReport {
    /// Fraction verified correct.
    pub fn accuracy(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.correct as f64 / self.n as f64
        }
    }
}

/// Generates a response for every problem and verifies it.
pub fn evaluate(
    be: &mut dyn RolloutEngine,
    tok: &dyn Tokenizer,
    verifier: &dyn Verifier,
    problems: &[Problem],
    params: &SamplingParams,
    concurrency: usize,
    show_progress: bool,
) -> anyhow::Result<EvalReport> {
    let prompts = problems
        .iter()
        .enumerate()
        .map(|(i, p)| {
            tok.encode_prompt(&p.prompt)
                .with_context(|| format!("encoding prompt {i} {:?}", p.prompt))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bar = progress(problems.len() as u64, "eval");
    if !show_progress {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let outs = generate_all(be, &prompts, params, concurrency, || bar.inc(1))?;
    bar.finish_and_clear();
    let mut report = EvalReport {
        n: problems.len(),
        correct: 0,
        malformed: 0,
        mean_reward: 0.0,
        mean_tokens: 0.0,
        examples: Vec::new(),
        correct_each: Vec::with_capacity(problems.len()),
    };
    let mut reward_sum = 0.0f64;
    let mut token_sum = 0usize;
    for (p, out) in problems.iter().zip(&outs) {
        // A model whose vocabulary is wider than its tokenizer's (HF pads vocabularies) can emit
        // ids with no text: that response is malformed, not a reason to abort the evaluation.
        let (text, verdict, reward) = match response_text(tok, out) {
            Ok(text) => {
                let v = verifier.verify(p, &text);
                let r = verifier.reward(p, &text);
                (text, v, r)
            }
            Err(e) => (
                String::new(),
                Verdict::Malformed(e.to_string()),
                -verifier.format_penalty(),
            ),
        };
        reward_sum += f64::from(reward);
        token_sum += out.tokens.len();
        report.correct_each.push(verdict.is_correct());
        match &verdict {
            Verdict::Correct => report.correct += 1,
            Verdict::Malformed(_) => report.malformed += 1,
            Verdict::Incorrect(_) => {}
        }
        if report.examples.len() < 8 {
            let (v, why) = match verdict {
                Verdict::Correct => ("correct", String::new()),
                Verdict::Incorrect(r) => ("incorrect", r),
                Verdict::Malformed(r) => ("malformed", r),
            };
            report.examples.push(json!({
                "prompt": p.prompt, "answer": p.answer, "response": text, "verdict": v, "reason": why,
            }));
        }
    }
    let n = problems.len().max(1) as f64;
    report.mean_reward = reward_sum / n;
    report.mean_tokens = token_sum as f64 / n;
    Ok(report)
}

/// Runs `eval`.
pub fn run(args: Args) -> anyhow::Result<()> {
    check(&args)?;
    let task = task_by_name(&args.task.task, &args.task.options())?;
    let (problems, distribution) = problems(&args, task.as_ref())?;
    if let Some(path) = &args.write_problems {
        write_problems(path, &problems)?;
    }
    let mut be = open_backend(&args.backend.spec(), &ModelSource::Dir(args.model.clone()))?;
    let tok = tokenizer_for(Some(&args.model), be.config())?;
    let params = SamplingParams {
        temperature: args.temperature,
        max_new_tokens: args.max_tokens,
        stop_tokens: tok.eos_id().into_iter().collect(),
        seed: args.seed,
        ..SamplingParams::default()
    };
    let start = std::time::Instant::now();
    // Each problem `samples` times in a row; every response gets its own sampling seed.
    let k = args.samples;
    let sampled: Vec<Problem> = problems
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), k))
        .collect();
    let report = evaluate(
        be.as_mut(),
        tok.as_ref(),
        task.as_ref(),
        &sampled,
        &params,
        args.concurrency,
        true,
    )?;
    let pass_at_k = pass_at_k(&report.correct_each, k);
    let value = json!({
        "task": task.name(),
        "split": if args.data.is_some() { "data" } else if args.uniform { "uniform" } else { "held-out" },
        "distribution": distribution,
        "data": args.data,
        "n": problems.len(),
        "responses": report.n,
        "correct": report.correct,
        "accuracy": report.accuracy(),
        "malformed": report.malformed,
        "mean_reward": report.mean_reward,
        "mean_tokens": report.mean_tokens,
        "temperature": args.temperature,
        "samples": k,
        "pass_at_k": pass_at_k,
        "seed": args.seed,
        "seconds": start.elapsed().as_secs_f64(),
        "examples": report.examples,
    });
    if let Some(path) = &args.out {
        write_json(path, &value)?;
    }
    println!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}

/// Refuses arguments that cannot work, before anything is read or written.
fn check(args: &Args) -> anyhow::Result<()> {
    if let Some(path) = &args.out {
        crate::rundir::ensure_new_file(path, args.force, "--out")?;
    }
    anyhow::ensure!(
        args.data.is_some() || args.n >= 1,
        "--n must be at least 1 (an accuracy over no problems means nothing)"
    );
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    anyhow::ensure!(args.samples >= 1, "--samples must be at least 1");
    anyhow::ensure!(
        args.samples == 1 || args.temperature > 0.0,
        "--samples {} with --temperature 0: greedy responses are all the same; give a temperature",
        args.samples
    );
    crate::limits::finite_nonneg("--temperature", f64::from(args.temperature))?;
    // A generated problem, its prompt ids and its report entry: well under 1 KiB each.
    crate::limits::check_fits("--n", args.n as u128, 1024)?;
    crate::limits::check_fits(
        "--n x --samples",
        args.n as u128 * args.samples as u128,
        1024,
    )?;
    args.task.check()
}

/// The problems to evaluate, and the distribution they are from (every report names it).
fn problems(args: &Args, task: &dyn Task) -> anyhow::Result<(Vec<Problem>, String)> {
    Ok(match &args.data {
        Some(path) => {
            let keys = JsonlKeys {
                input: args.input_key.clone(),
                label: args.label_key.clone(),
            };
            (
                load_jsonl_with(path, task, &keys)?,
                format!("data: the problems of {}", path.display()),
            )
        }
        None if args.uniform => {
            let digits = args
                .task
                .digits
                .unwrap_or(if task.name() == "mul" { 2 } else { 3 });
            uniform_test_set(task.name(), digits, args.task.reverse, args.seed, args.n)?
                .with_context(|| {
                    format!(
                        "--uniform: task {} has no uniform test distribution (add, mul)",
                        task.name()
                    )
                })?
        }
        None => (
            generate(task, args.seed, Split::HeldOut, args.n)?,
            format!(
                "held-out: {} problems of the {} generator's held-out split (training distribution), seed {}",
                args.n,
                task.name(),
                args.seed
            ),
        ),
    })
}

/// `--write-problems`: the evaluated problems as JSONL, into a file that must not exist yet
/// (an existing file is the user's and is never overwritten).
fn write_problems(path: &Path, problems: &[Problem]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut text = String::new();
    for p in problems {
        text.push_str(&serde_json::to_string(
            &json!({"prompt": p.prompt, "answer": p.answer}),
        )?);
        text.push('\n');
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| {
            format!(
                "--write-problems {} (it must not exist yet)",
                path.display()
            )
        })
}

/// Fraction of problems with at least one correct response, `correct` holding `k` verdicts per
/// problem in a row.
pub fn pass_at_k(correct: &[bool], k: usize) -> f64 {
    let k = k.max(1);
    let problems = correct.len() / k;
    if problems == 0 {
        return 0.0;
    }
    let solved = correct
        .chunks(k)
        .filter(|c| c.len() == k && c.iter().any(|&x| x))
        .count();
    solved as f64 / problems as f64
}

#[cfg(test)]
mod tests {
    use super::pass_at_k;

    #[test]
    fn pass_at_k_counts_problems_with_any_correct_response() {
        let c = [false, true, false, false, false, false, true, true];
        // Pairs: [f t] [f f] [f f] [t t]; fours: [f t f f] [f f t t].
        assert_eq!(pass_at_k(&c, 2), 0.5);
        assert_eq!(pass_at_k(&c, 4), 1.0);
        assert_eq!(pass_at_k(&c, 1), 3.0 / 8.0);
        assert_eq!(pass_at_k(&[], 8), 0.0);
    }
}
