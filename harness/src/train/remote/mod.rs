//! Remote workers: hosts that own a worker's state and answer wire messages (bytes in, bytes
//! out), and the [`Forwarding`] transport that drives them through any `send` function.
//!
//! A host ([`EngineHost`], [`TrainerHost`], [`VerifierHost`]) lives wherever the work runs (a
//! Ray actor, another thread) and calls the same `steps` code as the in-process workers. The
//! scheduler side puts a proxy thread behind each of the run's channels; a proxy turns commands
//! into `wire` messages, hands them to the caller's `send(route, bytes) -> bytes`, and turns the
//! replies back into scheduler events, so the scheduler cannot tell the transports apart.
//!
//! Weight sync is "put once": at a step boundary the master weights are serialised once and
//! handed to `send(Route::Publish, blob)` (Ray: one `ray.put`); each engine is then sent a
//! small `Sync` on `Route::EngineSync(i)`, whose host reads the published blob (Ray: one get
//! per engine).
//!
//! A `send` that fails for an engine means the engine is gone (its process died, its node
//! left): its in-flight requests come back as preempted and the scheduler re-admits them
//! elsewhere with the same ids. A failing trainer or verifier stops the run (a trainer is
//! recovered by resuming from the last checkpoint).
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use rolloutpipe_backends::{ModelConfig, OptStats, Sequence, Weights};

use super::config::TrainConfig;
use super::data;
use super::steps::{EngineOut, EngineStep, TrainerStep, score, trainer_setup};
use super::transport::{EngineLink, Start, Transport, Workers, fail_at};
use super::wire::{
    self, EngineMsg, EngineReply, TrainerAnswer, TrainerMsg, VerifierMsg, VerifierReply, WireAdd,
    WireError, WireGroup, WireJob, WireLogprobs, WireOut, WireResume, WireScore,
};
use super::workers::{
    EngineOptions, EngineReference, Event, TrainCmd, TrainerReply, VerifyJob, make_engine,
    make_trainer,
};
use crate::tasks::{Task, Tokenizer};

mod engine_proxy;
use engine_proxy::EngineProxy;

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Engine i's control messages (`engine/i`).
    Engine(u16),
    /// Engine i's messages that read the published weights (`engine/i/sync`: init and sync).
    EngineSync(u16),
    /// Verifier i (`verifier/i`).
    Verifier(usize),
    /// The trainer (`trainer`).
    Trainer,
    /// The weights blob every engine of the next `EngineSync` reads (`publish`).
    Publish,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Route::Engine(i) => write!(f, "engine/{i}"),
            Route::EngineSync(i) => write!(f, "engine/{i}/sync"),
            Route::Verifier(i) => write!(f, "verifier/{i}"),
            Route::Trainer => write!(f, "trainer"),
            Route::Publish => write!(f, "publish"),
        }
    }
}

impl From<EngineOut> for WireOut {
    fn from(o: EngineOut) -> Self {
        match o {
            EngineOut::Generated {
                rid,
                version,
                tokens,
                logprobs,
            } => WireOut::Generated {
                rid,
                version,
                tokens,
                logprobs,
            },
            EngineOut::Aborted(r) => WireOut::Aborted(r),
            EngineOut::Lost(l) => WireOut::Lost(l),
        }
    }
}

impl From<WireOut> for EngineOut {
    fn from(o: WireOut) -> Self {
        match o {
            WireOut::Generated {
                rid,
                version,
                tokens,
                logprobs,
            } => EngineOut::Generated {
                rid,
                version,
                tokens,
                logprobs,
            },
            WireOut::Aborted(r) => EngineOut::Aborted(r),
            WireOut::Lost(l) => EngineOut::Lost(l),
        }
    }
}

fn model_config(v: &serde_json::Value) -> anyhow::Result<ModelConfig> {
    ModelConfig::from_json_str(&v.to_string()).context("the model's config.json")
}

fn not_ready(who: &str) -> anyhow::Error {
    anyhow!("the {who} host has not been initialised (send Init first)")
}

/// A rollout engine that answers [`EngineMsg`]s.
#[derive(Default)]
pub struct EngineHost {
    step: Option<EngineStep>,
    /// Tail multiplexing: the engine's reference model.
    reference: Option<EngineReference>,
}

