//! The worker threads of a run and the messages between them and the scheduler thread.
//!
//! Workers only execute: a rollout engine generates the requests it is handed (continuous
//! batching, one `decode_step` per iteration), a verifier scores responses, the trainer runs the
//! micro-batches and optimizer steps it is told to. Every decision (which request, which group,
//! when to step) is made by the scheduler thread, which owns the core. All workers report on one
//! event channel so that the scheduler waits in exactly one place.
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, AdamW, Aggregation, CpuBackend, GenRequest, ModelConfig, Objective, OptStats,
    Policy, RequestKey, RolloutEngine, SamplingParams, Sequence, StdMode, SyncTarget, TrainBatch,
    TrainSequence, Trainer, WeightSnapshot, Weights, advantages, normalizer,
};
use rolloutpipe_core::{GroupId, PolicyVersion, RequestId};

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

/// A rollout engine's backend: any seam-v2 [`RolloutEngine`].
pub struct EngineBackend(Box<dyn RolloutEngine>);

impl EngineBackend {
    /// The backend through the engine interface.
    pub fn as_dyn(&mut self) -> &mut dyn RolloutEngine {
        self.0.as_mut()
    }

    /// Where and in which dtype the engine wants its weight snapshots.
    pub fn sync_target(&self) -> SyncTarget {
        self.0.sync_target()
    }
}

/// Builds a trainer by name with `threads` CPU threads (ignored by GPU backends).
pub fn make_trainer(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
) -> anyhow::Result<TrainerBackend> {
    let b: Box<dyn Trainer> = make_backend(name, cfg, w, threads)?;
    Ok(TrainerBackend(b))
}

/// Builds a rollout engine by name with `threads` CPU threads (ignored by GPU backends).
pub fn make_engine(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
) -> anyhow::Result<EngineBackend> {
    let b: Box<dyn RolloutEngine> = make_backend(name, cfg, w, threads)?;
    Ok(EngineBackend(b))
}

