//! The worker threads of a run and the messages between them and the scheduler thread.
//!
//! Workers only execute: a rollout engine generates the requests it is handed (continuous
//! batching, one `decode_step` per iteration), a verifier scores responses, the trainer runs the
//! micro-batches and optimizer steps it is told to. Every decision (which request, which group,
//! when to step) is made by the scheduler thread, which owns the core. All workers report on one
//! event channel so that the scheduler waits in exactly one place. The work itself is in
//! `steps`, shared with the remote hosts of `remote`.
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, AdamW, Aggregation, CpuBackend, DType, ModelConfig, Objective, OptStats, Policy,
    ResumeState, RolloutEngine, SamplingParams, Sequence, StdMode, SyncTarget, Trainer,
    WeightSnapshot, Weights,
};
use rolloutpipe_core::{GroupId, PolicyVersion, RequestId};

use super::config::TrainConfig;
pub use super::steps::score;
use super::steps::{EngineOut, EngineStep, TrainerStep};
use crate::tasks::{Problem, Task, Tokenizer};

/// The trainer's backend: any seam-v2 [`Trainer`]; its AdamW moments leave it only for
/// checkpoints (`TrainCmd::Export { optimizer: true }`).
pub struct TrainerBackend(Box<dyn Trainer>);

impl TrainerBackend {
    /// The backend through the trainer interface.
    pub fn as_dyn(&mut self) -> &mut dyn Trainer {
        self.0.as_mut()
    }

    /// Restores AdamW moments from a checkpoint.
    pub fn set_optimizer_state(&mut self, st: AdamState) -> anyhow::Result<()> {
        Ok(self.0.restore_optimizer(st)?)
    }
}

/// A rollout engine's backend: any seam-v2 [`RolloutEngine`], and how many decode iterations
/// a request added between two of them may wait before its first step (1 with look-ahead
/// decoding, whose next step was queued before the request arrived; else 0).
pub struct EngineBackend(Box<dyn RolloutEngine>, i64);

impl EngineBackend {
    /// Decode iterations a newly added request may run without a step (see the type).
    pub fn admission_lag(&self) -> i64 {
        self.1
    }

    /// The backend through the engine interface.
    pub fn as_dyn(&mut self) -> &mut dyn RolloutEngine {
        self.0.as_mut()
    }

    /// Where and in which dtype the engine wants its weight snapshots.
    pub fn sync_target(&self) -> SyncTarget {
        self.0.sync_target()
    }
}

/// Builds a trainer by name with `threads` CPU threads (ignored by GPU backends), its
/// products (forward and backward) on tensor cores with `tensor_cores` (`trainer.tensor_cores`;
/// wgpu only, refused in one line where the adapter has none).
pub fn make_trainer(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
    tensor_cores: bool,
) -> anyhow::Result<TrainerBackend> {
    let b: Box<dyn Trainer> = match name {
        "wgpu" if tensor_cores => make_wgpu_tensor_cores(cfg, w)?,
        other if tensor_cores => anyhow::bail!(
            "trainer.tensor_cores needs the wgpu backend: the {other} backend has no \
             cooperative-matrix path"
        ),
        _ => make_backend(name, cfg, w, threads)?,
    };
    Ok(TrainerBackend(b))
}

/// How a rollout engine is built, besides its backend name, model and weights: the
/// `[rollout]` settings that shape an engine (and travel in a remote engine's `Init`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineOptions {
    /// CPU threads of the engine's backend (`rollout.threads_per_engine`; ignored by GPU
    /// backends).
    pub threads: usize,
    /// Weight storage (`rollout.dtype`).
    pub dtype: DType,
    /// Forward products on tensor cores (`rollout.tensor_cores`; wgpu only).
    pub tensor_cores: bool,
    /// Look-ahead decoding (`rollout.lookahead`; wgpu only).
    pub lookahead: bool,
}

impl EngineOptions {
    /// The engine options of `cfg`'s `[rollout]`.
    pub fn of(cfg: &TrainConfig) -> anyhow::Result<Self> {
        Ok(Self {
            threads: cfg.rollout.threads_per_engine,
            dtype: cfg.engine_dtype()?,
            tensor_cores: cfg.rollout.tensor_cores,
            lookahead: cfg.rollout.lookahead,
        })
    }
}

