//! The scheduler thread: owns the core and the clock, moves data between the workers, and
//! records metrics, the trace, plots and checkpoints of a run.
//!
//! Each step is one loop: ask the core what to do (draw, abort, admit, dispatch, micro-batch,
//! optimizer step), tell the workers, then wait for one event and report it to the core. Time
//! is `Tick` = microseconds since the run started, read from one `Instant`.
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, BackendInfo, CpuBackend, ModelConfig, RolloutEngine, SamplingParams, SyncTarget,
    Tensor, WeightSnapshot, Weights, load_model_dir,
};
use rolloutpipe_core::{
    Allocated, Allocation, Counters, GroupId, GroupSlot, GroupState, PolicyVersion, RequestId,
    RequestSlot, Scheduler, SkipReason, StepId, Tick,
};
use serde::{Deserialize, Serialize};

use super::config::{Mode, TrainConfig};
use super::data::{self, DataSource};
use super::guard::{self, RunOptions};
use super::transport::{Local, Start, Transport};
use super::workers::{
    EngineCmd, Event, GroupBatch, Sample, TrainCmd, TrainerReply, VerifyJob, check_backend,
    make_trainer,
};
use crate::plot::{self, GanttRow, Series, Span};
use crate::rundir::save_model;
use crate::tasks::{CharTokenizer, Problem, Task, Tokenizer};
use crate::trace::ChromeTrace;

/// One line of `metrics.jsonl`: what step `step` did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Step.
    pub step: u64,
    /// Mode.
    pub mode: String,
    /// Weights version of its rollout.
    pub rollout_version: u64,
    /// Mean reward of every scored response of the step.
    pub reward: f64,
    /// Share of the step's responses verified correct.
    pub train_accuracy: f64,
    /// Greedy held-out accuracy after the step (evaluation steps only).
    pub heldout_accuracy: Option<f64>,
    /// Greedy accuracy on the independent test set (`run.test_problems`) after the step
    /// (evaluation steps only).
    #[serde(default)]
    pub test_accuracy: Option<f64>,
    /// Normalised loss of the step's optimizer steps (mean).
    pub loss: f64,
    /// Mean k3 KL per token (0 without a reference).
    pub kl: f64,
    /// Mean entropy per token.
    pub entropy: f64,
    /// Pre-clip gradient norm (last optimizer step).
    pub grad_norm: f64,
    /// Share of tokens whose ratio was clipped.
    pub clip_fraction: f64,
    /// Rollout start to batch final, s.
    pub rollout_s: f64,
    /// Rollout start to train end, s (headline metric 1).
    pub rollout_to_train_end_s: f64,
    /// Trainer wait / (wait + busy) inside that window (headline metric 2).
    pub trainer_wait_ratio: f64,
    /// Ideal bound `T_rollout + T_train(last micro-batch)`, s.
    pub ideal_s: f64,
    /// Trainer busy time on this step's batch, s.
    pub train_busy_s: f64,
    /// Weight sync after the step, s.
    pub sync_s: f64,
    /// Response tokens generated (aborted and discarded included).
    pub tokens: u64,
    /// Generated tokens per second of rollout.
    pub tokens_per_s: f64,
    /// Prompts drawn.
    pub drawn: u32,
    /// Groups trained.
    pub trained: u32,
    /// Groups filtered (all reasons).
    pub filtered: u32,
    /// Groups aborted.
    pub aborted: u32,
    /// Requests that failed and were re-admitted or filtered.
    pub requests_failed: u64,
    /// Rollouts (responses generated to the end, whatever then became of their group) this
    /// step; aborted requests are not counted (their tokens are in `tokens`).
    #[serde(default)]
    pub rollouts: u64,
    /// Rollouts of every step so far, this one included (across resumptions).
    #[serde(default)]
    pub rollouts_cum: u64,
    /// Groups the allocation policy extended (VIGOR's extra rounds, Pilot-Commit's commits).
    #[serde(default)]
    pub extended: u32,
    /// Groups the allocation policy skipped (Pilot-Commit: too easy, solved or too hard).
    #[serde(default)]
    pub skipped: u32,
    /// Seconds since the run (or its resumption) started.
    pub elapsed_s: f64,
}

/// One trained response: which step trained it and which weights generated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainedRecord {
    /// The step whose optimizer step(s) it fed (its trainer held `v_step` when it started).
    pub step: u64,
    /// Rollout step that generated it.
    pub rollout_step: u64,
    /// Group id within that rollout step.
    pub group: u32,
    /// Sample index.
    pub sample: u16,
    /// The weights version that generated it.
    pub version: u64,
}

/// Raw timings for `compare` and the simulator calibration.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Measured {
    /// Decode iterations: (running requests, seconds).
    pub decode: Vec<(u32, f64)>,
    /// Verifier latency per response, s.
    pub verify_s: Vec<f64>,
    /// Micro-batches: (response tokens, prompt+response tokens, seconds).
    pub micro_batches: Vec<(usize, usize, f64)>,
    /// Optimizer steps, s.
    pub opt_s: Vec<f64>,
    /// Weight syncs, s.
    pub sync_s: Vec<f64>,
    /// Prompt lengths, tokens.
    pub prompt_tokens: Vec<u32>,
    /// Response lengths, tokens.
    pub response_tokens: Vec<u32>,
    /// Responses per engine slot (S) and engines (E) of the run.
    pub slots: u32,
    /// Engines.
    pub engines: u16,
}

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

