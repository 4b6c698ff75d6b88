//! A training run: setup (`setup`: the model, the evaluator, a checkpoint or the SFT warm
//! start), the workers behind a transport, the step loop (`steps`: one phase per step through
//! the step driver, `phase`, then the step boundary) and the run's files (trace, plots,
//! summary). The scheduler thread owns the core and the clock; time is `Tick` = microseconds
//! since the workers started, read from one `Instant` (`ctx`).
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::bail;
use rolloutpipe_backends::Weights;
use rolloutpipe_core::{Counters, PolicyVersion};

use super::config::TrainConfig;
use super::data;
use super::guard::{self, RunOptions};
use super::msg::{EngineCmd, Event, TrainCmd};
use super::record::metrics::{Measured, StepMetrics, TrainedRecord};
use super::record::plots::write_plots;
use super::workers::check_backend;
use super::workers::transport::{Local, Start, Transport};

mod ctx;
mod events;
mod migrate;
mod mux;
pub(crate) mod phase;
pub(crate) mod setup;
mod steps;

use ctx::Ctx;
use setup::{Evaluator, StartPoint, check_positions, fresh_point, load_model, resume_point};

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
    let model = load_model(cfg)?;
    let mut problems = data::problems(cfg, model.tok.as_ref())?;
    check_positions(cfg, &problems, model.tok.as_ref(), &model.cfg)?;
    if !resume {
        // Only once the model and the problems are known good: a start that fails on its
        // inputs leaves nothing behind, so the same --out can be used again without --force.
        guard::write_config(cfg, out)?;
    }
    let (test, distribution) = problems.test.take().unzip();
    let heldout = std::mem::take(&mut problems.heldout);
    let mut eval = Evaluator::new(cfg, &model, problems.task.clone(), heldout, test)?;
    let (model_cfg, tok) = (model.cfg.clone(), model.tok.clone());
    let mut start = if resume {
        resume_point(cfg, out, &model_cfg)?
    } else {
        fresh_point(cfg, out, model, &mut eval, &problems.sft)?
    };
    problems.train.pos = start.state.data_pos;
    let weights = Arc::new(std::mem::take(&mut start.weights));
    let accuracy_start = eval.heldout(&weights)?;
    let test_start = eval.test(&weights)?;
    tracing::info!(accuracy = accuracy_start, initial = ?start.accuracy_initial, test = ?test_start, "held-out accuracy at RL start");

    // Workers, behind the transport's channels.
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let mut links = transport.start(Start {
        cfg,
        model_cfg: &model_cfg,
        weights: &weights,
        adam: start.adam.take(),
        reference: start.reference.as_ref(),
        task: problems.task.clone(),
        tok: tok.clone(),
        events: ev_tx,
    })?;
    let handles = std::mem::take(&mut links.handles);
    let parts = ctx::Parts {
        events: ev_rx,
        links,
        data: problems.train,
        model_cfg,
        tok,
    };
    let mut ctx = Ctx::new(cfg, out, resume, started, parts, &start.state)?;
    ctx.summary.begin(
        [start.accuracy_initial, Some(accuracy_start)],
        [start.test_initial, test_start],
        distribution,
    );
    // Engines were built with these weights; tell them the version.
    ctx.sync_engines(weights.clone(), PolicyVersion(start.state.engine_version))?;

    let result = ctx.run_steps(&mut start.state, out, &mut eval, started);
    // Stop the workers whatever happened, so no thread outlives the run.
    for e in &ctx.engines {
        let _ = e.tx.send(EngineCmd::Shutdown);
    }
    let _ = ctx.trainer.send(TrainCmd::Shutdown);
    ctx.verify = None;
    let ended = result?;
    for h in handles {
        let _ = h.join();
    }
    finish(ctx, out, ended, &start, accuracy_start, test_start)
}

/// Writes the trace, the plots and the summary, and what the run returns.
fn finish(
    mut ctx: Ctx<'_>,
    out: &Path,
    ended: steps::Ended,
    start: &StartPoint,
    accuracy_start: f64,
    test_start: Option<f64>,
) -> anyhow::Result<RunOutcome> {
    ctx.write_trace(out)?;
    write_plots(out, &ended.metrics, ctx.timeline.as_ref())?;
    let accuracy_end = ended.accuracy;
    ctx.summary.write(
        out,
        Some(accuracy_end).filter(|a| a.is_finite()),
        ended.test_accuracy,
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
        metrics: ended.metrics,
        weights: ended.weights,
        trained: std::mem::take(&mut ctx.trained),
        counters: ended.counters,
        accuracy_initial: start.accuracy_initial,
        accuracy_start,
        accuracy_end,
        test_accuracy: [start.test_initial, test_start, ended.test_accuracy],
        measured: std::mem::take(&mut ctx.measured),
        dir: out.to_path_buf(),
    })
}
