//! Problems of a run: the training stream (drawn in order, its position saved in checkpoints),
//! the held-out set, the SFT warm start and held-out evaluation.
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, ensure};
use rolloutpipe_backends::{
    AdamW, Aggregation, GenRequest, Objective, RequestKey, RolloutEngine, SamplingParams,
    TrainBatch, TrainSequence, Trainer,
};

use super::config::{Operands, TrainConfig};
use crate::tasks::{
    Problem, Split, Task, TaskOptions, Tokenizer, apply_carry_dropping_teacher, generate,
    load_jsonl_with, split_of, task_by_name, uniform_test_set,
};

/// Training problems drawn in a fixed order; `pos` is the data position of a checkpoint.
pub struct DataSource {
    problems: Vec<(Arc<Problem>, Arc<Vec<u32>>)>,
    /// Prompts drawn so far (over all steps).
    pub pos: u64,
}

impl DataSource {
    /// Tokens of the longest prompt in the pool.
    pub fn longest_prompt(&self) -> usize {
        self.problems
            .iter()
            .map(|(_, ids)| ids.len())
            .max()
            .unwrap_or(0)
    }

    /// The next problem and its prompt ids (the pool repeats in order once exhausted).
    pub fn draw(&mut self) -> (Arc<Problem>, Arc<Vec<u32>>) {
        let i = (self.pos % self.problems.len() as u64) as usize;
        self.pos += 1;
        self.problems[i].clone()
    }

    /// The next problem whose pool index `evicted` does not hold, with that index; evicted
    /// problems are passed over (their draws still advance `pos`), unless every problem is
    /// evicted, in which case the next one is drawn anyway so that a step never starves.
    pub fn draw_unevicted(
        &mut self,
        evicted: &std::collections::HashSet<usize>,
    ) -> (usize, Arc<Problem>, Arc<Vec<u32>>) {
        let n = self.problems.len();
        for _ in 0..n {
            let i = (self.pos % n as u64) as usize;
            self.pos += 1;
            if !evicted.contains(&i) {
                let (p, ids) = self.problems[i].clone();
                return (i, p, ids);
            }
        }
        let i = (self.pos % n as u64) as usize;
        self.pos += 1;
        let (p, ids) = self.problems[i].clone();
        (i, p, ids)
    }

    /// Number of distinct problems.
    pub fn len(&self) -> usize {
        self.problems.len()
    }

    /// Whether the pool is empty (never, once built).
    pub fn is_empty(&self) -> bool {
        self.problems.is_empty()
    }
}

/// The task, the training stream and the held-out set of a config.
pub struct Problems {
    /// The verifier and generator.
    pub task: Arc<dyn Task>,
    /// Training stream.
    pub train: DataSource,
    /// Held-out problems.
    pub heldout: Vec<Problem>,
    /// SFT problems (training split, their own stream).
    pub sft: Vec<Problem>,
    /// The independent test set and its description (`run.test_problems` > 0, `add`/`mul`).
    pub test: Option<(Vec<Problem>, String)>,
}

fn task_options(cfg: &TrainConfig) -> TaskOptions {
    let t = &cfg.task;
    TaskOptions {
        digits: (t.name != "countdown").then_some(t.digits),
        numbers: (t.name == "countdown").then_some(t.digits as usize),
        format_penalty: Some(t.format_penalty),
        heldout_per_mille: Some(t.heldout_per_mille),
        reverse: Some(t.reverse),
        uniform_operands: Some(t.operands == Operands::Uniform),
    }
}

/// The task (generator and verifier) of `cfg`: what a run's verifiers score with.
pub fn task(cfg: &TrainConfig) -> anyhow::Result<Arc<dyn Task>> {
    Ok(Arc::from(
        task_by_name(&cfg.task.name, &task_options(cfg)).context("task.name")?,
    ))
}

/// The tokenizer of `cfg`'s model: the model directory's `tokenizer.json` when it has one,
/// else the character tokenizer (the built-in tiny models).
pub fn tokenizer(cfg: &TrainConfig) -> anyhow::Result<Arc<dyn Tokenizer>> {
    let dir = &cfg.model.dir;
    let tj = dir.join("tokenizer.json");
    if !dir.as_os_str().is_empty() && tj.exists() {
        Ok(Arc::new(
            crate::tasks::HfTokenizer::from_path(&tj)
                .with_context(|| format!("{}", tj.display()))?,
        ))
    } else {
        Ok(Arc::new(crate::tasks::CharTokenizer))
    }
}

