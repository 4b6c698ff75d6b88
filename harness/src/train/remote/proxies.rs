//! The scheduler's side of the remote hosts: each host is built by its `Init`, then a proxy
//! thread behind the run's channel forwards the run's messages to it and its answers back as
//! events. Engines have their own proxy (`engine_proxy`); the verifiers' and the trainer's are
//! here.
use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::bail;

use super::engine_proxy::EngineProxy;
use super::protocol::{
    EngineInit, EngineMsg, EngineReply, TrainerAnswer, TrainerInit, TrainerMsg, VerifierMsg,
    VerifierReply,
};
use super::wire::{self, WireError};
use super::{Link, Publisher, Route};
use crate::train::msg::{EngineOptions, Event, TrainCmd, TrainerReply, VerifyJob};
use crate::train::workers::transport::{EngineLink, Start, fail_at};

/// Builds every engine host and starts its proxy.
pub(super) fn start_engines(
    link: &Link,
    publisher: &Arc<Publisher>,
    s: &Start<'_>,
    handles: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<Vec<EngineLink>> {
    let cfg = s.cfg;
    // Tail multiplexing: each engine host gets the reference weights for a model of its own.
    let reference = match s.reference {
        Some(r) if cfg.rollout.multiplex => Some(wire::weights_blob(r)?),
        _ => None,
    };
    let model = s.model_cfg.to_json();
    let options = EngineOptions::of(cfg);
    let mut engines = Vec::new();
    for e in 0..cfg.rollout.engines {
        let init = EngineMsg::Init(Box::new(EngineInit {
            engine: e,
            backend: cfg.run.backend.clone(),
            options,
            model: model.clone(),
            fail_at_request: fail_at(cfg, e),
            reference: reference.is_some(),
            perturb_mux: cfg.fault.perturb_mux,
        }));
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
    Ok(engines)
}

/// Builds every verifier host and starts its proxy; the proxies share one job queue.
pub(super) fn start_verifiers(
    link: &Link,
    s: &Start<'_>,
    handles: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<Sender<VerifyJob>> {
    let (vtx, vrx) = mpsc::channel::<VerifyJob>();
    let vrx = Arc::new(Mutex::new(vrx));
    for i in 0..s.cfg.rollout.verifiers {
        let init = VerifierMsg::Init {
            config: Box::new(s.cfg.clone()),
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
    Ok(vtx)
}

/// Builds the trainer host (weights, moments and reference weights as parts) and starts its
/// proxy.
pub(super) fn start_trainer(
    link: &Link,
    s: Start<'_>,
    handles: &mut Vec<JoinHandle<()>>,
) -> anyhow::Result<Sender<TrainCmd>> {
    let init = TrainerMsg::Init(Box::new(TrainerInit {
        config: s.cfg.clone(),
        model: s.model_cfg.to_json(),
        adam_step: s.adam.as_ref().map(|a| a.step),
        reference: s.reference.is_some(),
    }));
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
        TrainerAnswer::Ready => {}
        TrainerAnswer::Fatal(m) => bail!("{m}"),
        other => bail!("the trainer answered {other:?} to Init"),
    }
    let (ttx, trx) = mpsc::channel();
    let (tlink, events) = (link.clone(), s.events);
    handles.push(
        std::thread::Builder::new()
            .name("trainer-proxy".into())
            .spawn(move || trainer_proxy(tlink, trx, events))?,
    );
    Ok(ttx)
}

/// Most responses one verifier message carries.
const VERIFY_BATCH: usize = 64;

fn verifier_proxy(
    i: usize,
    link: Link,
    jobs: Arc<Mutex<Receiver<VerifyJob>>>,
    events: Sender<Event>,
) {
    let fatal = |m: String| {
        let _ = events.send(Event::Fatal(m));
    };
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
        let reply = link
            .call(
                &Route::Verifier(i),
                wire::encode(&VerifierMsg::Score(batch), &[]),
            )
            .and_then(|b| Ok(wire::decode::<VerifierReply>(&b)?.0));
        match reply {
            Ok(VerifierReply::Scored(scores)) => {
                for s in scores {
                    let _ = events.send(Event::Rewarded(s));
                }
            }
            Ok(VerifierReply::Fatal(m)) => return fatal(m),
            Ok(other) => return fatal(format!("verifier {i} answered {other:?} to Score")),
            Err(e) => return fatal(format!("verifier {i}: {e:#}")),
        }
    }
}

fn trainer_proxy(link: Link, rx: Receiver<TrainCmd>, events: Sender<Event>) {
    while let Ok(cmd) = rx.recv() {
        if cmd == TrainCmd::Shutdown {
            return;
        }
        let sent = Instant::now();
        let reply = link
            .call(&Route::Trainer, wire::encode(&TrainerMsg::Cmd(cmd), &[]))
            .and_then(|b| trainer_reply(&b, sent));
        let ev = match reply {
            Ok(ev) => ev,
            Err(e) => Event::Fatal(format!("trainer: {e:#}")),
        };
        let stop = matches!(ev, Event::Fatal(_));
        if events.send(ev).is_err() || stop {
            return;
        }
    }
}

/// The scheduler's event for a trainer answer; the work's span ends now and lasted what the
/// host measured (the rest of the round trip is transport).
fn trainer_reply(bytes: &[u8], sent: Instant) -> anyhow::Result<Event> {
    let (answer, parts): (TrainerAnswer, _) = wire::decode(bytes)?;
    let ended = Instant::now();
    let span = |secs: f64| {
        ended
            .checked_sub(Duration::from_secs_f64(secs.max(0.0)))
            .unwrap_or(sent)
            .max(sent)
    };
    let (reply, started) = match answer {
        TrainerAnswer::MicroBatchDone { done, secs } => {
            (TrainerReply::MicroBatch(done), span(secs))
        }
        TrainerAnswer::OptDone { done, secs } => (TrainerReply::Opt(done), span(secs)),
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
            (TrainerReply::Exported(Arc::new(w), adam), sent)
        }
        TrainerAnswer::Fatal(m) => bail!("{m}"),
        TrainerAnswer::Ready => bail!("the trainer answered Ready to a command"),
    };
    Ok(Event::Trainer {
        reply,
        started,
        ended,
    })
}
