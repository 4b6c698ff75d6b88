//! How `train` starts its workers and talks to them: the [`Transport`] seam.
//!
//! The scheduler thread always speaks the same channels (commands to each engine, verify jobs,
//! trainer commands; one event channel back). A transport decides what sits behind them:
//! [`Local`] (what `rolloutpipe train` runs) makes every worker a thread of this process;
//! `remote::Forwarding` puts a proxy thread behind each channel that forwards every message
//! over the wire to a host somewhere else (a Ray actor, or the hosts of a test). Either way
//! the work is done by the same worker code (`EngineStep`, `TrainerStep`, `score`).
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::Context;
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{ModelConfig, SyncTarget, Weights};

use super::backend::{make_engine, make_trainer};
use super::engine::{EngineReference, engine_thread};
use super::trainer::{trainer_setup, trainer_thread};
use super::verifier::verifier_thread;
use crate::tasks::{Task, Tokenizer};
use crate::train::config::TrainConfig;
use crate::train::msg::{EngineCmd, EngineOptions, Event, TrainCmd, VerifyJob};

/// What a transport needs to start a run's workers.
pub struct Start<'a> {
    /// The run's config (engines, verifiers, backend, threads, fault injection).
    pub cfg: &'a TrainConfig,
    /// The model's shape.
    pub model_cfg: &'a ModelConfig,
    /// The weights the engines and the trainer start from.
    pub weights: &'a Arc<Weights>,
    /// The trainer's AdamW moments (resumed runs).
    pub adam: Option<AdamState>,
    /// The KL reference model (`rl.beta > 0`).
    pub reference: Option<&'a Weights>,
    /// The task (its verifier).
    pub task: Arc<dyn Task>,
    /// The tokenizer (verifiers decode responses with it).
    pub tok: Arc<dyn Tokenizer>,
    /// Where every worker reports.
    pub events: Sender<Event>,
}

/// One engine as the scheduler sees it.
pub struct EngineLink {
    /// Its commands.
    pub tx: Sender<EngineCmd>,
    /// The device and dtype the scheduler makes its weight snapshots for; `None` when the
    /// engine is sent the master weights and converts them itself (a remote host).
    pub target: Option<SyncTarget>,
}

/// The channels to the started workers.
pub struct Links {
    /// One link per engine, by engine index.
    pub engines: Vec<EngineLink>,
    /// Responses to score.
    pub verify: Sender<VerifyJob>,
    /// The trainer's commands.
    pub trainer: Sender<TrainCmd>,
    /// Threads to join once the channels are closed.
    pub handles: Vec<JoinHandle<()>>,
}

/// Starts a run's workers behind the scheduler's channels.
pub trait Transport {
    /// Starts every engine, verifier and the trainer of `s.cfg`.
    fn start(&self, s: Start<'_>) -> anyhow::Result<Links>;

    /// Whether the workers run in this process, so that this machine's devices are checked
    /// before the run directory is touched; hosts elsewhere check their own at `Init`.
    fn workers_here(&self) -> bool {
        false
    }
}

/// Every worker is a thread of this process (what `rolloutpipe train` runs).
#[derive(Debug, Clone, Copy, Default)]
pub struct Local;

impl Transport for Local {
    fn workers_here(&self) -> bool {
        true
    }

    fn start(&self, s: Start<'_>) -> anyhow::Result<Links> {
        let cfg = s.cfg;
        let mut handles: Vec<JoinHandle<()>> = Vec::new();
        let mut engines = Vec::new();
        let opts = EngineOptions::of(cfg);
        for e in 0..cfg.rollout.engines {
            let be = make_engine(&cfg.run.backend, s.model_cfg, s.weights, &opts)
                .with_context(|| format!("rollout engine {e}"))?;
            let target = be.sync_target();
            let reference = engine_reference(cfg, s.model_cfg, s.reference)
                .with_context(|| format!("rollout engine {e}: reference model"))?;
            let (tx, rx) = mpsc::channel();
            let events = s.events.clone();
            let fail = fail_at(cfg, e);
            handles.push(
                std::thread::Builder::new()
                    .name(format!("engine-{e}"))
                    .spawn(move || engine_thread(e, be, rx, events, fail, reference))?,
            );
            engines.push(EngineLink {
                tx,
                target: Some(target),
            });
        }
        let (vtx, vrx) = mpsc::channel::<VerifyJob>();
        let vrx = Arc::new(Mutex::new(vrx));
        for i in 0..cfg.rollout.verifiers {
            let (task, tok, jobs, events) =
                (s.task.clone(), s.tok.clone(), vrx.clone(), s.events.clone());
            handles.push(
                std::thread::Builder::new()
                    .name(format!("verifier-{i}"))
                    .spawn(move || verifier_thread(task, tok, jobs, events))?,
            );
        }
        let mut trainer_be = make_trainer(
            &cfg.run.backend,
            s.model_cfg,
            s.weights,
            cfg.trainer.threads,
            cfg.trainer.tensor_cores,
        )?;
        if let Some(a) = s.adam {
            trainer_be.set_optimizer_state(a)?;
        }
        let setup = trainer_setup(cfg, s.model_cfg, s.reference)?;
        let (ttx, trx) = mpsc::channel();
        let events = s.events;
        handles.push(
            std::thread::Builder::new()
                .name("trainer".into())
                .spawn(move || trainer_thread(trainer_be, setup, trx, events))?,
        );
        Ok(Links {
            engines,
            verify: vtx,
            trainer: ttx,
            handles,
        })
    }
}

/// An engine's reference model when the run multiplexes (`rollout.multiplex`, `rl.beta > 0`):
/// the trainer's reference weights on an f32 CPU backend of its own (4 bytes per parameter per
/// engine), whatever `run.backend` and `rollout.dtype` are, so that its log-probs are the
/// trainer's bit for bit.
pub fn engine_reference(
    cfg: &TrainConfig,
    model_cfg: &ModelConfig,
    reference: Option<&Weights>,
) -> anyhow::Result<Option<EngineReference>> {
    match reference {
        Some(r) if cfg.rollout.multiplex => Ok(Some(EngineReference {
            backend: make_trainer("cpu", model_cfg, r, cfg.rollout.threads_per_engine, false)?,
            perturb: cfg.fault.perturb_mux,
        })),
        _ => Ok(None),
    }
}

/// The admission at which engine `e` fails (`fault.fail_engine_at_request`, engine 0 only).
pub fn fail_at(cfg: &TrainConfig, e: u16) -> Option<u64> {
    (e == 0 && cfg.fault.fail_engine_at_request > 0).then_some(cfg.fault.fail_engine_at_request)
}