/// Builds a rollout engine by name as `opts` say: its weights stored in `opts.dtype` (half
/// storage on the CPU and wgpu backends; the config refuses it on cuda, and so does this, by
/// name), its forward products on tensor cores with `opts.tensor_cores` (wgpu only; refused
/// in one line where the adapter has none), and decoding a step ahead with `opts.lookahead`
/// (wgpu only). The trainer's are `trainer.tensor_cores` ([`make_trainer`]).
pub fn make_engine(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    opts: &EngineOptions,
) -> anyhow::Result<EngineBackend> {
    let EngineOptions {
        threads,
        dtype,
        tensor_cores,
        lookahead,
    } = *opts;
    let b: Box<dyn RolloutEngine> = match (name, dtype) {
        ("wgpu", _) => make_wgpu_engine(cfg, w, dtype, tensor_cores, lookahead)?,
        (other, _) if lookahead => anyhow::bail!(
            "rollout.lookahead needs the wgpu backend: the {other} backend runs one step at a time"
        ),
        (other, _) if tensor_cores => anyhow::bail!(
            "rollout.tensor_cores needs the wgpu backend: the {other} backend has no \
             cooperative-matrix path"
        ),
        (_, DType::F32) => make_backend(name, cfg, w, threads)?,
        ("cpu", _) => Box::new(CpuBackend::with_dtype(cfg, w, threads, dtype)?),
        (other, _) => anyhow::bail!(
            "rollout.dtype {:?} needs the cpu or wgpu backend: the {other} backend stores f32 weights",
            dtype.name().to_ascii_lowercase()
        ),
    };
    Ok(EngineBackend(b, i64::from(lookahead)))
}