/// Builds the task and its problem sets, checking every prompt against the tokenizer.
pub fn problems(cfg: &TrainConfig, tok: &dyn Tokenizer) -> anyhow::Result<Problems> {
    let t = &cfg.task;
    let task = task(cfg)?;
    let (train, heldout, sft) = if t.jsonl.as_os_str().is_empty() {
        generated(cfg, &task)?
    } else {
        from_jsonl(cfg, task.as_ref())?
    };
    let mut pool = Vec::with_capacity(train.len());
    for p in train {
        let ids = tok
            .encode_prompt(&p.prompt)
            .with_context(|| format!("tokenizing prompt {:?}", p.prompt))?;
        pool.push((Arc::new(p), Arc::new(ids)));
    }
    let test = if cfg.run.test_problems > 0 && t.jsonl.as_os_str().is_empty() {
        uniform_test_set(
            &t.name,
            t.digits,
            t.reverse,
            cfg.run.test_seed,
            cfg.run.test_problems as usize,
        )?
    } else {
        None
    };
    Ok(Problems {
        test,
        task,
        train: DataSource {
            problems: pool,
            pos: 0,
        },
        heldout,
        sft,
    })
}

/// Training, held-out and SFT problems.
type Sets = (Vec<Problem>, Vec<Problem>, Vec<Problem>);

/// The generated task's problem sets.
fn generated(cfg: &TrainConfig, task: &Arc<dyn Task>) -> anyhow::Result<Sets> {
    let (t, seed) = (&cfg.task, cfg.run.seed);
    let train = generate(task.as_ref(), seed, Split::Train, t.train_pool)?;
    let held = generate(
        task.as_ref(),
        seed,
        Split::HeldOut,
        cfg.run.eval_problems as usize,
    )?;
    let n_sft = (cfg.sft.steps as usize * cfg.sft.batch as usize).max(1);
    // Another seed, same split function: different training problems, none held out. With
    // `sft.digits` < `task.digits` the warm start sees only shorter operands.
    let sft_task = if cfg.sft.digits > 0 && cfg.sft.digits != t.digits && t.name != "countdown" {
        let o = TaskOptions {
            digits: Some(cfg.sft.digits),
            ..task_options(cfg)
        };
        Arc::from(task_by_name(&t.name, &o).context("sft.digits")?)
    } else {
        task.clone()
    };
    let mut sft = generate(sft_task.as_ref(), seed ^ 0x5F7_5EED, Split::Train, n_sft)?;
    if cfg.sft.carry_drop > 0.0 {
        let wrong = apply_carry_dropping_teacher(&mut sft, cfg.sft.carry_drop, t.reverse, seed)?;
        tracing::info!(
            carry_drop = cfg.sft.carry_drop,
            wrong,
            of = sft.len(),
            "SFT targets from the carry-dropping teacher"
        );
    }
    Ok((train, held, sft))
}

/// A JSONL file's problems, split by the problem key; SFT trains on the training split.
fn from_jsonl(cfg: &TrainConfig, task: &dyn Task) -> anyhow::Result<Sets> {
    let t = &cfg.task;
    let keys = crate::tasks::JsonlKeys {
        input: t.input_key.clone(),
        label: t.label_key.clone(),
    };
    let all = load_jsonl_with(&t.jsonl, task, &keys)
        .with_context(|| format!("task.jsonl {}", t.jsonl.display()))?;
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for p in all {
        match split_of(&task.problem_key(&p), t.heldout_per_mille) {
            Split::Train => train.push(p),
            Split::HeldOut => held.push(p),
        }
    }
    ensure!(
        !train.is_empty() && !held.is_empty(),
        "task.jsonl {}: {} training and {} held-out problems; both splits need at least one",
        t.jsonl.display(),
        train.len(),
        held.len()
    );
    held.truncate(cfg.run.eval_problems as usize);
    Ok((train.clone(), held, train))
}