impl EngineHost {
    /// A host with no engine yet (the first message is `Init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers one message. `published` is the last published weights blob (`Init` and
    /// `Sync` read it). Worker failures are answered as `Fatal`; only a malformed or
    /// out-of-order message is an `Err`.
    pub fn handle(&mut self, msg: &[u8], published: Option<&[u8]>) -> anyhow::Result<Vec<u8>> {
        let (msg, parts): (EngineMsg, _) = wire::decode(msg)?;
        let reply = match msg {
            EngineMsg::Init {
                engine,
                backend,
                threads,
                dtype,
                model,
                fail_at_request,
                reference,
                perturb_mux,
                tensor_cores,
                lookahead,
            } => {
                let blob = published.ok_or(WireError::Missing("published weights"))?;
                let w = wire::weights_from(blob, "weights")?;
                let mc = model_config(&model)?;
                let ref_w = match reference {
                    true => Some(wire::weights_from(
                        parts
                            .first()
                            .ok_or(WireError::Missing("reference weights"))?,
                        "reference weights",
                    )?),
                    false => None,
                };
                let made = super::config::engine_dtype(&dtype)
                    .and_then(|dtype| {
                        let opts = EngineOptions {
                            threads,
                            dtype,
                            tensor_cores,
                            lookahead,
                        };
                        make_engine(&backend, &mc, &w, &opts)
                    })
                    .and_then(|be| {
                        let r = ref_w
                            .map(|r| -> anyhow::Result<EngineReference> {
                                Ok(EngineReference {
                                    backend: make_trainer("cpu", &mc, &r, threads, false)?,
                                    perturb: perturb_mux,
                                })
                            })
                            .transpose()?;
                        Ok((be, r))
                    });
                match made {
                    Ok((be, r)) => {
                        self.step = Some(EngineStep::new(engine, be, fail_at_request));
                        self.reference = r;
                        EngineReply::Ready
                    }
                    Err(e) => EngineReply::Fatal(format!("rollout engine {engine}: {e:#}")),
                }
            }
            EngineMsg::RefLogprobs { seqs, temperature } => {
                self.step.as_ref().ok_or_else(|| not_ready("engine"))?;
                let r = self
                    .reference
                    .as_mut()
                    .ok_or(WireError::Missing("reference model (Init had none)"))?;
                let seqs: Vec<Sequence> = (seqs.into_iter())
                    .map(|(prompt, response)| Sequence { prompt, response })
                    .collect();
                match r.logprobs(&seqs, temperature) {
                    Ok(lps) => EngineReply::RefLogprobs {
                        logprobs: lps.into_iter().map(WireLogprobs).collect(),
                    },
                    Err(e) => EngineReply::Fatal(format!("reference pass: {e:#}")),
                }
            }
            EngineMsg::Step {
                adds,
                resumes,
                cancels,
                decode,
            } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("engine"))?;
                let run = || -> anyhow::Result<Vec<WireOut>> {
                    let mut outs = Vec::new();
                    for WireAdd {
                        rid,
                        prompt,
                        params,
                    } in adds
                    {
                        outs.extend(step.add(rid, prompt, params.into())?.map(WireOut::from));
                    }
                    for r in resumes {
                        let (rid, st) = r.into_state();
                        outs.extend(step.resume(rid, st)?.map(WireOut::from));
                    }
                    for rid in cancels {
                        outs.extend(step.cancel(rid)?.map(WireOut::from));
                    }
                    if decode {
                        outs.extend(step.decode()?.into_iter().map(WireOut::from));
                    }
                    Ok(outs)
                };
                match run() {
                    Ok(outs) => EngineReply::Stepped {
                        outs,
                        active: step.active(),
                        reprefilled: step.take_reprefilled(),
                    },
                    Err(e) => EngineReply::Fatal(e.to_string()),
                }
            }
            EngineMsg::Migrate { min_generated } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("engine"))?;
                match step.migrate_out(min_generated) {
                    Ok(moved) => EngineReply::Migrated {
                        moved: moved.map(|(rid, st)| WireResume::new(rid, st)),
                    },
                    Err(e) => EngineReply::Fatal(e.to_string()),
                }
            }
            EngineMsg::Sync { version } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("engine"))?;
                let blob = published.ok_or(WireError::Missing("published weights"))?;
                let w = wire::weights_from(blob, "weights")?;
                match step.sync_master(&w, version) {
                    Ok(decode) => EngineReply::Synced { decode },
                    Err(e) => EngineReply::Fatal(e.to_string()),
                }
            }
        };
        Ok(wire::encode(&reply, &[]))
    }
}

