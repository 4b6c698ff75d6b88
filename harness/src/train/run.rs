//! A training run's setup and teardown: model and data, SFT warm start or checkpoint, the
//! workers behind a transport, then the step loop (`step_loop`) and the run's files (trace,
//! plots, summary). The scheduler thread owns the core and the clock; time is `Tick` =
//! microseconds since the run started, read from one `Instant`.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use rolloutpipe_backends::{
    BackendInfo, CpuBackend, ModelConfig, RolloutEngine, WeightSnapshot, Weights, load_model_dir,
};
use rolloutpipe_core::{Counters, PolicyVersion};

use super::checkpoint::{CheckpointState, load_checkpoint};
use super::config::{Mode, TrainConfig};
use super::ctx::{Ctx, EngineHandle};
use super::data;
use super::guard::{self, RunOptions};
use super::metrics::{Measured, StepMetrics, TrainedRecord};
use super::plots::write_plots;
use super::summary::SummaryBase;
use super::transport::{Local, Start, Transport};
use super::workers::{EngineCmd, Event, TrainCmd, check_backend, make_trainer};
use crate::rundir::save_model;
use crate::tasks::{CharTokenizer, Problem, Task, Tokenizer};
use crate::trace::ChromeTrace;

/// What a finished run returns (the same is on disk in its directory).
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// One entry per step run by this invocation.
    pub metrics: Vec<StepMetrics>,
    /// Final weights.
    pub weights: Arc<Weights>,
    /// Every trained response.
    pub trained: Vec<TrainedRecord>,
    /// Core counters per step.
    pub counters: Vec<Counters>,
    /// Held-out accuracy of the initial model (before SFT), if SFT ran here.
    pub accuracy_initial: Option<f64>,
    /// Held-out accuracy at the start of RL (this invocation).
    pub accuracy_start: f64,
    /// Held-out accuracy at the end.
    pub accuracy_end: f64,
    /// Independent test-set accuracy before SFT, at RL start and at the end (`None` without a
    /// test set).
    pub test_accuracy: [Option<f64>; 3],
    /// Raw timings.
    pub measured: Measured,
    /// The run directory.
    pub dir: PathBuf,
}

/// Runs (or, with `resume`, continues) the training run of `cfg` in directory `out`.
pub fn run(cfg: &TrainConfig, out: &Path, resume: bool) -> anyhow::Result<RunOutcome> {
    run_with(
        cfg,
        out,
        RunOptions {
            resume,
            force: false,
        },
    )
}

/// [`run`] with every option: see [`RunOptions`].
pub fn run_with(cfg: &TrainConfig, out: &Path, opts: RunOptions) -> anyhow::Result<RunOutcome> {
    run_with_transport(cfg, out, opts, &Local)
}

