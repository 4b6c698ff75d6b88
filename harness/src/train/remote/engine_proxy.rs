//! The scheduler's side of one remote engine: a proxy thread that turns the engine's commands
//! into `Step` / `Sync` / `Migrate` messages for its host and the replies back into scheduler
//! events, so the scheduler cannot tell it from an in-process engine.
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use rolloutpipe_backends::{Sequence, Weights};
use rolloutpipe_core::RequestId;

use super::super::wire::{self, EngineMsg, EngineReply, WireAdd, WireResume};
use super::super::workers::{EngineCmd, Event, report};
use super::{Link, Publisher, Route};
/// The scheduler's side of one remote engine.
pub(super) struct EngineProxy {
    pub(super) engine: u16,
    pub(super) link: Link,
    pub(super) publisher: Arc<Publisher>,
    pub(super) events: Sender<Event>,
    /// Requests the host runs, and when they were sent.
    pub(super) started: HashMap<RequestId, Instant>,
    /// The host is gone: its requests were reported preempted.
    pub(super) dead: bool,
}

impl EngineProxy {
    pub(super) fn run(&mut self, rx: Receiver<EngineCmd>) {
        loop {
            // Block only when the host runs nothing; otherwise keep it decoding.
            let first = if self.started.is_empty() || self.dead {
                match rx.recv() {
                    Ok(c) => Some(c),
                    Err(_) => return,
                }
            } else {
                None
            };
            let mut q = Queued::default();
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                match cmd {
                    EngineCmd::Shutdown => return,
                    EngineCmd::Add {
                        rid,
                        prompt,
                        params,
                    } => {
                        if self.dead {
                            self.emit(Event::EngineFailed {
                                engine: self.engine,
                                lost: vec![rid],
                                preempted: true,
                            });
                        } else {
                            self.started.insert(rid, Instant::now());
                            q.adds.push(WireAdd {
                                rid,
                                prompt: prompt.to_vec(),
                                params: (&params).into(),
                            });
                        }
                    }
                    EngineCmd::Cancel(rid) => {
                        if !self.dead {
                            q.cancels.push(rid);
                        }
                    }
                    EngineCmd::Resume { rid, state } => {
                        if self.dead {
                            self.emit(Event::EngineFailed {
                                engine: self.engine,
                                lost: vec![rid],
                                preempted: true,
                            });
                        } else {
                            self.started.insert(rid, Instant::now());
                            q.resumes.push(WireResume::new(rid, &state));
                        }
                    }
                    EngineCmd::Migrate { min_generated } => {
                        // What was queued before the ask goes first.
                        let queued = std::mem::take(&mut q);
                        if !queued.is_empty() && !self.dead && !self.step(queued, false) {
                            return;
                        }
                        if !self.migrate(min_generated) {
                            return;
                        }
                    }
                    EngineCmd::RefLogprobs {
                        step,
                        index,
                        seqs,
                        temperature,
                    } => {
                        if !self.ref_logprobs(step, index, seqs, temperature) {
                            return;
                        }
                    }
                    EngineCmd::Sync {
                        master, version, ..
                    } => {
                        // What was queued before the sync goes first.
                        let queued = std::mem::take(&mut q);
                        if !queued.is_empty() && !self.dead && !self.step(queued, false) {
                            return;
                        }
                        if !self.sync(&master, version) {
                            return;
                        }
                    }
                }
            }
            if self.dead || (self.started.is_empty() && q.is_empty()) {
                continue;
            }
            if !self.step(q, true) {
                return;
            }
        }
    }

    fn emit(&self, ev: Event) {
        let _ = self.events.send(ev);
    }

    /// The host is gone: every request it ran comes back preempted.
    fn lose(&mut self, why: &anyhow::Error) {
        tracing::warn!(
            engine = self.engine,
            running = self.started.len(),
            "rollout engine lost: {why:#}"
        );
        self.dead = true;
        let lost: Vec<RequestId> = self.started.drain().map(|(r, _)| r).collect();
        self.emit(Event::EngineFailed {
            engine: self.engine,
            lost,
            preempted: true,
        });
    }

    /// One `Step` round trip; false when the run must stop (the error was reported).
    fn step(&mut self, q: Queued, decode: bool) -> bool {
        let msg = wire::encode(
            &EngineMsg::Step {
                adds: q.adds,
                resumes: q.resumes,
                cancels: q.cancels,
                decode,
            },
            &[],
        );
        let reply = self
            .link
            .call(&Route::Engine(self.engine), msg)
            .and_then(|b| Ok(wire::decode::<EngineReply>(&b)?.0));
        match reply {
            Ok(EngineReply::Stepped {
                outs,
                active,
                reprefilled,
            }) => {
                let ended = Instant::now();
                for (rid, tokens, secs) in reprefilled {
                    self.emit(Event::Resumed {
                        engine: self.engine,
                        rid,
                        tokens,
                        secs,
                        ended,
                    });
                }
                for o in outs {
                    report(self.engine, o.into(), &mut self.started, &self.events);
                }
                if active != self.started.len() {
                    self.emit(Event::Fatal(format!(
                        "engine {} runs {active} requests but was sent {}",
                        self.engine,
                        self.started.len()
                    )));
                    return false;
                }
                true
            }
            Ok(EngineReply::Fatal(m)) => {
                self.emit(Event::Fatal(m));
                false
            }
            Ok(other) => {
                self.emit(Event::Fatal(format!(
                    "engine {} answered {other:?} to Step",
                    self.engine
                )));
                false
            }
            Err(e) => {
                self.lose(&e);
                true
            }
        }
    }

    /// One `RefLogprobs` round trip (tail multiplexing): the host's reference model computes
    /// the group's pass. A lost host loses the pass, which the trainer then computes itself.
    /// False when the run must stop.
    fn ref_logprobs(
        &mut self,
        step: u64,
        index: usize,
        seqs: Vec<Sequence>,
        temperature: f32,
    ) -> bool {
        let engine = self.engine;
        if self.dead {
            self.emit(Event::RefLost { engine });
            return true;
        }
        let seqs = (seqs.into_iter()).map(|s| (s.prompt, s.response)).collect();
        let msg = wire::encode(&EngineMsg::RefLogprobs { seqs, temperature }, &[]);
        let started = Instant::now();
        let reply = self
            .link
            .call(&Route::Engine(engine), msg)
            .and_then(|b| Ok(wire::decode::<EngineReply>(&b)?.0));
        match reply {
            Ok(EngineReply::RefLogprobs { logprobs }) => {
                self.emit(Event::RefLogprobs {
                    engine,
                    step,
                    index,
                    logprobs: logprobs.into_iter().map(|l| l.0).collect(),
                    started,
                    ended: Instant::now(),
                });
                true
            }
            Ok(EngineReply::Fatal(m)) => {
                self.emit(Event::Fatal(m));
                false
            }
            Ok(other) => {
                self.emit(Event::Fatal(format!(
                    "engine {engine} answered {other:?} to RefLogprobs"
                )));
                false
            }
            Err(e) => {
                self.lose(&e);
                self.emit(Event::RefLost { engine });
                true
            }
        }
    }

    /// One `Migrate` round trip: the host exports its longest request (at least
    /// `min_generated` tokens) and the scheduler is told either way, as by an in-process
    /// engine; a lost host moves nothing. False when the run must stop.
    fn migrate(&mut self, min_generated: u32) -> bool {
        let engine = self.engine;
        let mut moved = None;
        if !self.dead {
            let msg = wire::encode(&EngineMsg::Migrate { min_generated }, &[]);
            let reply = self
                .link
                .call(&Route::Engine(engine), msg)
                .and_then(|b| Ok(wire::decode::<EngineReply>(&b)?.0));
            match reply {
                Ok(EngineReply::Migrated { moved: m }) => {
                    moved = m.map(|r| {
                        let (rid, st) = r.into_state();
                        self.started.remove(&rid);
                        (rid, Box::new(st))
                    });
                }
                Ok(EngineReply::Fatal(m)) => {
                    self.emit(Event::Fatal(m));
                    return false;
                }
                Ok(other) => {
                    self.emit(Event::Fatal(format!(
                        "engine {engine} answered {other:?} to Migrate"
                    )));
                    return false;
                }
                Err(e) => self.lose(&e),
            }
        }
        self.emit(Event::Migrated { engine, moved });
        true
    }

    /// Publishes `master` (once for all engines) and has the host load it; false when the run
    /// must stop.
    fn sync(&mut self, master: &Arc<Weights>, version: rolloutpipe_core::PolicyVersion) -> bool {
        let engine = self.engine;
        if !self.dead {
            if let Err(e) = self.publisher.publish(master) {
                self.emit(Event::Fatal(format!(
                    "publishing weights v{}: {e:#}",
                    version.0
                )));
                return false;
            }
            let msg = wire::encode(&EngineMsg::Sync { version }, &[]);
            let reply = self
                .link
                .call(&Route::EngineSync(engine), msg)
                .and_then(|b| Ok(wire::decode::<EngineReply>(&b)?.0));
            match reply {
                Ok(EngineReply::Synced { decode }) => {
                    self.emit(Event::Synced { engine, decode });
                    return true;
                }
                Ok(EngineReply::Fatal(m)) => {
                    self.emit(Event::Fatal(m));
                    return false;
                }
                Ok(other) => {
                    self.emit(Event::Fatal(format!(
                        "engine {engine} answered {other:?} to Sync"
                    )));
                    return false;
                }
                Err(e) => self.lose(&e),
            }
        }
        // A lost engine "syncs" at once, as a failed in-process engine does.
        self.emit(Event::Synced {
            engine,
            decode: Vec::new(),
        });
        true
    }
}

/// Commands an engine proxy batches into its next `Step`, in the host's order: adds, resumes,
/// cancels.
#[derive(Debug, Default)]
struct Queued {
    adds: Vec<WireAdd>,
    resumes: Vec<WireResume>,
    cancels: Vec<RequestId>,
}

impl Queued {
    fn is_empty(&self) -> bool {
        self.adds.is_empty() && self.resumes.is_empty() && self.cancels.is_empty()
    }
}