/// The trainer, answering [`TrainerMsg`]s.
#[derive(Default)]
pub struct TrainerHost {
    step: Option<TrainerStep>,
}

impl TrainerHost {
    /// A host with no trainer yet (the first message is `Init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers one message (see [`EngineHost::handle`] for what is an error).
    pub fn handle(&mut self, msg: &[u8]) -> anyhow::Result<Vec<u8>> {
        let (msg, parts): (TrainerMsg, _) = wire::decode(msg)?;
        let t = Instant::now();
        let fatal = |e: anyhow::Error| -> anyhow::Result<Vec<u8>> {
            // The whole chain ("trainer.tensor_cores: adapter … lacks …"), on one line.
            Ok(wire::encode(
                &TrainerAnswer::Fatal(format!("trainer: {e:#}")),
                &[],
            ))
        };
        let answer = match msg {
            TrainerMsg::Init {
                config,
                model,
                adam_step,
                reference,
            } => {
                let mut parts = parts.into_iter();
                let w = wire::weights_from(
                    parts.next().ok_or(WireError::Missing("weights"))?,
                    "weights",
                )?;
                let adam = match adam_step {
                    Some(step) => Some(wire::adam_from(
                        parts.next().ok_or(WireError::Missing("optimizer"))?,
                        step,
                    )?),
                    None => None,
                };
                let reference = if reference {
                    Some(wire::weights_from(
                        parts.next().ok_or(WireError::Missing("reference"))?,
                        "reference",
                    )?)
                } else {
                    None
                };
                let mc = model_config(&model)?;
                let built = (|| {
                    let t = &config.trainer;
                    let mut be =
                        make_trainer(&config.run.backend, &mc, &w, t.threads, t.tensor_cores)?;
                    if let Some(a) = adam {
                        be.set_optimizer_state(a)?;
                    }
                    let setup = trainer_setup(&config, &mc, reference.as_ref())?;
                    TrainerStep::new(be, setup)
                })();
                match built {
                    Ok(s) => {
                        self.step = Some(s);
                        TrainerAnswer::Ready
                    }
                    Err(e) => return fatal(e),
                }
            }
            TrainerMsg::MicroBatch(groups) => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("trainer"))?;
                match step.micro_batch(groups.into_iter().map(Into::into).collect()) {
                    Ok(m) => TrainerAnswer::MicroBatchDone {
                        stats: (&m.stats).into(),
                        tokens: m.tokens,
                        all_tokens: m.all_tokens,
                        secs: t.elapsed().as_secs_f64(),
                    },
                    Err(e) => return fatal(e),
                }
            }
            TrainerMsg::OptStep => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("trainer"))?;
                match step.opt_step() {
                    Ok(d) => TrainerAnswer::opt_done(
                        &d.stats,
                        &d.accum,
                        d.normalizer,
                        t.elapsed().as_secs_f64(),
                    ),
                    Err(e) => return fatal(e),
                }
            }
            TrainerMsg::Export { optimizer } => {
                let step = self.step.as_mut().ok_or_else(|| not_ready("trainer"))?;
                let (w, adam) = match step.export(optimizer) {
                    Ok(x) => x,
                    Err(e) => return fatal(e),
                };
                let wb = wire::weights_blob(&w)?;
                let answer = TrainerAnswer::Exported {
                    adam_step: adam.as_ref().map(|a| a.step),
                };
                return Ok(match adam {
                    Some(a) => wire::encode(&answer, &[&wb, &wire::adam_blob(&a)?]),
                    None => wire::encode(&answer, &[&wb]),
                });
            }
        };
        Ok(wire::encode(&answer, &[]))
    }
}

/// A verifier, answering [`VerifierMsg`]s.
#[derive(Default)]
pub struct VerifierHost {
    task: Option<(Arc<dyn Task>, Arc<dyn Tokenizer>)>,
}