/// Refuses, before any work, a backend this binary or machine cannot run: `wgpu` without its
/// feature, `cuda` without its feature or without a loadable NVIDIA driver.
pub fn check_backend(name: &str) -> anyhow::Result<()> {
    match name {
        "wgpu" if !cfg!(feature = "wgpu") => make_wgpu_unavailable(),
        "cuda" => match rolloutpipe_backends::cuda::availability() {
            Some(why) => anyhow::bail!("run.backend \"cuda\": {why}"),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

fn make_wgpu_unavailable() -> anyhow::Result<()> {
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

#[cfg(not(feature = "wgpu"))]
fn make_wgpu(_cfg: &ModelConfig, _w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    anyhow::bail!(
        "the wgpu backend is not built into this binary; rebuild with `--features wgpu` \
         (it is a default feature) or use --backend cpu"
    )
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
    /// Replace the weights (between steps, nothing in flight) with a snapshot made for this
    /// engine's [`SyncTarget`].
    Sync(Arc<WeightSnapshot>, PolicyVersion),
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

/// Packs a request id into an engine key; the step is implied (one step per engine at a time).
fn key_of(r: RequestId) -> RequestKey {
    RequestKey(((r.group.0 as u64) << 24) | ((r.sample as u64) << 8) | r.attempt as u64)
}

/// Runs one rollout engine until `Shutdown`.
pub fn engine_thread(
    engine: u16,
    mut backend: EngineBackend,
    rx: Receiver<EngineCmd>,
    events: Sender<Event>,
    fail_at_request: Option<u64>,
) {
    let mut version = PolicyVersion(0);
    let mut active: HashMap<RequestKey, (RequestId, Instant)> = HashMap::new();
    let mut decode: Vec<(u32, f64)> = Vec::new();
    let mut added = 0u64;
    let mut dead = false;
    loop {
        // Block only when idle; while generating, take whatever arrived and keep decoding.
        let first = if active.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            None
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            let be = backend.as_dyn();
            match cmd {
                EngineCmd::Shutdown => return,
                EngineCmd::Add { rid, .. } if dead => {
                    // A request sent before the scheduler saw the failure is lost as well.
                    let _ = events.send(Event::EngineFailed {
                        engine,
                        lost: vec![rid],
                    });
                }
                EngineCmd::Add {
                    rid,
                    prompt,
                    params,
                } => {
                    added += 1;
                    let key = key_of(rid);
                    let req = GenRequest {
                        id: key,
                        prompt: prompt.as_ref().clone(),
                        params,
                    };
                    if let Err(e) = be.add_request(req) {
                        let _ = events.send(Event::Fatal(format!("engine {engine}: {e}")));
                        return;
                    }
                    active.insert(key, (rid, Instant::now()));
                    if fail_at_request == Some(added) {
                        // Injected failure: every running request is lost and the engine
                        // stops generating (its backend state is gone with it).
                        dead = true;
                        let lost: Vec<RequestId> = active.drain().map(|(_, v)| v.0).collect();
                        for r in &lost {
                            let _ = be.cancel_request(key_of(*r));
                        }
                        tracing::warn!(engine, lost = lost.len(), "injected engine failure");
                        let _ = events.send(Event::EngineFailed { engine, lost });
                    }
                }
                EngineCmd::Cancel(rid) => {
                    let key = key_of(rid);
                    // A request that already finished was reported; the core discards it.
                    if active.remove(&key).is_some() {
                        if let Err(e) = be.cancel_request(key) {
                            let _ = events.send(Event::Fatal(format!("engine {engine}: {e}")));
                            return;
                        }
                        let _ = events.send(Event::Aborted { rid });
                    }
                }
                EngineCmd::Sync(w, v) => {
                    if !dead && let Err(e) = be.load_weights(&w) {
                        let _ = events.send(Event::Fatal(format!("engine {engine} sync: {e}")));
                        return;
                    }
                    version = v;
                    let _ = events.send(Event::Synced {
                        engine,
                        decode: std::mem::take(&mut decode),
                    });
                }
            }
        }
        if active.is_empty() {
            continue;
        }
        let be = backend.as_dyn();
        let running = be.active_requests() as u32;
        let t = Instant::now();
        let out = match be.decode_step() {
            Ok(o) => o,
            Err(e) => {
                let _ = events.send(Event::Fatal(format!("engine {engine} decode: {e}")));
                return;
            }
        };
        decode.push((running, t.elapsed().as_secs_f64()));
        for o in out {
            if let Some((rid, started)) = active.remove(&o.id) {
                let _ = events.send(Event::Generated {
                    engine,
                    rid,
                    version,
                    tokens: o.tokens,
                    logprobs: o.logprobs,
                    started,
                });
            }
        }
    }
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

/// Reward and correctness of a response; undecodable tokens count as a malformed answer.
pub fn score(task: &dyn Task, tok: &dyn Tokenizer, p: &Problem, tokens: &[u32]) -> (f32, bool) {
    match tok.decode(tokens) {
        Ok(text) => {
            let text = text.trim();
            (task.reward(p, text), task.verify(p, text).is_correct())
        }
        Err(_) => (-task.format_penalty(), false),
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
    mut backend: TrainerBackend,
    mut setup: TrainerSetup,
    rx: Receiver<TrainCmd>,
    events: Sender<Event>,
) {
    let mut since_opt: Vec<TrainBatch> = Vec::new();
    let mut accum = AccumStats::default();
    if let Err(e) = backend.as_dyn().zero_grad() {
        let _ = events.send(Event::Fatal(format!("trainer: {e}")));
        return;
    }
    while let Ok(cmd) = rx.recv() {
        let reply = match cmd {
            TrainCmd::Shutdown => return,
            TrainCmd::MicroBatch(groups) => {
                let started = Instant::now();
                match train_micro_batch(&mut backend, &mut setup, groups) {
                    Ok((batch, stats)) => {
                        let tokens = batch.response_tokens();
                        let all_tokens = batch
                            .sequences
                            .iter()
                            .map(|s| s.prompt.len() + s.response.len())
                            .sum();
                        accum.merge(&stats);
                        since_opt.push(batch);
                        TrainerReply::MicroBatchDone {
                            stats,
                            tokens,
                            all_tokens,
                            started,
                            ended: Instant::now(),
                        }
                    }
                    Err(e) => {
                        let _ = events.send(Event::Fatal(format!("trainer: {e:#}")));
                        return;
                    }
                }
            }
            TrainCmd::OptStep => {
                let started = Instant::now();
                // The normaliser of the whole optimizer step, known only now (SPEC §2).
                let norm = normalizer(setup.agg, &since_opt);
                let be = backend.as_dyn();
                match be
                    .optimizer_step(norm, &setup.opt)
                    .and_then(|st| be.zero_grad().map(|()| st))
                {
                    Ok(stats) => {
                        since_opt.clear();
                        TrainerReply::OptDone {
                            stats,
                            accum: std::mem::take(&mut accum),
                            normalizer: norm,
                            started,
                            ended: Instant::now(),
                        }
                    }
                    Err(e) => {
                        let _ = events.send(Event::Fatal(format!("trainer optimizer step: {e}")));
                        return;
                    }
                }
            }
            TrainCmd::Export { optimizer } => match backend.0.export_weights().and_then(|w| {
                let adam = if optimizer {
                    Some(backend.0.checkpoint_optimizer()?)
                } else {
                    None
                };
                Ok((w, adam))
            }) {
                Ok((w, adam)) => TrainerReply::Exported(Arc::new(w), adam),
                Err(e) => {
                    let _ = events.send(Event::Fatal(format!("trainer export: {e}")));
                    return;
                }
            },
        };
        if events.send(Event::Trainer(reply)).is_err() {
            return;
        }
    }
}

/// Builds the micro-batch's sequences (groups in id order, so the summation order does not
/// depend on which group happened to finish first) and accumulates their gradient.
fn train_micro_batch(
    backend: &mut TrainerBackend,
    setup: &mut TrainerSetup,
    mut groups: Vec<GroupBatch>,
) -> anyhow::Result<(TrainBatch, AccumStats)> {
    groups.sort_by_key(|g| (g.step, g.group));
    let mut batch = TrainBatch::default();
    for g in &groups {
        let rewards: Vec<f64> = g.samples.iter().map(|s| s.reward as f64).collect();
        let adv = advantages(&rewards, setup.std)?;
        for (s, a) in g.samples.iter().zip(adv) {
            let mut seq = TrainSequence::new(g.prompt.to_vec(), s.tokens.clone(), a, setup.agg);
            if setup.rollout_logprobs {
                seq.old_logprobs = Some(s.logprobs.clone());
            }
            batch.sequences.push(seq);
        }
    }
    if let Some(reference) = setup.reference.as_mut() {
        let seqs: Vec<Sequence> = batch
            .sequences
            .iter()
            .map(|s| Sequence {
                prompt: s.prompt.clone(),
                response: s.response.clone(),
            })
            .collect();
        let lps = reference.as_dyn().logprobs(&seqs, setup.temperature)?;
        for (s, lp) in batch.sequences.iter_mut().zip(lps) {
            s.ref_logprobs = Some(lp);
        }
    }
    let stats = backend.as_dyn().accumulate(&batch, &setup.objective)?;
    Ok((batch, stats))
}