/// Saved in each checkpoint beside the weights and optimizer moments.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CheckpointState {
    /// First step the resumed run executes.
    next_step: u64,
    /// Prompts drawn so far.
    data_pos: u64,
    /// The run's seed (per-request sampling seeds are a pure function of it and the request).
    seed: u64,
    /// Weights version the rollout engines hold.
    engine_version: u64,
    /// One-step-off: the rolled-out batch not trained yet, with its optimizer-step marks.
    pending: Vec<(Vec<SavedGroup>, bool)>,
    /// One-step-off: the step that pending batch belongs to.
    pending_step: Option<u64>,
    /// Pool indices of problems evicted from later epochs (Pilot-Commit's solved prompts).
    #[serde(default)]
    evicted: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedGroup {
    step: u64,
    group: u32,
    prompt: Vec<u32>,
    samples: Vec<SavedSample>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedSample {
    sample: u16,
    attempt: u8,
    version: u64,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    reward: f32,
    correct: bool,
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
    check_backend(&cfg.run.backend)?;
    // Held until the run returns: a second writer of `out` is refused meanwhile.
    let _lock = guard::prepare(cfg, out, opts)?;
    let started = Instant::now();
    let ckpt_root = out.join("checkpoints");
    let latest = ckpt_root.join("latest");
    if !resume {
        guard::write_config(cfg, out)?;
    }

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
            let mut be = make_trainer(&cfg.run.backend, &model_cfg, &w, cfg.trainer.threads)?;
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
        .map(|l| EngineHandle {
            target: l.target,
            tx: l.tx,
            live: true,
            running: 0,
        })
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

struct EngineHandle {
    /// The device and dtype its weight snapshots are made for; `None`: it is sent the master
    /// weights (a remote engine converts them itself).
    target: Option<SyncTarget>,
    tx: Sender<EngineCmd>,
    live: bool,
    running: u32,
}

/// What the trainer is doing for the scheduler.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Busy {
    Idle,
    /// A micro-batch of the core's current step.
    CoreMb,
    /// The core's optimizer step.
    CoreOpt,
    /// One-step-off: a micro-batch of the previous step's batch, then an optimizer step?
    PrevMb {
        ends_opt: bool,
    },
    /// One-step-off: the previous batch's optimizer step.
    PrevOpt,
}

/// Training results of one step's batch.
#[derive(Debug, Default, Clone)]
struct TrainAgg {
    accum: AccumStats,
    loss_sum: f64,
    opt_steps: u32,
    grad_norm: f64,
    busy_s: f64,
    last_mb_s: f64,
    end: Option<Instant>,
}

impl TrainAgg {
    fn on_mb(&mut self, s: f64) {
        self.busy_s += s;
        self.last_mb_s = s;
    }
    fn on_opt(&mut self, accum: &AccumStats, norm: f64, grad_norm: f64, s: f64, end: Instant) {
        self.accum.merge(accum);
        self.loss_sum += accum.loss_sum / norm;
        self.opt_steps += 1;
        self.grad_norm = grad_norm;
        self.busy_s += s;
        self.last_mb_s += s;
        self.end = Some(end);
    }
}

struct GroupRec {
    /// The problem's index in the training pool (for eviction).
    index: usize,
    prompt: Arc<Vec<u32>>,
    problem: Arc<Problem>,
    samples: Vec<Option<Sample>>,
}

/// The rollout of one step, as seen from the scheduler thread.
struct Rollout {
    step: u64,
    version: PolicyVersion,
    start: Instant,
    groups: HashMap<GroupId, GroupRec>,
    inflight: HashMap<RequestId, (u16, Instant)>,
    generated: HashMap<RequestId, Sample>,
    rewards: (f64, u64, u64),
    tokens: u64,
    spans: Vec<(u16, f64, f64)>,
    group_done: Vec<f64>,
    /// Groups the allocation policy extended.
    extended: u32,
}

struct Ctx<'c> {
    cfg: &'c TrainConfig,
    clock: Instant,
    events: Receiver<Event>,
    engines: Vec<EngineHandle>,
    verify: Option<Sender<VerifyJob>>,
    trainer: Sender<TrainCmd>,
    data: DataSource,
    trace: ChromeTrace,
    measured: Measured,
    busy: Vec<(Instant, Instant)>,
    trained: Vec<TrainedRecord>,
    timeline: Option<Vec<GanttRow>>,
    model_cfg: ModelConfig,
    tok: Arc<dyn Tokenizer>,
    /// An earlier invocation's trace events and the offset this one's are placed at.
    trace_base: (Vec<serde_json::Value>, f64),
    /// What `summary.json` carries over from earlier invocations and the start of this one.
    summary: SummaryBase,
    /// Set when a signal stopped the run: the step a resume continues at.
    interrupted: Option<u64>,
    /// The `[alloc]` policy: how many samples each prompt gets.
    policy: crate::alloc::Policy,
    /// Pool indices of problems evicted from later epochs.
    evicted: HashSet<usize>,
}

/// `summary.json` across invocations: accuracies of the run's start come from the first
/// invocation, wall time and invocations add up, steps count every line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SummaryBase {
    accuracy_initial: Option<f64>,
    accuracy_start: Option<f64>,
    test_distribution: Option<String>,
    test_accuracy_initial: Option<f64>,
    test_accuracy_start: Option<f64>,
    /// Wall time of earlier invocations, s.
    wall_s_before: f64,
    invocations: u32,
    #[serde(skip)]
    started: Option<Instant>,
}

impl SummaryBase {
    fn read(out: &Path, resume: bool, started: Instant) -> Self {
        let old: Option<serde_json::Value> = resume
            .then(|| std::fs::read_to_string(out.join("summary.json")).ok())
            .flatten()
            .and_then(|t| serde_json::from_str(&t).ok());
        let f = |k: &str| old.as_ref().and_then(|v| v.get(k)?.as_f64());
        SummaryBase {
            accuracy_initial: f("accuracy_initial"),
            accuracy_start: f("accuracy_start"),
            test_distribution: old
                .as_ref()
                .and_then(|v| v.get("test_distribution")?.as_str().map(String::from)),
            test_accuracy_initial: f("test_accuracy_initial"),
            test_accuracy_start: f("test_accuracy_start"),
            wall_s_before: f("wall_s").unwrap_or(0.0),
            invocations: f("invocations").unwrap_or(0.0) as u32 + 1,
            started: Some(started),
        }
    }

    fn write(
        &self,
        out: &Path,
        accuracy_end: Option<f64>,
        test_end: Option<f64>,
        complete: bool,
    ) -> anyhow::Result<()> {
        let steps = read_metrics(out).map(|m| m.len()).unwrap_or(0);
        let wall = self.wall_s_before + self.started.map_or(0.0, |s| s.elapsed().as_secs_f64());
        let v = serde_json::json!({
            "accuracy_initial": self.accuracy_initial,
            "accuracy_start": self.accuracy_start,
            "accuracy_end": accuracy_end,
            "test_distribution": self.test_distribution,
            "test_accuracy_initial": self.test_accuracy_initial,
            "test_accuracy_start": self.test_accuracy_start,
            "test_accuracy_end": test_end,
            "steps": steps,
            "wall_s": wall,
            "invocations": self.invocations,
            "complete": complete,
        });
        let (p, tmp) = (out.join("summary.json"), out.join(".summary.json.tmp"));
        std::fs::write(&tmp, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
    }
}

type EvalFn<'a> = dyn Fn(&mut CpuBackend, &Weights, &[Problem]) -> anyhow::Result<f64> + 'a;
/// Accuracy on the run's independent test set, `None` when it has none.
type TestEvalFn<'a> = dyn Fn(&mut CpuBackend, &Weights) -> anyhow::Result<Option<f64>> + 'a;
type StepsResult = (
    Vec<StepMetrics>,
    Vec<Counters>,
    Arc<Weights>,
    f64,
    Option<f64>,
);

const PID_ENGINES: u32 = 1;
const PID_TRAINER: u32 = 2;
const PID_GROUPS: u32 = 3;

impl Ctx<'_> {
    /// Writes `trace.json`: earlier invocations' events, then this one's.
    fn write_trace(&self, out: &Path) -> anyhow::Result<()> {
        let (base, offset) = &self.trace_base;
        self.trace
            .write_merged(&out.join("trace.json"), base, *offset)
    }