impl VerifierHost {
    /// A host with no task yet (the first message is `Init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Answers one message (see [`EngineHost::handle`] for what is an error).
    pub fn handle(&mut self, msg: &[u8]) -> anyhow::Result<Vec<u8>> {
        let (msg, _): (VerifierMsg, _) = wire::decode(msg)?;
        let reply = match msg {
            VerifierMsg::Init { config } => {
                match data::tokenizer(&config).and_then(|tok| Ok((data::task(&config)?, tok))) {
                    Ok(t) => {
                        self.task = Some(t);
                        VerifierReply::Ready
                    }
                    Err(e) => VerifierReply::Fatal(format!("verifier: {e:#}")),
                }
            }
            VerifierMsg::Score(jobs) => {
                let (task, tok) = self.task.as_ref().ok_or_else(|| not_ready("verifier"))?;
                VerifierReply::Scored(
                    jobs.into_iter()
                        .map(|j| {
                            let t = Instant::now();
                            let (reward, correct) =
                                score(task.as_ref(), tok.as_ref(), &j.problem, &j.tokens);
                            WireScore {
                                rid: j.rid,
                                reward,
                                correct,
                                secs: t.elapsed().as_secs_f64(),
                            }
                        })
                        .collect(),
                )
            }
        };
        Ok(wire::encode(&reply, &[]))
    }
}

/// The caller's transport: delivers `bytes` to the host at `route` and returns its reply.
pub type SendFn = dyn Fn(&Route, Vec<u8>) -> anyhow::Result<Vec<u8>> + Send + Sync;

/// What crossed the transport so far (both directions, every route).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireCounts {
    /// Messages sent (publishes included).
    pub calls: u64,
    /// Bytes sent, publishes excluded.
    pub bytes_out: u64,
    /// Bytes received.
    pub bytes_in: u64,
    /// Weight blobs published.
    pub publishes: u64,
    /// Bytes published.
    pub published_bytes: u64,
}

#[derive(Default)]
struct Counts {
    calls: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
    publishes: AtomicU64,
    published_bytes: AtomicU64,
}

#[derive(Clone)]
struct Link {
    send: Arc<SendFn>,
    counts: Arc<Counts>,
}

impl Link {
    fn call(&self, route: &Route, msg: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        let c = &self.counts;
        c.calls.fetch_add(1, Ordering::Relaxed);
        if *route == Route::Publish {
            c.publishes.fetch_add(1, Ordering::Relaxed);
            c.published_bytes
                .fetch_add(msg.len() as u64, Ordering::Relaxed);
        } else {
            c.bytes_out.fetch_add(msg.len() as u64, Ordering::Relaxed);
        }
        let reply = (self.send)(route, msg).with_context(|| format!("{route}"))?;
        c.bytes_in.fetch_add(reply.len() as u64, Ordering::Relaxed);
        Ok(reply)
    }
}

/// Serialises and publishes each new master weights once, however many engines sync from it.
struct Publisher {
    link: Link,
    last: Mutex<Option<Arc<Weights>>>,
}

impl Publisher {
    fn publish(&self, w: &Arc<Weights>) -> anyhow::Result<()> {
        // Held while serialising: the other engines' proxies wait and then find it published.
        let mut last = self
            .last
            .lock()
            .map_err(|_| anyhow!("publisher poisoned"))?;
        if last.as_ref().is_some_and(|l| Arc::ptr_eq(l, w)) {
            return Ok(());
        }
        let blob = wire::weights_blob(w)?;
        self.link.call(&Route::Publish, blob)?;
        *last = Some(w.clone());
        Ok(())
    }
}

/// The workers are remote hosts reached through a caller-supplied `send`; see the module
/// documentation.
pub struct Forwarding {
    link: Link,
}

impl Forwarding {
    /// A transport over `send`.
    pub fn new(
        send: impl Fn(&Route, Vec<u8>) -> anyhow::Result<Vec<u8>> + Send + Sync + 'static,
    ) -> Self {
        Forwarding {
            link: Link {
                send: Arc::new(send),
                counts: Arc::default(),
            },
        }
    }

    /// What has crossed the transport so far.
    pub fn counts(&self) -> WireCounts {
        let c = &self.link.counts;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WireCounts {
            calls: g(&c.calls),
            bytes_out: g(&c.bytes_out),
            bytes_in: g(&c.bytes_in),
            publishes: g(&c.publishes),
            published_bytes: g(&c.published_bytes),
        }
    }
}