/// [`run_with`] with the workers started by `transport` (in-process threads with [`Local`],
/// remote hosts with `remote::Forwarding`); the scheduler, metrics, trace and checkpoints are
/// the same whichever carries the messages.
pub fn run_with_transport(
    cfg: &TrainConfig,
    out: &Path,
    opts: RunOptions,
    transport: &dyn Transport,
) -> anyhow::Result<RunOutcome> {
    let resume = opts.resume;
    cfg.validate()?;
    // The SFT warm start trains on this machine whatever the transport.
    let here = transport.workers_here() || (!resume && cfg.sft.steps > 0);
    check_backend(&cfg.run.backend, &cfg.tensor_core_keys(), here)?;
    // Held until the run returns: a second writer of `out` is refused meanwhile.
    let _lock = guard::prepare(cfg, out, opts)?;
    let started = Instant::now();
    let ckpt_root = out.join("checkpoints");
    let latest = ckpt_root.join("latest");

    // Model and tokenizer.
    let (model_cfg, init_weights, tok): (ModelConfig, Weights, Arc<dyn Tokenizer>) =
        if cfg.model.dir.as_os_str().is_empty() {
            let tok = CharTokenizer;
            let mc = cfg.model_config(tok.vocab_size());
            mc.validate().context("model shape")?;
            let w = Weights::random(&mc, cfg.model.init_seed)?;
            (mc, w, Arc::new(tok))
        } else {
            let dir = &cfg.model.dir;
            let (mc, w) = load_model_dir(dir)
                .with_context(|| format!("loading model directory {}", dir.display()))?;
            (mc, w, data::tokenizer(cfg)?)
        };
    ensure!(
        tok.vocab_size() <= model_cfg.vocab_size,
        "the tokenizer has {} ids but the model's vocabulary is {}",
        tok.vocab_size(),
        model_cfg.vocab_size
    );
    crate::limits::check_model_fits(
        &model_cfg,
        7 + u128::from(cfg.rollout.engines),
        "the model's size",
    )?;
    let mut problems = data::problems(cfg, tok.as_ref())?;
    check_positions(cfg, &problems, tok.as_ref(), &model_cfg)?;
    if !resume {
        // Only once the model and the problems are known good: a start that fails on its
        // inputs leaves nothing behind, so the same --out can be used again without --force.
        guard::write_config(cfg, out)?;
    }
    let task: Arc<dyn Task> = problems.task.clone();
    let max_new = cfg.rl.max_new_tokens;
    let mut eval_backend = CpuBackend::new(&model_cfg, &init_weights, cfg.trainer.threads)?;
    let eval = |be: &mut CpuBackend, w: &Weights, held: &[Problem]| -> anyhow::Result<f64> {
        let snap = WeightSnapshot::host(be.config(), w, be.weight_dtype())?;
        be.load_weights(&snap)?;
        data::evaluate(be, task.as_ref(), tok.as_ref(), held, max_new)
    };

    // Starting point: a checkpoint, or SFT from the initial weights.
    let mut state = CheckpointState {
        next_step: 0,
        data_pos: 0,
        seed: cfg.run.seed,
        engine_version: 0,
        pending: Vec::new(),
        pending_step: None,
        evicted: Vec::new(),
        filter: None,
    };
    let mut accuracy_initial = None;
    let mut test_initial = None;
    // The independent test set (uniform operands from their own seed, beside the held-out split,
    // which follows the training generator), evaluated wherever the held-out set is.
    let test_eval = |be: &mut CpuBackend, w: &Weights| -> anyhow::Result<Option<f64>> {
        match &problems.test {
            Some((t, _)) => Ok(Some(eval(be, w, t)?)),
            None => Ok(None),
        }
    };
    let (weights, adam, reference) = if resume {
        let name = data::read(&latest).context("the run has no checkpoint to resume from")?;
        let dir = ckpt_root.join(name.trim());
        let (w, st, adam) = load_checkpoint(&dir, &model_cfg)
            .with_context(|| format!("loading checkpoint {}", dir.display()))?;
        ensure!(
            st.seed == cfg.run.seed,
            "checkpoint seed {} differs from run.seed {}",
            st.seed,
            cfg.run.seed
        );
        let last_phase = cfg.run.steps as u64 - u64::from(cfg.run.mode != Mode::OneStepOff);
        ensure!(
            st.next_step <= last_phase,
            "the checkpoint is already at step {} of run.steps = {}; raise run.steps (--set run.steps=N) to continue",
            st.next_step,
            cfg.run.steps
        );
        state = st;
        // Every resume check has passed: only now may the run's config change.
        guard::write_config(cfg, out)?;
        let reference = if cfg.rl.beta > 0.0 {
            Some(load_model_dir(&out.join("reference"))?.1)
        } else {
            None
        };
        tracing::info!(step = state.next_step, dir = %dir.display(), "resuming");
        (w, adam, reference)
    } else {
        let mut w = init_weights;
        if cfg.sft.steps > 0 {
            let mut be = make_trainer(
                &cfg.run.backend,
                &model_cfg,
                &w,
                cfg.trainer.threads,
                cfg.trainer.tensor_cores,
            )?;
            accuracy_initial = Some(eval(&mut eval_backend, &w, &problems.heldout)?);
            test_initial = test_eval(&mut eval_backend, &w)?;
            let t = Instant::now();
            let loss = data::sft(cfg, be.as_dyn(), tok.as_ref(), &problems.sft)?;
            w = be.as_dyn().export_weights()?;
            tracing::info!(
                steps = cfg.sft.steps,
                loss,
                secs = t.elapsed().as_secs_f64(),
                "SFT warm start done"
            );
            save_model(&out.join("sft"), &model_cfg, &w, tok_src(cfg))?;
        }
        let reference = if cfg.rl.beta > 0.0 {
            save_model(&out.join("reference"), &model_cfg, &w, tok_src(cfg))?;
            Some(w.clone())
        } else {
            None
        };
        (w, None, reference)
    };
    problems.train.pos = state.data_pos;
    let weights = Arc::new(weights);
    let accuracy_start = eval(&mut eval_backend, &weights, &problems.heldout)?;
    let test_start = test_eval(&mut eval_backend, &weights)?;
    tracing::info!(accuracy = accuracy_start, initial = ?accuracy_initial, test = ?test_start, "held-out accuracy at RL start");

    // Workers, behind the transport's channels.
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let workers = transport.start(Start {
        cfg,
        model_cfg: &model_cfg,
        weights: &weights,
        adam,
        reference: reference.as_ref(),
        task: task.clone(),
        tok: tok.clone(),
        events: ev_tx,
    })?;
    let handles = workers.handles;
    let engines = workers
        .engines
        .into_iter()
        .map(|l| EngineHandle::new(l.target, l.tx))
        .collect();
    let (vtx, ttx) = (workers.verify, workers.trainer);

    let mut ctx = Ctx {
        cfg,
        clock: Instant::now(),
        events: ev_rx,
        engines,
        verify: Some(vtx),
        trainer: ttx,
        data: problems.train,
        trace: ChromeTrace::new(),
        measured: Measured {
            slots: cfg.rollout.slots,
            engines: cfg.rollout.engines,
            ..Measured::default()
        },
        busy: Vec::new(),
        engine_busy: Vec::new(),
        trained: Vec::new(),
        timeline: None,
        model_cfg: model_cfg.clone(),
        tok: tok.clone(),
        trace_base: if resume {
            crate::trace::read_events(&out.join("trace.json"))
        } else {
            (Vec::new(), 0.0)
        },
        summary: SummaryBase::read(out, resume, started),
        interrupted: None,
        policy: cfg.alloc_policy()?,
        evicted: state.evicted.iter().copied().collect(),
    };
    ctx.trace_header();
    ctx.summary.accuracy_initial = ctx.summary.accuracy_initial.or(accuracy_initial);
    ctx.summary.accuracy_start = ctx.summary.accuracy_start.or(Some(accuracy_start));
    ctx.summary.test_accuracy_initial = ctx.summary.test_accuracy_initial.or(test_initial);
    ctx.summary.test_accuracy_start = ctx.summary.test_accuracy_start.or(test_start);
    if ctx.summary.test_distribution.is_none() {
        ctx.summary.test_distribution = problems.test.as_ref().map(|(_, d)| d.clone());
    }
    // Engines were built with these weights; tell them the version.
    ctx.sync_engines(weights.clone(), PolicyVersion(state.engine_version))?;

    let result = ctx.run_steps(
        &mut state,
        out,
        &mut eval_backend,
        &problems.heldout,
        &eval,
        &test_eval,
        started,
    );
    // Stop the workers whatever happened, so no thread outlives the run.
    for e in &ctx.engines {
        let _ = e.tx.send(EngineCmd::Shutdown);
    }
    let _ = ctx.trainer.send(TrainCmd::Shutdown);
    ctx.verify = None;
    let (metrics, counters, final_w, acc_end, test_end) = result?;
    for h in handles {
        let _ = h.join();
    }
    ctx.write_trace(out)?;
    write_plots(out, &metrics, ctx.timeline.as_ref())?;
    let accuracy_end = acc_end;
    ctx.summary.write(
        out,
        Some(accuracy_end).filter(|a| a.is_finite()),
        test_end,
        ctx.interrupted.is_none(),
    )?;
    if let Some(next) = ctx.interrupted {
        bail!(
            "interrupted: stopped after step {} with a checkpoint, the trace and the summary written; continue with: rolloutpipe train --resume {}",
            next.saturating_sub(1),
            out.display()
        );
    }
    tracing::info!(
        start = accuracy_start,
        end = accuracy_end,
        "held-out accuracy"
    );
    Ok(RunOutcome {
        metrics,
        weights: final_w,
        trained: std::mem::take(&mut ctx.trained),
        counters,
        accuracy_initial,
        accuracy_start,
        accuracy_end,
        test_accuracy: [test_initial, test_start, test_end],
        measured: std::mem::take(&mut ctx.measured),
        dir: out.to_path_buf(),
    })
}

/// Refuses `rl.max_new_tokens` (and SFT answers) that, after the longest prompt, would run
/// past the model's position limit: found here, before any SFT or RL step runs.
fn check_positions(
    cfg: &TrainConfig,
    problems: &data::Problems,
    tok: &dyn Tokenizer,
    mc: &ModelConfig,
) -> anyhow::Result<()> {
    let limit = mc.max_position_embeddings;
    let mut longest = problems.train.longest_prompt();
    for p in &problems.heldout {
        longest = longest.max(tok.encode_prompt(&p.prompt)?.len());
    }
    ensure!(
        longest + cfg.rl.max_new_tokens <= limit,
        "rl.max_new_tokens = {} after the longest prompt ({longest} tokens) exceeds the model's position limit max_position_embeddings = {limit}; lower it to at most {}",
        cfg.rl.max_new_tokens,
        limit.saturating_sub(longest)
    );
    Ok(())
}

/// The model directory whose tokenizer files every model directory of the run carries.
pub(super) fn tok_src(cfg: &TrainConfig) -> Option<&Path> {
    Some(cfg.model.dir.as_path()).filter(|d| !d.as_os_str().is_empty())
}