    fn now(&self) -> Tick {
        Tick(self.clock.elapsed().as_micros() as u64)
    }

    fn us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.clock).as_secs_f64() * 1e6
    }

    fn trace_header(&mut self) {
        self.trace.process(PID_ENGINES, "rollout engines");
        for e in 0..self.engines.len() {
            self.trace
                .thread(PID_ENGINES, e as u32, &format!("engine {e}"));
        }
        self.trace.process(PID_TRAINER, "trainer");
        self.trace.thread(PID_TRAINER, 0, "trainer");
        self.trace.process(PID_GROUPS, "groups");
    }

    fn recv(&self) -> anyhow::Result<Option<Event>> {
        match self.events.recv_timeout(Duration::from_millis(200)) {
            Ok(Event::Fatal(msg)) => bail!("{msg}"),
            Ok(e) => Ok(Some(e)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => bail!("every worker thread stopped"),
        }
    }

    /// The error for a worker whose channel closed: the worker's own fatal message when it
    /// sent one before stopping, so the cause is not lost behind "stopped".
    fn worker_stopped(&self, who: &str) -> anyhow::Error {
        for ev in self.events.try_iter() {
            if let Event::Fatal(msg) = ev {
                return anyhow::anyhow!("{who} stopped: {msg}");
            }
        }
        anyhow::anyhow!("{who} stopped without reporting an error")
    }

    fn send_trainer(&self, cmd: TrainCmd) -> anyhow::Result<()> {
        self.trainer
            .send(cmd)
            .map_err(|_| self.worker_stopped("the trainer thread"))
    }

    /// Exports the trainer's weights, and its moments when `optimizer` (checkpoints only).
    fn export(&mut self, optimizer: bool) -> anyhow::Result<(Arc<Weights>, Option<AdamState>)> {
        self.send_trainer(TrainCmd::Export { optimizer })?;
        loop {
            if let Some(Event::Trainer(TrainerReply::Exported(w, a))) = self.recv()? {
                return Ok((w, a));
            }
        }
    }

    /// Weight sync: every live engine imports `w` as version `v`; returns seconds taken.
    fn sync_engines(&mut self, w: Arc<Weights>, v: PolicyVersion) -> anyhow::Result<f64> {
        let t = Instant::now();
        let mut waiting = 0;
        // Engines run in their own threads on their own devices, so they load host snapshots,
        // one per engine dtype, converted once here.
        // Remote engines are sent the master weights (`target` None), serialised once for all.
        let mut snaps: Vec<(SyncTarget, Arc<WeightSnapshot>)> = Vec::new();
        for e in self.engines.iter().filter(|e| e.live) {
            let snap = match e.target {
                None => None,
                Some(target) => Some(match snaps.iter().find(|(t, _)| t.dtype == target.dtype) {
                    Some((_, s)) => s.clone(),
                    None => {
                        let s = Arc::new(WeightSnapshot::host(&self.model_cfg, &w, target.dtype)?);
                        snaps.push((target, s.clone()));
                        s
                    }
                }),
            };
            let cmd = EngineCmd::Sync {
                snap,
                master: w.clone(),
                version: v,
            };
            if e.tx.send(cmd).is_ok() {
                waiting += 1;
            }
        }
        while waiting > 0 {
            match self.recv()? {
                Some(Event::Synced { decode, .. }) => {
                    self.measured.decode.extend(decode);
                    waiting -= 1;
                }
                // Late rewards of aborted groups and failures of idle engines change nothing.
                Some(Event::EngineFailed { .. } | Event::Rewarded { .. }) | None => {}
                Some(_) => bail!("unexpected event during weight sync"),
            }
        }
        let s = t.elapsed().as_secs_f64();
        let now = self.us(Instant::now());
        self.trace.complete(
            "weight sync",
            "sync",
            PID_TRAINER,
            0,
            now - s * 1e6,
            s * 1e6,
            serde_json::json!({"version": v.0}),
        );
        Ok(s)
    }

    fn sampling(&self, rid: RequestId) -> SamplingParams {
        let rl = &self.cfg.rl;
        // A pure function of the seed and the request, so a resumed run samples the same.
        let seed = mix(&[
            self.cfg.run.seed,
            rid.step.0,
            rid.group.0 as u64,
            rid.sample as u64,
            rid.attempt as u64,
        ]);
        SamplingParams {
            temperature: rl.temperature,
            top_k: rl.top_k,
            top_p: rl.top_p,
            max_new_tokens: rl.max_new_tokens,
            stop_tokens: self.tok.eos_id().into_iter().collect(),
            seed,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_steps(
        &mut self,
        state: &mut CheckpointState,
        out: &Path,
        eval_be: &mut CpuBackend,
        heldout: &[Problem],
        eval: &EvalFn<'_>,
        test_eval: &TestEvalFn<'_>,
        started: Instant,
    ) -> anyhow::Result<StepsResult> {
        let cfg = self.cfg;
        let plan = cfg.plan();
        let groups_cap = plan.max_groups as usize;
        let mut gslots = vec![GroupSlot::EMPTY; groups_cap];
        let mut rslots = vec![RequestSlot::EMPTY; cfg.alloc.request_capacity(&self.policy, &plan)];
        let mut sched = Scheduler::new(&mut gslots, &mut rslots);
        let one_off = cfg.run.mode == Mode::OneStepOff;
        let steps = cfg.run.steps as u64;
        // One-step-off's checkpoint precedes the training of its pending batch, so that step's
        // line (written by the stopped run's final drain) is redone too.
        let redo_from = state
            .pending_step
            .unwrap_or(state.next_step)
            .min(state.next_step);
        // The boundary step's rollout half (reward, tokens, counts) was measured by the stopped
        // run; only its training is redone, so keep those fields instead of zeros.
        let boundary: Option<StepMetrics> = state.pending_step.and_then(|s| {
            read_metrics(out)
                .ok()?
                .into_iter()
                .rev()
                .find(|m| m.step == s)
        });
        // Rollouts before the first step this invocation (re)writes.
        let mut rollouts_cum = read_metrics(out)
            .ok()
            .and_then(|ms| ms.iter().rev().find(|m| m.step < redo_from).cloned())
            .map_or(0, |m| m.rollouts_cum);
        let mut metrics_file = open_metrics(out, redo_from)?;
        let bar = progress_bar(cfg, steps, state.next_step);
        let mut metrics = Vec::new();
        let mut counters = Vec::new();
        let mut weights: Option<Arc<Weights>> = None;
        let mut acc_end = f64::NAN;
        let mut test_end = None;
        // One-step-off: the previous rollout's batch and its half-filled metrics.
        let mut pending: VecDeque<(Vec<GroupBatch>, bool)> = state
            .pending
            .drain(..)
            .map(|(gs, e)| (gs.into_iter().map(restore_group).collect(), e))
            .collect();
        let mut pending_metrics: Option<(StepMetrics, Instant)> = state.pending_step.map(|s| {
            let m = match boundary {
                Some(m) => StepMetrics {
                    heldout_accuracy: None,
                    ..m
                },
                None => StepMetrics {
                    step: s,
                    mode: cfg.run.mode.name().into(),
                    ..Default::default()
                },
            };
            (m, Instant::now())
        });
        let mut engine_version = PolicyVersion(state.engine_version);
        let last_phase = if one_off { steps } else { steps - 1 };
        for k in state.next_step..=last_phase {
            let rollout_this = k < steps;
            let phase_start = Instant::now();
            let mut ro = Rollout {
                step: k,
                version: engine_version,
                start: phase_start,
                groups: HashMap::new(),
                inflight: HashMap::new(),
                generated: HashMap::new(),
                rewards: (0.0, 0, 0),
                tokens: 0,
                spans: Vec::new(),
                group_done: Vec::new(),
                extended: 0,
            };
            if rollout_this {
                sched
                    .begin_step(self.now(), StepId(k), engine_version, plan)
                    .map_err(|e| anyhow::anyhow!("begin {k}: {e}"))?;
            }
            let mut cur = TrainAgg::default();
            let mut prev = TrainAgg::default();
            let mut buffer: Vec<(Vec<GroupBatch>, bool)> = Vec::new();
            let mut busy = Busy::Idle;
            let mut dispatched: Vec<GroupBatch> = Vec::new();
            loop {
                let now = self.now();
                if rollout_this {
                    self.decide(&mut sched, &mut ro, &mut dispatched, now)?;
                    if one_off {
                        while let Some(mb) = sched.poll_micro_batch(now) {
                            let groups = dispatched
                                [mb.first_seq as usize..(mb.first_seq + mb.len) as usize]
                                .to_vec();
                            let c = sched
                                .on_micro_batch_consumed(now)
                                .map_err(|e| anyhow::anyhow!("{e}"))?;
                            buffer.push((groups, c.ends_optimizer_step));
                        }
                        if sched.poll_optimizer_step(now).is_some() {
                            sched
                                .on_optimizer_step_done(now)
                                .map_err(|e| anyhow::anyhow!("{e}"))?;
                            if let Some(last) = buffer.last_mut() {
                                last.1 = true;
                            }
                        }
                    }
                }
                if busy == Busy::Idle {
                    if one_off {
                        if let Some((groups, ends_opt)) = pending.pop_front() {
                            self.record_trained(&groups, k.saturating_sub(1));
                            self.send_trainer(TrainCmd::MicroBatch(groups))?;
                            busy = Busy::PrevMb { ends_opt };
                        }
                    } else if rollout_this && sched.poll_optimizer_step(now).is_some() {
                        self.send_trainer(TrainCmd::OptStep)?;
                        busy = Busy::CoreOpt;
                    } else if rollout_this && let Some(mb) = sched.poll_micro_batch(now) {
                        let groups = dispatched
                            [mb.first_seq as usize..(mb.first_seq + mb.len) as usize]
                            .to_vec();
                        self.record_trained(&groups, k);
                        self.send_trainer(TrainCmd::MicroBatch(groups))?;
                        busy = Busy::CoreMb;
                    }
                }
                let rollout_done = !rollout_this || sched.poll_step_done().is_some();
                if rollout_done && busy == Busy::Idle && pending.is_empty() {
                    break;
                }
                let Some(ev) = self.recv()? else {
                    continue;
                };
                let now = self.now();
                match ev {
                    Event::Trainer(r) => match (r, busy) {
                        (
                            TrainerReply::MicroBatchDone {
                                started,
                                ended,
                                tokens,
                                all_tokens,
                                ..
                            },
                            b,
                        ) => {
                            let s = (ended - started).as_secs_f64();
                            self.busy.push((started, ended));
                            self.measured.micro_batches.push((tokens, all_tokens, s));
                            let (t0, t1) = (self.us(started), self.us(ended));
                            self.trace.complete(
                                "micro-batch",
                                "train",
                                PID_TRAINER,
                                0,
                                t0,
                                t1 - t0,
                                serde_json::json!({"tokens": tokens}),
                            );
                            match b {
                                Busy::CoreMb => {
                                    cur.on_mb(s);
                                    sched
                                        .on_micro_batch_consumed(now)
                                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                                    busy = Busy::Idle;
                                }
                                Busy::PrevMb { ends_opt } => {
                                    prev.on_mb(s);
                                    if ends_opt {
                                        self.send_trainer(TrainCmd::OptStep)?;
                                        busy = Busy::PrevOpt;
                                    } else {
                                        busy = Busy::Idle;
                                    }
                                }
                                _ => bail!("trainer reported a micro-batch it was not given"),
                            }
                        }
                        (
                            TrainerReply::OptDone {
                                stats,
                                accum,
                                normalizer,
                                started,
                                ended,
                            },
                            b,
                        ) => {
                            let s = (ended - started).as_secs_f64();
                            self.busy.push((started, ended));
                            self.measured.opt_s.push(s);
                            let (t0, t1) = (self.us(started), self.us(ended));
                            self.trace.complete(
                                "optimizer step",
                                "train",
                                PID_TRAINER,
                                0,
                                t0,
                                t1 - t0,
                                serde_json::json!({"grad_norm": stats.grad_norm}),
                            );
                            let agg = if b == Busy::CoreOpt {
                                &mut cur
                            } else {
                                &mut prev
                            };
                            agg.on_opt(&accum, normalizer, stats.grad_norm, s, ended);
                            if b == Busy::CoreOpt {
                                sched
                                    .on_optimizer_step_done(now)
                                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                            }
                            busy = Busy::Idle;
                        }
                        (TrainerReply::Exported(..), _) => bail!("unrequested weight export"),
                    },
                    ev => self.on_event(&mut sched, &mut ro, ev, now)?,
                }
            }
            // Step boundary: weight sync, then metrics, evaluation and checkpoint.
            let trainer_version = PolicyVersion(k + 1);
            let is_last = k == last_phase;
            // A signal stops the run here, at a step boundary, with a checkpoint.
            let stop = !is_last && k < steps && crate::interrupt::requested();
            let ckpt_now = is_last
                || stop
                || (cfg.run.checkpoint_every > 0 && (k + 1) % cfg.run.checkpoint_every as u64 == 0);
            let (w, adam) = self.export(ckpt_now && k < steps)?;
            let train_end = if one_off { prev.end } else { cur.end };
            let sync_s = if one_off {
                // Phase 0 trains nothing, so the engines keep v0 for step 1's rollout; from
                // phase k >= 1 on the trainer holds v_k, which step k+1's rollout uses.
                if k == 0 {
                    0.0
                } else {
                    engine_version = PolicyVersion(k);
                    self.sync_engines(w.clone(), engine_version)?
                }
            } else {
                engine_version = trainer_version;
                self.sync_engines(w.clone(), engine_version)?
            };
            self.measured.sync_s.push(sync_s);
            let summary = if rollout_this {
                sched.poll_step_done()
            } else {
                None
            };
            let mut finished: Vec<StepMetrics> = Vec::new();
            if let Some(sum) = summary {
                counters.push(sum.counters);
                let c = &sum.counters;
                let final_at = sum.batch_final_at.map(|t| t.0).unwrap_or(sum.began_at.0);
                let rollout_s = final_at.saturating_sub(sum.began_at.0) as f64 * 1e-6;
                let (rsum, rn, rc) = ro.rewards;
                let mut m = StepMetrics {
                    step: k,
                    mode: cfg.run.mode.name().into(),
                    rollout_version: ro.version.0,
                    reward: if rn > 0 { rsum / rn as f64 } else { 0.0 },
                    train_accuracy: if rn > 0 { rc as f64 / rn as f64 } else { 0.0 },
                    rollout_s,
                    sync_s,
                    tokens: ro.tokens,
                    tokens_per_s: ro.tokens as f64 / rollout_s.max(1e-9),
                    drawn: c.drawn,
                    trained: c.trained,
                    filtered: c.filtered(),
                    aborted: c.aborted,
                    requests_failed: c.requests_failed,
                    rollouts: c.requests_generated + c.requests_discarded,
                    extended: ro.extended,
                    skipped: c.filtered_skipped,
                    ..Default::default()
                };
                rollouts_cum += m.rollouts;
                m.rollouts_cum = rollouts_cum;
                self.timeline = Some(self.gantt(&ro));
                if one_off {
                    // Training of this batch happens in the next phase.
                    let prev_m = pending_metrics.replace((m, ro.start));
                    pending.extend(buffer.drain(..));
                    if let Some((mut pm, start)) = prev_m {
                        self.fill_train(&mut pm, &prev, start, train_end);
                        finished.push(pm);
                    }
                } else {
                    self.fill_train(&mut m, &cur, ro.start, train_end);
                    finished.push(m);
                }
            } else if let Some((mut pm, start)) = pending_metrics.take() {
                self.fill_train(&mut pm, &prev, start, train_end);
                finished.push(pm);
            }
            let done_steps = if one_off { k } else { k + 1 };
            let eval_now = is_last
                || (cfg.run.eval_every > 0
                    && done_steps > 0
                    && done_steps % cfg.run.eval_every as u64 == 0
                    && !finished.is_empty());
            if eval_now {
                let acc = eval(eval_be, &w, heldout)?;
                acc_end = acc;
                test_end = test_eval(eval_be, &w)?;
                if let Some(m) = finished.last_mut() {
                    m.heldout_accuracy = Some(acc);
                    m.test_accuracy = test_end;
                }
            }
            for m in &mut finished {
                m.elapsed_s = started.elapsed().as_secs_f64();
                writeln!(metrics_file, "{}", serde_json::to_string(m)?)?;
                metrics_file.flush()?;
                // With the progress bar on, per-step lines would tear it; they go to debug.
                macro_rules! step_line {
                    ($lvl:ident) => {
                        tracing::$lvl!(
                            step = m.step,
                            reward = format_args!("{:.3}", m.reward),
                            acc = format_args!("{:.3}", m.train_accuracy),
                            heldout = ?m.heldout_accuracy,
                            r2t = format_args!("{:.2}s", m.rollout_to_train_end_s),
                            wait = format_args!("{:.2}", m.trainer_wait_ratio),
                            "step"
                        )
                    };
                }
                if cfg.run.progress {
                    bar.suspend(|| step_line!(debug));
                } else {
                    step_line!(info);
                }
                bar.set_message(format!(
                    "reward {:.2} acc {:.2}{}",
                    m.reward,
                    m.train_accuracy,
                    m.heldout_accuracy
                        .map(|a| format!(" held-out {a:.2}"))
                        .unwrap_or_default()
                ));
            }
            metrics.extend(finished);
            if rollout_this {
                bar.inc(1);
            }
            state.next_step = k + 1;
            state.data_pos = self.data.pos;
            state.evicted = self.evicted.iter().copied().collect();
            state.evicted.sort_unstable();
            state.engine_version = engine_version.0;
            if ckpt_now && k < steps {
                state.pending = pending
                    .iter()
                    .map(|(gs, e)| (gs.iter().map(save_group).collect(), *e))
                    .collect();
                state.pending_step = pending_metrics.as_ref().map(|(m, _)| m.step);
                save_checkpoint(out, tok_src(cfg), &self.model_cfg, &w, adam.as_ref(), state)?;
                // What a `kill -9` after this point would otherwise lose.
                self.write_trace(out)?;
                self.summary.write(out, None, None, false)?;
            }
            weights = Some(w);
            if stop {
                self.interrupted = Some(k + 1);
                bar.abandon();
                return Ok((
                    metrics,
                    counters,
                    weights.context("no step ran")?,
                    acc_end,
                    test_end,
                ));
            }
        }
        bar.finish_and_clear();
        let w = weights.context("no step ran")?;
        // The final weights as a model directory (for one-step-off they are past the last
        // checkpoint, which precedes the final drain so that a resume continues the schedule).
        save_model(&out.join("final"), &self.model_cfg, &w, tok_src(cfg))?;
        Ok((metrics, counters, w, acc_end, test_end))
    }

    /// Training fields of a step's metrics, from its trainer aggregate and window.
    fn fill_train(&self, m: &mut StepMetrics, t: &TrainAgg, start: Instant, end: Option<Instant>) {
        let end = end.unwrap_or_else(Instant::now);
        let window = (end - start).as_secs_f64().max(1e-9);
        let busy: f64 = self
            .busy
            .iter()
            .map(|(a, b)| {
                let (a, b) = ((*a).max(start), (*b).min(end));
                if b > a { (b - a).as_secs_f64() } else { 0.0 }
            })
            .sum();
        m.rollout_to_train_end_s = window;
        m.trainer_wait_ratio = ((window - busy) / window).clamp(0.0, 1.0);
        m.train_busy_s = t.busy_s;
        m.ideal_s = m.rollout_s + t.last_mb_s;
        let tok = t.accum.tokens.max(1) as f64;
        m.loss = t.loss_sum / t.opt_steps.max(1) as f64;
        m.kl = t.accum.kl_sum / tok;
        m.entropy = t.accum.entropy_sum / tok;
        m.grad_norm = t.grad_norm;
        m.clip_fraction = t.accum.clip_fraction();
    }

    fn record_trained(&mut self, groups: &[GroupBatch], step: u64) {
        for g in groups {
            for s in &g.samples {
                self.trained.push(TrainedRecord {
                    step,
                    rollout_step: g.step,
                    group: g.group.0,
                    sample: s.sample,
                    version: s.version.0,
                });
            }
        }
    }

    /// Asks the core for every decision it has now and carries them out.
    fn decide(
        &mut self,
        sched: &mut Scheduler<'_>,
        ro: &mut Rollout,
        dispatched: &mut Vec<GroupBatch>,
        now: Tick,
    ) -> anyhow::Result<()> {
        // Allocation decisions first: a committed or skipped group may call for a draw, an
        // extended one for admissions.
        while let Some(a) = sched.poll_allocation_with(now, &self.policy) {
            self.on_allocated(sched, ro, a);
        }
        while let Some(n) = sched.poll_draw(now) {
            let first = sched
                .on_prompts_drawn(now, n)
                .map_err(|e| anyhow::anyhow!("draw: {e}"))?;
            for i in 0..n {
                let (index, problem, prompt) = self.data.draw_unevicted(&self.evicted);
                self.measured.prompt_tokens.push(prompt.len() as u32);
                let g = GroupId(first.0 + i);
                let size = sched.group(g).map_or(0, |info| info.target as usize);
                ro.groups.insert(
                    g,
                    GroupRec {
                        index,
                        prompt,
                        problem,
                        samples: vec![None; size],
                    },
                );
            }
        }
        while let Some(rid) = sched.poll_abort(now) {
            match ro.inflight.get(&rid) {
                Some(&(e, _)) if self.engines[e as usize].live => {
                    let _ = self.engines[e as usize].tx.send(EngineCmd::Cancel(rid));
                }
                _ => {
                    // Its engine is gone: nothing runs it any more.
                    ro.inflight.remove(&rid);
                    sched
                        .on_abort_acked(now, rid)
                        .map_err(|e| anyhow::anyhow!("abort {rid}: {e}"))?;
                }
            }
        }
        let s = self.cfg.rollout.slots;
        // The core picks the request; the harness only picks the least loaded live engine.
        while let Some(e) = (0..self.engines.len())
            .filter(|&i| self.engines[i].live && self.engines[i].running < s)
            .min_by_key(|&i| self.engines[i].running)
        {
            let Some(a) = sched.poll_admit(now) else {
                break;
            };
            let Some(g) = ro.groups.get(&a.request.group) else {
                bail!("the core admitted {} of an undrawn group", a.request);
            };
            let cmd = EngineCmd::Add {
                rid: a.request,
                prompt: g.prompt.clone(),
                params: self.sampling(a.request),
            };
            if self.engines[e].tx.send(cmd).is_err() {
                return Err(self.worker_stopped(&format!("rollout engine {e}")));
            }
            self.engines[e].running += 1;
            ro.inflight.insert(a.request, (e as u16, Instant::now()));
        }
        while let Some(d) = sched.poll_dispatch(now) {
            let Some(g) = ro.groups.get(&d.group) else {
                bail!("the core dispatched unknown group {}", d.group);
            };
            let samples: Option<Vec<Sample>> = g.samples.iter().cloned().collect();
            let Some(samples) = samples else {
                bail!("group {} was dispatched with samples missing", d.group);
            };
            let t = self.us(Instant::now());
            self.trace.instant(
                &format!("dispatch {}", d.group),
                "dispatch",
                PID_GROUPS,
                0,
                t,
            );
            dispatched.push(GroupBatch {
                step: ro.step,
                group: d.group,
                prompt: g.prompt.clone(),
                samples,
            });
        }
        Ok(())
    }

    /// Carries out what the core applied for a held group: room for an extension's samples,
    /// or the eviction of a solved prompt (Pilot-Commit's p = 1) from later epochs.
    fn on_allocated(&mut self, sched: &Scheduler<'_>, ro: &mut Rollout, a: Allocated) {
        match a.applied {
            Allocation::Extend(_) => {
                ro.extended += 1;
                let target = sched.group(a.group).map_or(0, |info| info.target as usize);
                if let Some(g) = ro.groups.get_mut(&a.group) {
                    g.samples.resize(target, None);
                }
            }
            Allocation::Skip(SkipReason::Solved) if self.cfg.alloc.evict_solved => {
                if let Some(g) = ro.groups.get(&a.group) {
                    self.evicted.insert(g.index);
                }
            }
            Allocation::Commit
                if sched.group(a.group).is_some_and(|g| {
                    matches!(g.state, GroupState::Trainable | GroupState::Dispatched)
                }) =>
            {
                // A held group completes when it is committed, not at its last reward.
                ro.group_done.push(ro.start.elapsed().as_secs_f64());
            }
            _ => {}
        }
    }

    /// Reports one worker event to the core.
    fn on_event(
        &mut self,
        sched: &mut Scheduler<'_>,
        ro: &mut Rollout,
        ev: Event,
        now: Tick,
    ) -> anyhow::Result<()> {
        match ev {
            Event::Generated {
                engine,
                rid,
                version,
                tokens,
                logprobs,
                started,
            } => {
                self.engines[engine as usize].running =
                    self.engines[engine as usize].running.saturating_sub(1);
                ro.inflight.remove(&rid);
                ro.tokens += tokens.len() as u64;
                self.measured.response_tokens.push(tokens.len() as u32);
                let (t0, t1) = (self.us(started), self.us(Instant::now()));
                ro.spans.push((
                    engine,
                    (started - ro.start).as_secs_f64(),
                    ro.start.elapsed().as_secs_f64(),
                ));
                let id = ((rid.step.0) << 40)
                    | ((rid.group.0 as u64) << 16)
                    | ((rid.sample as u64) << 4)
                    | rid.attempt as u64;
                self.trace.async_span(
                    &format!("{}/s{}", rid.group, rid.sample),
                    "request",
                    PID_ENGINES,
                    engine as u32,
                    id,
                    t0,
                    t1,
                    serde_json::json!({"tokens": tokens.len(), "attempt": rid.attempt}),
                );
                match sched.on_request_generated(now, rid, version, tokens.len() as u32) {
                    Ok(rolloutpipe_core::Completion::Accepted { .. }) => {
                        let Some(g) = ro.groups.get(&rid.group) else {
                            bail!("generated {rid} of an unknown group");
                        };
                        let job = VerifyJob {
                            rid,
                            problem: g.problem.clone(),
                            tokens: tokens.clone(),
                        };
                        ro.generated.insert(
                            rid,
                            Sample {
                                sample: rid.sample,
                                attempt: rid.attempt,
                                version,
                                tokens,
                                logprobs,
                                reward: 0.0,
                                correct: false,
                            },
                        );
                        if let Some(v) = &self.verify {
                            v.send(job)
                                .map_err(|_| anyhow::anyhow!("the verifiers stopped"))?;
                        }
                    }
                    // Discarded: the group ended while it ran.
                    Ok(_) => {}
                    Err(e) => tracing::warn!(%rid, "completion rejected: {e}"),
                }
            }
            Event::Rewarded {
                rid,
                reward,
                correct,
                latency,
            } => {
                self.measured.verify_s.push(latency.as_secs_f64());
                if rid.step.0 != ro.step {
                    // The verifier finished a response of an earlier step's aborted group.
                    return Ok(());
                }
                let Some(mut s) = ro.generated.remove(&rid) else {
                    bail!("a reward for {rid}, which was not generated");
                };
                match sched.on_reward(now, rid, reward) {
                    Ok(rolloutpipe_core::Completion::Accepted { group_state: state }) => {
                        ro.rewards.0 += reward as f64;
                        ro.rewards.1 += 1;
                        ro.rewards.2 += correct as u64;
                        s.reward = reward;
                        s.correct = correct;
                        if let Some(g) = ro.groups.get_mut(&rid.group)
                            && let Some(slot) = g.samples.get_mut(rid.sample as usize)
                        {
                            *slot = Some(s);
                        }
                        if !state.is_incomplete() {
                            let t = ro.start.elapsed().as_secs_f64();
                            ro.group_done.push(t);
                            let info = sched.group(rid.group);
                            if let Some(info) = info {
                                let (a, b) = (
                                    info.drawn_at.0 as f64,
                                    info.ended_at.map(|t| t.0 as f64).unwrap_or(now.0 as f64),
                                );
                                let trainable =
                                    matches!(state, GroupState::Trainable | GroupState::Dispatched);
                                self.trace.async_span(
                                    &format!("{}", rid.group),
                                    if trainable { "group" } else { "filtered" },
                                    PID_GROUPS,
                                    0,
                                    ((ro.step) << 32) | rid.group.0 as u64,
                                    a,
                                    b,
                                    serde_json::json!({"state": state.to_string()}),
                                );
                            }
                        }
                    }
                    // The group ended while the verifier ran (aborted or filtered).
                    // Discarded: the group ended while the verifier ran.
                    Ok(_) => {}
                    Err(e) => tracing::debug!(%rid, "reward dropped: {e}"),
                }
            }
            Event::Aborted { rid } => {
                if let Some((e, _)) = ro.inflight.remove(&rid) {
                    let e = &mut self.engines[e as usize];
                    e.running = e.running.saturating_sub(1);
                }
                sched
                    .on_abort_acked(now, rid)
                    .map_err(|e| anyhow::anyhow!("abort ack {rid}: {e}"))?;
            }
            Event::EngineFailed {
                engine,
                lost,
                preempted,
            } => {
                let e = &mut self.engines[engine as usize];
                if e.live {
                    tracing::warn!(
                        engine,
                        "rollout engine failed; re-admitting its requests elsewhere"
                    );
                }
                e.live = false;
                e.running = 0;
                ensure!(
                    self.engines.iter().any(|e| e.live),
                    "every rollout engine failed"
                );
                for rid in lost {
                    if ro.inflight.remove(&rid).is_none() {
                        continue;
                    }
                    if preempted {
                        // The engine is gone, not the request: it waits for a slot on another
                        // engine with the same id (and so the same sampling seed).
                        sched
                            .on_request_preempted(now, rid)
                            .map_err(|e| anyhow::anyhow!("preemption of {rid}: {e}"))?;
                    } else {
                        sched
                            .on_request_failed(now, rid, ro.version)
                            .map_err(|e| anyhow::anyhow!("failure of {rid}: {e}"))?;
                    }
                }
            }
            Event::Synced { .. } => bail!("an engine synced in the middle of a step"),
            Event::Trainer(_) | Event::Fatal(_) => bail!("unexpected worker event"),
        }
        Ok(())
    }

    fn gantt(&self, ro: &Rollout) -> Vec<GanttRow> {
        let mut rows: Vec<GanttRow> = (0..self.engines.len())
            .map(|e| GanttRow {
                label: format!("engine {e}"),
                spans: Vec::new(),
            })
            .collect();
        for &(e, a, b) in &ro.spans {
            rows[e as usize].spans.push(Span {
                start: a,
                end: b,
                color: 0,
            });
        }
        let spans = self
            .busy
            .iter()
            .filter(|(_, b)| *b > ro.start)
            .map(|(a, b)| Span {
                start: a.saturating_duration_since(ro.start).as_secs_f64(),
                end: (*b - ro.start).as_secs_f64(),
                color: 1,
            })
            .collect();
        rows.push(GanttRow {
            label: "trainer".into(),
            spans,
        });
        rows
    }
}

fn progress_bar(cfg: &TrainConfig, steps: u64, done: u64) -> indicatif::ProgressBar {
    if !cfg.run.progress {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps);
    bar.set_position(done);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix} step {pos}/{len} [{bar:30}] {msg} (ETA {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(cfg.run.mode.name());
    crate::logging::add(bar)
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
fn tok_src(cfg: &TrainConfig) -> Option<&Path> {
    Some(cfg.model.dir.as_path()).filter(|d| !d.as_os_str().is_empty())
}

/// Opens `metrics.jsonl` for appending, dropping lines of steps at or after `from` (a resumed
/// run redoes them).
fn open_metrics(out: &Path, from: u64) -> anyhow::Result<std::fs::File> {
    let path = out.join("metrics.jsonl");
    let kept: Vec<String> = match std::fs::read_to_string(&path) {
        Ok(text) => text
            .lines()
            .filter(|l| {
                serde_json::from_str::<StepMetrics>(l)
                    .map(|m| m.step < from)
                    .unwrap_or(false)
            })
            .map(str::to_owned)
            .collect(),
        Err(_) => Vec::new(),
    };
    let mut f =
        std::fs::File::create(&path).with_context(|| format!("writing {}", path.display()))?;
    for l in kept {
        writeln!(f, "{l}")?;
    }
    Ok(f)
}

/// Reads a run's `metrics.jsonl`.
pub fn read_metrics(dir: &Path) -> anyhow::Result<Vec<StepMetrics>> {
    let path = dir.join("metrics.jsonl");
    let text = data::read(&path)?;
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1))
        })
        .collect()
}