impl Transport for Forwarding {
    fn start(&self, s: Start<'_>) -> anyhow::Result<Workers> {
        let cfg = s.cfg;
        // Tail multiplexing: each engine host gets the reference weights for a model of its own.
        let reference = match s.reference {
            Some(r) if cfg.rollout.multiplex => Some(wire::weights_blob(r)?),
            _ => None,
        };
        let link = self.link.clone();
        let publisher = Arc::new(Publisher {
            link: link.clone(),
            last: Mutex::new(None),
        });
        publisher.publish(s.weights)?;
        let model = s.model_cfg.to_json();
        let mut handles = Vec::new();
        let mut engines = Vec::new();
        for e in 0..cfg.rollout.engines {
            let init = EngineMsg::Init {
                engine: e,
                backend: cfg.run.backend.clone(),
                threads: cfg.rollout.threads_per_engine,
                dtype: cfg.rollout.dtype.clone(),
                model: model.clone(),
                fail_at_request: fail_at(cfg, e),
                reference: reference.is_some(),
                perturb_mux: cfg.fault.perturb_mux,
                tensor_cores: cfg.rollout.tensor_cores,
                lookahead: cfg.rollout.lookahead,
            };
            let parts: Vec<&[u8]> = reference.iter().map(Vec::as_slice).collect();
            let reply = link.call(&Route::EngineSync(e), wire::encode(&init, &parts))?;
            match wire::decode::<EngineReply>(&reply)?.0 {
                EngineReply::Ready => {}
                EngineReply::Fatal(m) => bail!("{m}"),
                other => bail!("engine {e} answered {other:?} to Init"),
            }
            let (tx, rx) = mpsc::channel();
            let mut proxy = EngineProxy {
                engine: e,
                link: link.clone(),
                publisher: publisher.clone(),
                events: s.events.clone(),
                started: HashMap::new(),
                dead: false,
            };
            handles.push(
                std::thread::Builder::new()
                    .name(format!("engine-proxy-{e}"))
                    .spawn(move || proxy.run(rx))?,
            );
            engines.push(EngineLink { tx, target: None });
        }
        let (vtx, vrx) = mpsc::channel::<VerifyJob>();
        let vrx = Arc::new(Mutex::new(vrx));
        for i in 0..cfg.rollout.verifiers {
            let init = VerifierMsg::Init {
                config: Box::new(cfg.clone()),
            };
            let reply = link.call(&Route::Verifier(i), wire::encode(&init, &[]))?;
            match wire::decode::<VerifierReply>(&reply)?.0 {
                VerifierReply::Ready => {}
                VerifierReply::Fatal(m) => bail!("{m}"),
                other => bail!("verifier {i} answered {other:?} to Init"),
            }
            let (link, jobs, events) = (link.clone(), vrx.clone(), s.events.clone());
            handles.push(
                std::thread::Builder::new()
                    .name(format!("verifier-proxy-{i}"))
                    .spawn(move || verifier_proxy(i, link, jobs, events))?,
            );
        }
        init_trainer(&link, &s)?;
        let (ttx, trx) = mpsc::channel();
        let (tlink, events) = (link.clone(), s.events);
        handles.push(
            std::thread::Builder::new()
                .name("trainer-proxy".into())
                .spawn(move || trainer_proxy(tlink, trx, events))?,
        );
        Ok(Workers {
            engines,
            verify: vtx,
            trainer: ttx,
            handles,
        })
    }
}

fn init_trainer(link: &Link, s: &Start<'_>) -> anyhow::Result<()> {
    let init = TrainerMsg::Init {
        config: Box::new(s.cfg.clone()),
        model: s.model_cfg.to_json(),
        adam_step: s.adam.as_ref().map(|a| a.step),
        reference: s.reference.is_some(),
    };
    let mut parts = vec![wire::weights_blob(s.weights)?];
    if let Some(a) = &s.adam {
        parts.push(wire::adam_blob(a)?);
    }
    if let Some(r) = s.reference {
        parts.push(wire::weights_blob(r)?);
    }
    let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let reply = link.call(&Route::Trainer, wire::encode(&init, &refs))?;
    match wire::decode::<TrainerAnswer>(&reply)?.0 {
        TrainerAnswer::Ready => Ok(()),
        TrainerAnswer::Fatal(m) => bail!("{m}"),
        other => bail!("the trainer answered {other:?} to Init"),
    }
}

/// Most responses one verifier message carries.
const VERIFY_BATCH: usize = 64;