/// Refuses, before any work, a backend this machine cannot run when `here` (a worker, or the
/// SFT warm start, runs in this process): `wgpu` without its feature or without an adapter,
/// `cuda` without its feature or without a loadable NVIDIA driver, and where `tensor_cores`
/// names the keys that ask for them (`rollout.tensor_cores`, `trainer.tensor_cores`) a wgpu
/// adapter without tensor cores (the adapter's one-line reason,
/// [`rolloutpipe_backends::wgpu::Gpu::coop_refusal`], after the keys). With every worker on
/// other hosts nothing here is checked: they refuse at `Init`, on their own devices.
pub fn check_backend(name: &str, tensor_cores: &[&str], here: bool) -> anyhow::Result<()> {
    match name {
        _ if !here => Ok(()),
        "wgpu" => check_wgpu(tensor_cores),
        "cuda" => match rolloutpipe_backends::cuda::availability() {
            Some(why) => anyhow::bail!("run.backend \"cuda\": {why}"),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Opens the default wgpu adapter as every engine and the trainer will: refuses a machine
/// with none, and the `tensor_cores` keys where it has no tensor cores, in one line.
#[cfg(feature = "wgpu")]
fn check_wgpu(tensor_cores: &[&str]) -> anyhow::Result<()> {
    use rolloutpipe_backends::wgpu::Gpu;
    let key = if tensor_cores.is_empty() {
        "run.backend \"wgpu\"".to_string()
    } else {
        tensor_cores.join(", ")
    };
    let gpu = match Gpu::new() {
        Ok(Some(g)) => g,
        Ok(None) => anyhow::bail!(
            "{key}: no wgpu adapter found (a Vulkan, Metal or DX12 driver; on Linux without a \
             GPU, Mesa's lavapipe: apt install mesa-vulkan-drivers)"
        ),
        Err(e) => anyhow::bail!("{key}: opening the wgpu adapter: {e}"),
    };
    match gpu.coop_refusal() {
        Some(why) if !tensor_cores.is_empty() => anyhow::bail!("{key}: {why}"),
        _ => Ok(()),
    }
}

#[cfg(not(feature = "wgpu"))]
fn check_wgpu(_tensor_cores: &[&str]) -> anyhow::Result<()> {
    make_wgpu_unavailable()
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu_unavailable<T>() -> anyhow::Result<T> {
    anyhow::bail!(
        "the wgpu backend is not built into this binary; rebuild with `--features wgpu` \
         (it is a default feature) or use --backend cpu"
    )
}

/// Builds a backend by name in both roles; callers keep the role they need.
fn make_backend(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
) -> anyhow::Result<Box<dyn Policy>> {
    match name {
        "cpu" => Ok(Box::new(CpuBackend::new(cfg, w, threads)?)),
        "wgpu" => make_wgpu(cfg, w),
        "cuda" => make_cuda(cfg, w),
        other => anyhow::bail!("unknown backend {other:?}; valid: cpu, wgpu, cuda"),
    }
}

#[cfg(feature = "wgpu")]
fn make_wgpu(cfg: &ModelConfig, w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    use anyhow::Context;
    let b = rolloutpipe_backends::wgpu::WgpuBackend::new(cfg, w)
        .context("starting the wgpu backend (is there a GPU adapter?)")?;
    Ok(Box::new(b))
}

/// A wgpu engine storing its weights in `dtype` (f32, or bf16 / f16: engine-only, f32
/// compute), its forward products on tensor cores when `tensor_cores` (refused, naming what
/// the adapter lacks, where it has none), decoding a step ahead when `lookahead`.
#[cfg(feature = "wgpu")]
fn make_wgpu_engine(
    cfg: &ModelConfig,
    w: &Weights,
    dtype: DType,
    tensor_cores: bool,
    lookahead: bool,
) -> anyhow::Result<Box<dyn RolloutEngine>> {
    use anyhow::Context;
    let mut b = rolloutpipe_backends::wgpu::WgpuBackend::with_dtype(cfg, w, dtype)
        .context("starting the wgpu backend (is there a GPU adapter?)")?;
    if tensor_cores {
        b.set_tensor_cores(true).context("rollout.tensor_cores")?;
    }
    b.set_lookahead(lookahead);
    Ok(Box::new(b))
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu_engine(
    _cfg: &ModelConfig,
    _w: &Weights,
    _dtype: DType,
    _tensor_cores: bool,
    _lookahead: bool,
) -> anyhow::Result<Box<dyn RolloutEngine>> {
    make_wgpu_unavailable()
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu(_cfg: &ModelConfig, _w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    make_wgpu_unavailable()
}

/// A wgpu trainer whose products, forward and backward, run on tensor cores (refused, naming
/// what the adapter lacks, where it has none).
#[cfg(feature = "wgpu")]
fn make_wgpu_tensor_cores(cfg: &ModelConfig, w: &Weights) -> anyhow::Result<Box<dyn Trainer>> {
    use anyhow::Context;
    let mut b = rolloutpipe_backends::wgpu::WgpuBackend::new(cfg, w)
        .context("starting the wgpu backend (is there a GPU adapter?)")?;
    b.set_tensor_cores(true).context("trainer.tensor_cores")?;
    Ok(Box::new(b))
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu_tensor_cores(_cfg: &ModelConfig, _w: &Weights) -> anyhow::Result<Box<dyn Trainer>> {
    make_wgpu_unavailable()
}

/// The CUDA backend on device 0. Without the `cuda` feature, or without a loadable NVIDIA
/// driver, this is the one-line reason (never a panic: cudarc panics when no driver loads, so
/// availability is checked first).
fn make_cuda(cfg: &ModelConfig, w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    #[cfg(feature = "cuda")]
    {
        use anyhow::Context;
        if let Some(why) = rolloutpipe_backends::cuda::availability() {
            anyhow::bail!("run.backend \"cuda\": {why}");
        }
        let b = rolloutpipe_backends::cuda::CudaBackend::new(cfg, w, 0)
            .context("starting the CUDA backend")?;
        Ok(Box::new(b))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (cfg, w);
        anyhow::bail!(
            "run.backend \"cuda\": {}",
            rolloutpipe_backends::cuda::availability().unwrap_or_default()
        )
    }
}

/// One generated, scored response.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Sample index in its group.
    pub sample: u16,
    /// The attempt that produced it.
    pub attempt: u8,
    /// The weights version that generated it.
    pub version: PolicyVersion,
    /// Response tokens.
    pub tokens: Vec<u32>,
    /// Rollout log-probs of the response tokens.
    pub logprobs: Vec<f32>,
    /// Reward (set once the verifier answered).
    pub reward: f32,
    /// Verified correct.
    pub correct: bool,
}

/// A complete group handed to the trainer.
#[derive(Debug, Clone)]
pub struct GroupBatch {
    /// The step it was generated in.
    pub step: u64,
    /// The group.
    pub group: GroupId,
    /// Prompt ids.
    pub prompt: Arc<Vec<u32>>,
    /// Its samples, by sample index.
    pub samples: Vec<Sample>,
    /// The KL reference log-probs of each sample's response, when a rollout engine computed
    /// them (tail multiplexing); the trainer computes the missing ones itself.
    pub ref_logprobs: Option<Vec<Vec<f32>>>,
}

/// Scheduler → engine.
pub enum EngineCmd {
    /// Start generating a request.
    Add {
        /// The core's request id.
        rid: RequestId,
        /// Prompt ids.
        prompt: Arc<Vec<u32>>,
        /// Sampling settings (seed included).
        params: SamplingParams,
    },
    /// Abort a request.
    Cancel(RequestId),
    /// Replace the weights (between steps, nothing in flight) as this version.
    Sync {
        /// A snapshot made for this engine's [`SyncTarget`] (in-process engines), or `None`
        /// for an engine that converts `master` itself (a remote host).
        snap: Option<Arc<WeightSnapshot>>,
        /// The trainer's f32 master weights.
        master: Arc<Weights>,
        /// Their version.
        version: PolicyVersion,
    },
    /// Tail multiplexing: compute the KL reference log-probs of a dispatched group's
    /// sequences with the engine's reference model.
    RefLogprobs {
        /// The step whose group it is.
        step: u64,
        /// The group's position in the step's dispatch order.
        index: usize,
        /// Its sequences, by sample index.
        seqs: Vec<Sequence>,
        /// The sampling temperature the log-probs are taken at.
        temperature: f32,
    },
    /// Long-tail migration (`rollout.migrate`): export the running request that has generated
    /// the most tokens, if at least `min_generated` ([`Event::Migrated`] answers either way).
    Migrate {
        /// The fewest tokens a request must have generated to move.
        min_generated: u32,
    },
    /// Continue an exported request here: re-prefill, then the same seeded stream.
    Resume {
        /// The core's request id.
        rid: RequestId,
        /// What the source engine exported.
        state: Box<ResumeState>,
    },
    /// Stop the thread.
    Shutdown,
}

/// Scheduler → trainer.
pub enum TrainCmd {
    /// Forward/backward of one micro-batch, accumulating unnormalised gradient sums.
    MicroBatch(Vec<GroupBatch>),
    /// Normalise, clip and apply AdamW over the micro-batches since the last step.
    OptStep,
    /// Send the f32 master weights back, and the optimizer state when `optimizer` is set
    /// (checkpoints only: the moments do not cross the seam every step).
    Export {
        /// Include the AdamW moments.
        optimizer: bool,
    },
    /// Stop the thread.
    Shutdown,
}

/// Everything a worker reports.
pub enum Event {
    /// A request finished generating.
    Generated {
        /// Engine.
        engine: u16,
        /// Request.
        rid: RequestId,
        /// The engine's weights version.
        version: PolicyVersion,
        /// Response tokens.
        tokens: Vec<u32>,
        /// Their log-probs.
        logprobs: Vec<f32>,
        /// When the engine took it.
        started: Instant,
    },
    /// A cancel took effect.
    Aborted {
        /// Request.
        rid: RequestId,
    },
    /// An engine failed; these requests were lost.
    EngineFailed {
        /// Engine.
        engine: u16,
        /// Its requests that will never finish.
        lost: Vec<RequestId>,
        /// The engine was lost (its process or connection went away) rather than failing
        /// the requests: they are re-admitted with the same attempt
        /// (`on_request_preempted`), not retried as failures.
        preempted: bool,
    },
    /// Weights replaced; decode timings since the last sync: (running requests, seconds).
    Synced {
        /// Engine.
        engine: u16,
        /// Decode iteration samples.
        decode: Vec<(u32, f64)>,
    },
    /// A reward is known.
    Rewarded {
        /// Request.
        rid: RequestId,
        /// Reward.
        reward: f32,
        /// Verified correct.
        correct: bool,
        /// Time spent verifying.
        latency: Duration,
    },
    /// A multiplexed reference pass was lost with its (remote) engine: the trainer computes
    /// the group's pass itself.
    RefLost {
        /// Engine.
        engine: u16,
    },
    /// A multiplexed reference pass finished ([`EngineCmd::RefLogprobs`]).
    RefLogprobs {
        /// Engine.
        engine: u16,
        /// The step whose group it is.
        step: u64,
        /// The group's position in the step's dispatch order.
        index: usize,
        /// Per sample, its response tokens' reference log-probs.
        logprobs: Vec<Vec<f32>>,
        /// Start.
        started: Instant,
        /// End.
        ended: Instant,
    },
    /// The answer to [`EngineCmd::Migrate`]: the exported request, or `None` when no running
    /// request had generated enough.
    Migrated {
        /// The source engine.
        engine: u16,
        /// The request and its state.
        moved: Option<(RequestId, Box<ResumeState>)>,
    },
    /// A resumed request's re-prefill ran (in the engine iteration that took `secs`).
    Resumed {
        /// The target engine.
        engine: u16,
        /// Request.
        rid: RequestId,
        /// Tokens it had generated before the move (re-prefilled with its prompt).
        tokens: u32,
        /// The iteration's seconds.
        secs: f64,
        /// When the iteration ended.
        ended: Instant,
    },
    /// The trainer finished a command.
    Trainer(TrainerReply),
    /// A worker hit an error it cannot recover from.
    Fatal(String),
}

/// What the trainer did.
pub enum TrainerReply {
    /// A micro-batch was accumulated.
    MicroBatchDone {
        /// Sums over its tokens.
        stats: AccumStats,
        /// Its response tokens.
        tokens: usize,
        /// Its prompt + response tokens (what a forward/backward pass processes).
        all_tokens: usize,
        /// Start.
        started: Instant,
        /// End.
        ended: Instant,
    },
    /// An optimizer step was applied.
    OptDone {
        /// Norm and clip.
        stats: OptStats,
        /// Sums over the step's micro-batches.
        accum: AccumStats,
        /// The normaliser used.
        normalizer: f64,
        /// Start.
        started: Instant,
        /// End.
        ended: Instant,
    },
    /// The weights, and the moments when they were asked for.
    Exported(Arc<Weights>, Option<AdamState>),
}

/// An engine's reference model for tail multiplexing (`rollout.multiplex`): an f32 CPU
/// backend over the trainer's reference weights, never synced.
pub struct EngineReference {
    /// The backend.
    pub backend: TrainerBackend,
    /// `fault.perturb_mux`: add 1e-3 to each group's first log-prob (tests only).
    pub perturb: bool,
}

impl EngineReference {
    /// The reference log-probs of `seqs` at `temperature`: the trainer's own computation
    /// (same weights, same batch-invariant CPU kernels), so bit-identical to it.
    pub fn logprobs(
        &mut self,
        seqs: &[Sequence],
        temperature: f32,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let mut lps = self.backend.as_dyn().logprobs(seqs, temperature)?;
        if self.perturb
            && let Some(x) = lps.first_mut().and_then(|l| l.first_mut())
        {
            *x += 1e-3;
        }
        Ok(lps)
    }
}

/// An engine's commands: when `block` (it has nothing to run) the next one is waited for,
/// then whatever else has arrived, taken as the caller gets to it. `None` once the channel
/// is closed.
pub(crate) fn commands(
    rx: &Receiver<EngineCmd>,
    block: bool,
) -> Option<impl Iterator<Item = EngineCmd> + '_> {
    let first = if block { Some(rx.recv().ok()?) } else { None };
    Some(
        first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok())),
    )
}

/// Runs one rollout engine until `Shutdown`; `reference` is its reference model when it
/// multiplexes.
pub fn engine_thread(
    engine: u16,
    backend: EngineBackend,
    rx: Receiver<EngineCmd>,
    events: Sender<Event>,
    fail_at_request: Option<u64>,
    mut reference: Option<EngineReference>,
) {
    let mut step = EngineStep::new(engine, backend, fail_at_request);
    // When the engine took each running request (for the trace and the request spans).
    let mut started: HashMap<RequestId, Instant> = HashMap::new();
    let fatal = |e: anyhow::Error| {
        let _ = events.send(Event::Fatal(e.to_string()));
    };
    loop {
        // Block only when idle; while generating, take whatever arrived and keep decoding.
        let Some(cmds) = commands(&rx, !step.has_work()) else {
            return;
        };
        for cmd in cmds {
            let out = match cmd {
                EngineCmd::Shutdown => return,
                EngineCmd::Add {
                    rid,
                    prompt,
                    params,
                } => {
                    started.insert(rid, Instant::now());
                    step.add(rid, prompt.as_ref().clone(), params)
                }
                EngineCmd::Cancel(rid) => step.cancel(rid),
                EngineCmd::Migrate { min_generated } => match step.migrate_out(min_generated) {
                    Ok(moved) => {
                        let moved = moved.map(|(rid, st)| {
                            started.remove(&rid);
                            (rid, Box::new(st))
                        });
                        let _ = events.send(Event::Migrated { engine, moved });
                        continue;
                    }
                    Err(e) => return fatal(e),
                },
                EngineCmd::Resume { rid, state } => {
                    started.insert(rid, Instant::now());
                    step.resume(rid, *state)
                }
                EngineCmd::RefLogprobs {
                    step: s,
                    index,
                    seqs,
                    temperature,
                } => {
                    let Some(r) = reference.as_mut() else {
                        return fatal(anyhow::anyhow!(
                            "engine {engine}: a reference pass without a reference model"
                        ));
                    };
                    let started = Instant::now();
                    match r.logprobs(&seqs, temperature) {
                        Ok(logprobs) => {
                            let _ = events.send(Event::RefLogprobs {
                                engine,
                                step: s,
                                index,
                                logprobs,
                                started,
                                ended: Instant::now(),
                            });
                            continue;
                        }
                        Err(e) => {
                            return fatal(e.context(format!("engine {engine} reference pass")));
                        }
                    }
                }
                EngineCmd::Sync {
                    snap,
                    master,
                    version,
                } => {
                    let synced = match snap {
                        Some(s) => step.sync(&s, version),
                        None => step.sync_master(&master, version),
                    };
                    match synced {
                        Ok(decode) => {
                            let _ = events.send(Event::Synced { engine, decode });
                            continue;
                        }
                        Err(e) => return fatal(e),
                    }
                }
            };
            match out {
                Ok(Some(o)) => report(engine, o, &mut started, &events),
                Ok(None) => {}
                Err(e) => return fatal(e),
            }
        }
        match step.decode() {
            Ok(outs) => {
                let ended = Instant::now();
                for (rid, tokens, secs) in step.take_reprefilled() {
                    let _ = events.send(Event::Resumed {
                        engine,
                        rid,
                        tokens,
                        secs,
                        ended,
                    });
                }
                for o in outs {
                    report(engine, o, &mut started, &events);
                }
            }
            Err(e) => return fatal(e),
        }
    }
}

/// Sends what an engine reported as scheduler events.
pub(crate) fn report(
    engine: u16,
    o: EngineOut,
    started: &mut HashMap<RequestId, Instant>,
    events: &Sender<Event>,
) {
    let ev = match o {
        EngineOut::Generated {
            rid,
            version,
            tokens,
            logprobs,
        } => Event::Generated {
            engine,
            rid,
            version,
            tokens,
            logprobs,
            started: started.remove(&rid).unwrap_or_else(Instant::now),
        },
        EngineOut::Aborted(rid) => {
            started.remove(&rid);
            Event::Aborted { rid }
        }
        EngineOut::Lost(lost) => {
            for r in &lost {
                started.remove(r);
            }
            Event::EngineFailed {
                engine,
                lost,
                preempted: false,
            }
        }
    };
    let _ = events.send(ev);
}

/// A response to score.
pub struct VerifyJob {
    /// Request.
    pub rid: RequestId,
    /// The problem.
    pub problem: Arc<Problem>,
    /// Response tokens.
    pub tokens: Vec<u32>,
}

/// Runs one verifier until the job channel closes.
pub fn verifier_thread(
    task: Arc<dyn Task>,
    tokenizer: Arc<dyn Tokenizer>,
    jobs: Arc<Mutex<Receiver<VerifyJob>>>,
    events: Sender<Event>,
) {
    loop {
        let job = {
            let Ok(rx) = jobs.lock() else { return };
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        let t = Instant::now();
        let (reward, correct) = score(task.as_ref(), tokenizer.as_ref(), &job.problem, &job.tokens);
        let _ = events.send(Event::Rewarded {
            rid: job.rid,
            reward,
            correct,
            latency: t.elapsed(),
        });
    }
}

/// What the trainer needs besides its backend.
pub struct TrainerSetup {
    /// AdamW settings.
    pub opt: AdamW,
    /// The GRPO objective.
    pub objective: Objective,
    /// Aggregation.
    pub agg: Aggregation,
    /// Advantage scaling.
    pub std: StdMode,
    /// Use the rollout's log-probs as `logπ_old`.
    pub rollout_logprobs: bool,
    /// Reference model for the KL term (beta > 0).
    pub reference: Option<TrainerBackend>,
    /// Sampling temperature (for the reference's log-probs).
    pub temperature: f32,
}

/// Runs the trainer until `Shutdown`.
pub fn trainer_thread(
    backend: TrainerBackend,
    setup: TrainerSetup,
    rx: Receiver<TrainCmd>,
    events: Sender<Event>,
) {
    let mut step = match TrainerStep::new(backend, setup) {
        Ok(s) => s,
        Err(e) => {
            let _ = events.send(Event::Fatal(e.to_string()));
            return;
        }
    };
    while let Ok(cmd) = rx.recv() {
        let started = Instant::now();
        let reply = match cmd {
            TrainCmd::Shutdown => return,
            TrainCmd::MicroBatch(groups) => {
                step.micro_batch(groups)
                    .map(|m| TrainerReply::MicroBatchDone {
                        stats: m.stats,
                        tokens: m.tokens,
                        all_tokens: m.all_tokens,
                        started,
                        ended: Instant::now(),
                    })
            }
            TrainCmd::OptStep => step.opt_step().map(|d| TrainerReply::OptDone {
                stats: d.stats,
                accum: d.accum,
                normalizer: d.normalizer,
                started,
                ended: Instant::now(),
            }),
            TrainCmd::Export { optimizer } => step
                .export(optimizer)
                .map(|(w, adam)| TrainerReply::Exported(Arc::new(w), adam)),
        };
        match reply {
            Ok(r) => {
                if events.send(Event::Trainer(r)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = events.send(Event::Fatal(e.to_string()));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(lookahead: bool) -> EngineOptions {
        EngineOptions {
            threads: 1,
            dtype: DType::F32,
            tensor_cores: false,
            lookahead,
        }
    }

    /// `rollout.lookahead` reaches the engine: a request added after the first decode
    /// iteration has not started after the second with it (its first step was queued behind
    /// the step already on the device) and has without it; the lag the migration count uses
    /// says so. Other backends refuse it by name.
    #[test]
    fn lookahead_engines_start_a_later_request_one_iteration_later() {
        let mc = ModelConfig::tiny();
        let w = Weights::random(&mc, 3).unwrap();
        let e = make_engine("cpu", &mc, &w, &opts(true)).err().unwrap();
        assert_eq!(
            e.to_string(),
            "rollout.lookahead needs the wgpu backend: the cpu backend runs one step at a time"
        );
        #[cfg(feature = "wgpu")]
        {
            use rolloutpipe_backends::{GenRequest, RequestKey, SamplingParams};
            if !matches!(rolloutpipe_backends::wgpu::Gpu::new(), Ok(Some(_))) {
                eprintln!("SKIP: no wgpu adapter; the look-ahead engine test did not run");
                return;
            }
            let req = |id| GenRequest {
                id: RequestKey(id),
                prompt: vec![1, 2, 3],
                params: SamplingParams {
                    max_new_tokens: 8,
                    seed: id,
                    ..Default::default()
                },
            };
            for lookahead in [false, true] {
                let mut e = make_engine("wgpu", &mc, &w, &opts(lookahead)).unwrap();
                assert_eq!(e.admission_lag(), i64::from(lookahead));
                let be = e.as_dyn();
                be.add_request(req(1)).unwrap();
                be.decode_step().unwrap();
                be.add_request(req(2)).unwrap();
                be.decode_step().unwrap();
                let started = be.export_request(RequestKey(2)).is_ok();
                assert_eq!(started, !lookahead, "lookahead {lookahead}");
            }
        }
    }
}