/// Supervised warm start: cross-entropy on `answer + eos` for `cfg.sft.steps` steps. Returns the
/// mean loss of the last step.
pub fn sft(
    cfg: &TrainConfig,
    backend: &mut dyn Trainer,
    tok: &dyn Tokenizer,
    problems: &[Problem],
) -> anyhow::Result<f64> {
    let mut opt = AdamW {
        lr: cfg.sft.lr,
        weight_decay: 0.0,
        ..AdamW::default()
    };
    let batch = cfg.sft.batch as usize;
    let mut last = f64::NAN;
    let mut it = problems.iter().cycle();
    let steps = cfg.sft.steps as usize;
    // Said at once: SFT can take a while before RL prints anything.
    tracing::info!(steps, batch, "SFT warm start");
    let bar = if cfg.run.progress {
        crate::cmd::common::progress(steps as u64, "sft")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let log_every = (steps / 10).max(1);
    for step in 0..steps {
        opt.lr = sft_lr(step, steps, cfg.sft.lr);
        let mut b = TrainBatch::default();
        for p in it.by_ref().take(batch) {
            let prompt = tok.encode_prompt(&p.prompt)?;
            let mut resp = tok.encode(&p.answer)?;
            resp.extend(tok.eos_id());
            b.sequences.push(TrainSequence::new(
                prompt,
                resp,
                0.0,
                Aggregation::TokenMean,
            ));
        }
        backend.zero_grad()?;
        let st = backend.accumulate(&b, &Objective::Sft)?;
        let norm = b.response_tokens() as f64;
        backend.optimizer_step(norm, &opt)?;
        last = st.loss_sum / norm;
        bar.inc(1);
        bar.set_message(format!("sft loss {last:.3}"));
        if !cfg.run.progress && (step + 1) % log_every == 0 {
            tracing::info!(
                step = step + 1,
                of = steps,
                loss = format_args!("{last:.3}"),
                "SFT"
            );
        }
        if crate::interrupt::requested() {
            anyhow::bail!(
                "interrupted during the SFT warm start (step {} of {steps}); no checkpoint exists yet: start the run again (with --force to reuse the directory)",
                step + 1
            );
        }
    }
    bar.finish_and_clear();
    backend.zero_grad()?;
    Ok(last)
}

/// Linear warm-up over the first 20 steps, then cosine decay to 10% of the peak: a constant
/// high rate leaves the small model oscillating around a worse loss.
fn sft_lr(step: usize, steps: usize, peak: f64) -> f64 {
    const WARMUP: usize = 20;
    if step < WARMUP.min(steps / 2) {
        return peak * (step + 1) as f64 / WARMUP.min(steps / 2).max(1) as f64;
    }
    let start = WARMUP.min(steps / 2);
    let t = (step - start) as f64 / (steps - start).max(1) as f64;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// Greedy accuracy on `problems` (all generated as one continuous batch).
pub fn evaluate(
    backend: &mut dyn RolloutEngine,
    task: &dyn Task,
    tok: &dyn Tokenizer,
    problems: &[Problem],
    max_new_tokens: usize,
) -> anyhow::Result<f64> {
    ensure!(!problems.is_empty(), "no held-out problems to evaluate");
    for (i, p) in problems.iter().enumerate() {
        let params = SamplingParams {
            temperature: 0.0,
            max_new_tokens,
            stop_tokens: tok.eos_id().into_iter().collect(),
            seed: i as u64,
            ..SamplingParams::default()
        };
        backend.add_request(GenRequest {
            id: RequestKey(i as u64),
            prompt: tok.encode_prompt(&p.prompt)?,
            params,
        })?;
    }
    let mut correct = 0usize;
    while backend.active_requests() > 0 {
        for o in backend.decode_step()? {
            let p = &problems[o.id.0 as usize];
            if super::workers::score(task, tok, p, &o.tokens).1 {
                correct += 1;
            }
        }
    }
    Ok(correct as f64 / problems.len() as f64)
}

/// Reads a text file, naming it in the error.
pub fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sft_schedule_warms_up_then_decays_to_a_tenth() {
        let peak = 1e-2;
        assert!((sft_lr(0, 100, peak) - peak / 20.0).abs() < 1e-15);
        assert!((sft_lr(19, 100, peak) - peak).abs() < 1e-15);
        assert!((sft_lr(20, 100, peak) - peak).abs() < 1e-15);
        let end = sft_lr(99, 100, peak);
        assert!(end > 0.1 * peak && end < 0.11 * peak, "{end}");
        // Short runs still warm up over half of their steps.
        assert!((sft_lr(1, 4, peak) - peak).abs() < 1e-15);
    }

    /// `task.train_pool` is the number of training problems the RL stream cycles through.
    #[test]
    fn train_pool_sets_the_training_problems_and_the_stream_cycles_them() {
        let cfg = TrainConfig::default_config()
            .unwrap()
            .with_overrides(&["task.train_pool=7".into(), "sft.steps=1".into()])
            .unwrap();
        cfg.validate().unwrap();
        let mut p = problems(&cfg, &crate::tasks::CharTokenizer).unwrap();
        assert_eq!(p.train.len(), 7);
        let first: Vec<String> = (0..7).map(|_| p.train.draw().0.prompt.clone()).collect();
        let again: Vec<String> = (0..7).map(|_| p.train.draw().0.prompt.clone()).collect();
        assert_eq!(first, again);
        assert_eq!(p.train.pos, 14);
    }
}