fn verifier_proxy(
    i: usize,
    link: Link,
    jobs: Arc<Mutex<Receiver<VerifyJob>>>,
    events: Sender<Event>,
) {
    loop {
        // Whatever is waiting goes in one message (one round trip for many responses).
        let batch: Vec<VerifyJob> = {
            let Ok(rx) = jobs.lock() else { return };
            let Ok(first) = rx.recv() else { return };
            let mut b = vec![first];
            while b.len() < VERIFY_BATCH {
                match rx.try_recv() {
                    Ok(j) => b.push(j),
                    Err(_) => break,
                }
            }
            b
        };
        let msg = VerifierMsg::Score(
            batch
                .into_iter()
                .map(|j| WireJob {
                    rid: j.rid,
                    problem: j.problem.as_ref().clone(),
                    tokens: j.tokens,
                })
                .collect(),
        );
        let reply = link
            .call(&Route::Verifier(i), wire::encode(&msg, &[]))
            .and_then(|b| Ok(wire::decode::<VerifierReply>(&b)?.0));
        match reply {
            Ok(VerifierReply::Scored(scores)) => {
                for s in scores {
                    let _ = events.send(Event::Rewarded {
                        rid: s.rid,
                        reward: s.reward,
                        correct: s.correct,
                        latency: Duration::from_secs_f64(s.secs.max(0.0)),
                    });
                }
            }
            Ok(VerifierReply::Fatal(m)) => {
                let _ = events.send(Event::Fatal(m));
                return;
            }
            Ok(other) => {
                let _ = events.send(Event::Fatal(format!(
                    "verifier {i} answered {other:?} to Score"
                )));
                return;
            }
            Err(e) => {
                let _ = events.send(Event::Fatal(format!("verifier {i}: {e:#}")));
                return;
            }
        }
    }
}

fn trainer_proxy(link: Link, rx: Receiver<TrainCmd>, events: Sender<Event>) {
    while let Ok(cmd) = rx.recv() {
        let sent = Instant::now();
        let msg = match cmd {
            TrainCmd::Shutdown => return,
            TrainCmd::MicroBatch(groups) => {
                TrainerMsg::MicroBatch(groups.iter().map(WireGroup::from).collect())
            }
            TrainCmd::OptStep => TrainerMsg::OptStep,
            TrainCmd::Export { optimizer } => TrainerMsg::Export { optimizer },
        };
        let reply = link
            .call(&Route::Trainer, wire::encode(&msg, &[]))
            .and_then(|b| trainer_reply(&b, sent));
        let ev = match reply {
            Ok(r) => Event::Trainer(r),
            Err(e) => Event::Fatal(format!("trainer: {e:#}")),
        };
        let stop = matches!(ev, Event::Fatal(_));
        if events.send(ev).is_err() || stop {
            return;
        }
    }
}

/// The scheduler's form of a trainer answer; the work's span ends now and lasted what the
/// host measured (the rest of the round trip is transport).
fn trainer_reply(bytes: &[u8], sent: Instant) -> anyhow::Result<TrainerReply> {
    let (answer, parts): (TrainerAnswer, _) = wire::decode(bytes)?;
    let ended = Instant::now();
    let span = |secs: f64| {
        ended
            .checked_sub(Duration::from_secs_f64(secs.max(0.0)))
            .unwrap_or(sent)
            .max(sent)
    };
    Ok(match answer {
        TrainerAnswer::MicroBatchDone {
            stats,
            tokens,
            all_tokens,
            secs,
        } => TrainerReply::MicroBatchDone {
            stats: stats.into(),
            tokens,
            all_tokens,
            started: span(secs),
            ended,
        },
        TrainerAnswer::OptDone {
            grad_norm,
            clip_scale,
            step,
            accum,
            normalizer,
            secs,
        } => TrainerReply::OptDone {
            stats: OptStats {
                grad_norm,
                clip_scale,
                step,
            },
            accum: accum.into(),
            normalizer,
            started: span(secs),
            ended,
        },
        TrainerAnswer::Exported { adam_step } => {
            let w = wire::weights_from(
                parts.first().ok_or(WireError::Missing("weights"))?,
                "weights",
            )?;
            let adam = match adam_step {
                Some(step) => Some(wire::adam_from(
                    parts.get(1).ok_or(WireError::Missing("optimizer"))?,
                    step,
                )?),
                None => None,
            };
            TrainerReply::Exported(Arc::new(w), adam)
        }
        TrainerAnswer::Fatal(m) => bail!("{m}"),
        TrainerAnswer::Ready => bail!("the trainer answered Ready to a command"),
    })
}