fn write_plots(
    out: &Path,
    all: &[StepMetrics],
    timeline: Option<&Vec<GanttRow>>,
) -> anyhow::Result<()> {
    // The file holds every step of the run, resumed parts included.
    let ms = read_metrics(out).unwrap_or_else(|_| all.to_vec());
    if ms.is_empty() {
        return Ok(());
    }
    let pts = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
        ms.iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    plot::lines(
        &out.join("learning_curves.svg"),
        "Learning curves",
        "step",
        "share",
        &learning_series(&ms),
    )?;
    plot::lines(
        &out.join("step_times.svg"),
        "Step times",
        "step",
        "seconds",
        &[
            Series::new(
                "rollout-to-train-end",
                pts(&|m| Some(m.rollout_to_train_end_s)),
            ),
            Series::new("rollout", pts(&|m| Some(m.rollout_s))),
            Series::new("ideal bound", pts(&|m| Some(m.ideal_s))),
        ],
    )?;
    if let Some(rows) = timeline
        && rows.iter().any(|r| !r.spans.is_empty())
    {
        plot::gantt(
            &out.join("step_timeline.svg"),
            "Last step: requests per engine, trainer micro-batches",
            "seconds since rollout start",
            rows,
            &[(0, "request".into()), (1, "train".into())],
        )?;
    }
    Ok(())
}

/// The learning-curve series: reward and held-out accuracy always; train accuracy only where
/// it differs from the reward (without a format penalty they are equal, and one line would
/// hide the other).
fn learning_series(ms: &[StepMetrics]) -> Vec<Series<(f64, f64)>> {
    let pts = |f: &dyn Fn(&StepMetrics) -> Option<f64>| -> Vec<(f64, f64)> {
        ms.iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    let mut s = vec![
        Series::new("reward", pts(&|m| Some(m.reward))),
        Series::new("held-out accuracy", pts(&|m| m.heldout_accuracy)),
    ];
    if ms.iter().any(|m| m.test_accuracy.is_some()) {
        s.push(Series::new(
            "test accuracy (uniform)",
            pts(&|m| m.test_accuracy),
        ));
    }
    if ms
        .iter()
        .any(|m| (m.reward - m.train_accuracy).abs() > 1e-9)
    {
        s.push(Series::new(
            "train accuracy",
            pts(&|m| Some(m.train_accuracy)),
        ));
    }
    s
}

/// A 64-bit mix of several values (SplitMix64 finaliser over a running hash).
fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for &p in parts {
        h ^= p
            .wrapping_add(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(h << 6)
            .wrapping_add(h >> 2);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

fn save_group(g: &GroupBatch) -> SavedGroup {
    SavedGroup {
        step: g.step,
        group: g.group.0,
        prompt: g.prompt.to_vec(),
        samples: g
            .samples
            .iter()
            .map(|s| SavedSample {
                sample: s.sample,
                attempt: s.attempt,
                version: s.version.0,
                tokens: s.tokens.clone(),
                logprobs: s.logprobs.clone(),
                reward: s.reward,
                correct: s.correct,
            })
            .collect(),
    }
}

fn restore_group(g: SavedGroup) -> GroupBatch {
    GroupBatch {
        step: g.step,
        group: GroupId(g.group),
        prompt: Arc::new(g.prompt),
        samples: g
            .samples
            .into_iter()
            .map(|s| Sample {
                sample: s.sample,
                attempt: s.attempt,
                version: PolicyVersion(s.version),
                tokens: s.tokens,
                logprobs: s.logprobs,
                reward: s.reward,
                correct: s.correct,
            })
            .collect(),
    }
}

/// Writes `checkpoints/step-N` (into a temporary directory renamed at the end, then the
/// `latest` pointer), so an interrupted save never replaces a good checkpoint.
fn save_checkpoint(
    out: &Path,
    tok: Option<&Path>,
    cfg: &ModelConfig,
    w: &Weights,
    adam: Option<&AdamState>,
    st: &CheckpointState,
) -> anyhow::Result<()> {
    let root = out.join("checkpoints");
    let name = format!("step-{:06}", st.next_step);
    let tmp = root.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    save_model(&tmp, cfg, w, tok)?;
    if let Some(a) = adam {
        let mut o = Weights::default();
        let n = a.m.len();
        o.tensors
            .insert("adam.m".into(), Tensor::new(vec![n], a.m.clone())?);
        o.tensors
            .insert("adam.v".into(), Tensor::new(vec![a.v.len()], a.v.clone())?);
        o.tensors.insert(
            "adam.step".into(),
            Tensor::new(vec![1], vec![a.step as f32])?,
        );
        o.save_safetensors(&tmp.join("optimizer.safetensors"))?;
        // f32 cannot hold every u64 step count exactly; the JSON holds the exact one.
        std::fs::write(
            tmp.join("optimizer_step.json"),
            serde_json::to_string(&a.step)?,
        )?;
    }
    std::fs::write(tmp.join("state.json"), serde_json::to_string(st)?)?;
    let dst = root.join(&name);
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::rename(&tmp, &dst).with_context(|| format!("renaming into {}", dst.display()))?;
    let ptr_tmp = root.join(".latest.tmp");
    std::fs::write(&ptr_tmp, &name)?;
    std::fs::rename(&ptr_tmp, root.join("latest"))?;
    tracing::info!(dir = %dst.display(), "checkpoint saved");
    Ok(())
}

fn load_checkpoint(
    dir: &Path,
    cfg: &ModelConfig,
) -> anyhow::Result<(Weights, CheckpointState, Option<AdamState>)> {
    let (ccfg, w) = load_model_dir(dir)?;
    ensure!(
        &ccfg == cfg,
        "the checkpoint's model shape differs from the configured model"
    );
    let st: CheckpointState = serde_json::from_str(&data::read(&dir.join("state.json"))?)
        .context("state.json is not a valid checkpoint state")?;
    let opt_path = dir.join("optimizer.safetensors");
    let adam = if opt_path.exists() {
        let o = Weights::load_safetensors(&opt_path)?;
        let step: u64 = serde_json::from_str(&data::read(&dir.join("optimizer_step.json"))?)
            .context("optimizer_step.json")?;
        Some(AdamState {
            m: o.get("adam.m")?.data.clone(),
            v: o.get("adam.v")?.data.clone(),
            step,
        })
    } else {
        tracing::warn!(
            "checkpoint has no optimizer state (its backend did not expose it); AdamW restarts"
        );
        None
    };
    Ok((w, st, adam))
}