fn poisoned<T>(route: &Route) -> impl FnOnce(std::sync::PoisonError<T>) -> anyhow::Error + '_ {
    move |_| anyhow!("{route}: host poisoned")
}

/// Every host in this process behind the wire: what a Ray deployment runs, without Ray. Each
/// message is encoded, handed over as bytes and decoded by its host, so tests exercise the
/// real protocol. `kill_engine` makes an engine vanish as a killed actor does.
pub struct Loopback {
    engines: Vec<Mutex<Option<EngineHost>>>,
    verifiers: Vec<Mutex<VerifierHost>>,
    trainer: Mutex<TrainerHost>,
    published: Mutex<Option<Arc<Vec<u8>>>>,
    /// Per engine: kill it when its `Step` message number n arrives (0: never).
    kill_at_step: Vec<AtomicU64>,
    steps_seen: Vec<AtomicU64>,
}

impl Loopback {
    /// Hosts for the engines and verifiers of `cfg`, and the trainer.
    pub fn new(cfg: &TrainConfig) -> Arc<Self> {
        let e = cfg.rollout.engines as usize;
        Arc::new(Loopback {
            engines: (0..e)
                .map(|_| Mutex::new(Some(EngineHost::new())))
                .collect(),
            verifiers: (0..cfg.rollout.verifiers)
                .map(|_| Mutex::new(VerifierHost::new()))
                .collect(),
            trainer: Mutex::new(TrainerHost::new()),
            published: Mutex::new(None),
            kill_at_step: (0..e).map(|_| AtomicU64::new(0)).collect(),
            steps_seen: (0..e).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// A [`Forwarding`] transport whose `send` calls these hosts.
    pub fn transport(self: &Arc<Self>) -> Forwarding {
        let me = self.clone();
        Forwarding::new(move |route, msg| me.call(route, msg))
    }

    /// Engine `i` is gone from now on (its state dropped, every message to it fails).
    pub fn kill_engine(&self, i: u16) {
        if let Some(e) = self.engines.get(i as usize)
            && let Ok(mut g) = e.lock()
        {
            *g = None;
        }
    }

    /// Engine `i` dies when its `n`-th `Step` message arrives (that message fails): a kill in
    /// the middle of a rollout, at a reproducible point.
    pub fn kill_engine_at_step(&self, i: u16, n: u64) {
        if let Some(k) = self.kill_at_step.get(i as usize) {
            k.store(n, Ordering::Relaxed);
        }
    }

    /// Whether engine `i` still runs.
    pub fn engine_alive(&self, i: u16) -> bool {
        self.engines
            .get(i as usize)
            .and_then(|e| e.lock().ok().map(|g| g.is_some()))
            .unwrap_or(false)
    }

    fn call(&self, route: &Route, msg: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        match *route {
            Route::Publish => {
                *self.published.lock().map_err(poisoned(route))? = Some(Arc::new(msg));
                Ok(Vec::new())
            }
            Route::Engine(i) | Route::EngineSync(i) => {
                let slot = self
                    .engines
                    .get(i as usize)
                    .ok_or_else(|| anyhow!("no engine {i}"))?;
                if let Route::Engine(_) = route {
                    let n = self.steps_seen[i as usize].fetch_add(1, Ordering::Relaxed) + 1;
                    if self.kill_at_step[i as usize].load(Ordering::Relaxed) == n {
                        self.kill_engine(i);
                    }
                }
                let published = match route {
                    Route::EngineSync(_) => self.published.lock().map_err(poisoned(route))?.clone(),
                    _ => None,
                };
                let mut g = slot.lock().map_err(poisoned(route))?;
                let host = g.as_mut().ok_or_else(|| anyhow!("engine {i} is gone"))?;
                host.handle(&msg, published.as_deref().map(Vec::as_slice))
            }
            Route::Verifier(i) => self
                .verifiers
                .get(i)
                .ok_or_else(|| anyhow!("no verifier {i}"))?
                .lock()
                .map_err(poisoned(route))?
                .handle(&msg),
            Route::Trainer => self.trainer.lock().map_err(poisoned(route))?.handle(&msg),
        }
    }
}
