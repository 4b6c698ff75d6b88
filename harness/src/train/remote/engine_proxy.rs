//! The scheduler's side of one remote engine: a proxy thread that turns the engine's commands
//! into `Step` / `Sync` / `Migrate` messages for its host and the replies back into scheduler
//! events, so the scheduler cannot tell it from an in-process engine.
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use rolloutpipe_backends::Weights;
use rolloutpipe_core::{PolicyVersion, RequestId};

use super::protocol::{EngineMsg, EngineReply};
use super::wire;
use super::{Link, Publisher, Route};
use crate::train::msg::{Add, EngineCmd, EngineOut, Event, Moved, RefPass};
use crate::train::workers::{commands, report};

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
            let Some(cmds) = commands(&rx, self.started.is_empty() || self.dead) else {
                return;
            };
            let mut q = Queued::default();
            for cmd in cmds {
                match cmd {
                    EngineCmd::Shutdown => return,
                    EngineCmd::Add(add) => {
                        if self.take(add.rid) {
                            q.adds.push(add);
                        }
                    }
                    EngineCmd::Cancel(rid) => {
                        if !self.dead {
                            q.cancels.push(rid);
                        }
                    }
                    EngineCmd::Resume(m) => {
                        if self.take(m.rid) {
                            q.resumes.push(*m);
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
                    EngineCmd::RefLogprobs(pass) => {
                        if !self.ref_logprobs(pass) {
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

    /// Takes request `rid` for the host (true), or, with the host gone, reports it lost and
    /// preempted at once (false).
    fn take(&mut self, rid: RequestId) -> bool {
        if self.dead {
            self.emit(Event::Engine {
                engine: self.engine,
                out: EngineOut::Preempted(vec![rid]),
                started: Instant::now(),
            });
            return false;
        }
        self.started.insert(rid, Instant::now());
        true
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
        self.emit(Event::Engine {
            engine: self.engine,
            out: EngineOut::Preempted(lost),
            started: Instant::now(),
        });
    }

    /// Sends `msg` on `route` and decodes the reply. A host's `Fatal` is reported (`Stop`); a
    /// failed call means the host is gone, and its requests are reported preempted (`Lost`).
    fn ask(&mut self, route: Route, msg: Vec<u8>) -> Asked {
        let reply =
            (self.link.call(&route, msg)).and_then(|b| Ok(wire::decode::<EngineReply>(&b)?.0));
        match reply {
            Ok(EngineReply::Fatal(m)) => {
                self.emit(Event::Fatal(m));
                Asked::Stop
            }
            Ok(r) => Asked::Reply(r),
            Err(e) => {
                self.lose(&e);
                Asked::Lost
            }
        }
    }

    /// Reports a reply of the wrong kind (a bug on one side); always false (stop).
    fn unexpected(&self, other: &EngineReply, what: &str) -> bool {
        self.emit(Event::Fatal(format!(
            "engine {} answered {other:?} to {what}",
            self.engine
        )));
        false
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
        match self.ask(Route::Engine(self.engine), msg) {
            Asked::Reply(EngineReply::Stepped {
                outs,
                active,
                reprefilled,
            }) => {
                let ended = Instant::now();
                for done in reprefilled {
                    self.emit(Event::Resumed {
                        engine: self.engine,
                        done,
                        ended,
                    });
                }
                for o in outs {
                    report(self.engine, o, &mut self.started, &self.events);
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
            Asked::Reply(other) => self.unexpected(&other, "Step"),
            Asked::Lost => true,
            Asked::Stop => false,
        }
    }

    /// One `RefLogprobs` round trip (tail multiplexing): the host's reference model computes
    /// the group's pass. A lost host loses the pass, which the trainer then computes itself.
    /// False when the run must stop.
    fn ref_logprobs(&mut self, pass: RefPass) -> bool {
        let engine = self.engine;
        if self.dead {
            self.emit(Event::RefLost { engine });
            return true;
        }
        let msg = wire::encode(&EngineMsg::RefLogprobs(pass), &[]);
        let started = Instant::now();
        match self.ask(Route::Engine(engine), msg) {
            Asked::Reply(EngineReply::RefLogprobs(done)) => {
                self.emit(Event::RefLogprobs {
                    engine,
                    done,
                    started,
                    ended: Instant::now(),
                });
                true
            }
            Asked::Reply(other) => self.unexpected(&other, "RefLogprobs"),
            Asked::Lost => {
                self.emit(Event::RefLost { engine });
                true
            }
            Asked::Stop => false,
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
            match self.ask(Route::Engine(engine), msg) {
                Asked::Reply(EngineReply::Migrated { moved: m }) => {
                    moved = m.map(|m| {
                        self.started.remove(&m.rid);
                        Box::new(m)
                    });
                }
                Asked::Reply(other) => return self.unexpected(&other, "Migrate"),
                Asked::Lost => {}
                Asked::Stop => return false,
            }
        }
        self.emit(Event::Migrated { engine, moved });
        true
    }

    /// Publishes `master` (once for all engines) and has the host load it; false when the run
    /// must stop.
    fn sync(&mut self, master: &Arc<Weights>, version: PolicyVersion) -> bool {
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
            match self.ask(Route::EngineSync(engine), msg) {
                Asked::Reply(EngineReply::Synced { decode }) => {
                    self.emit(Event::Synced { engine, decode });
                    return true;
                }
                Asked::Reply(other) => return self.unexpected(&other, "Sync"),
                Asked::Lost => {}
                Asked::Stop => return false,
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

/// What a round trip to the host came to.
enum Asked {
    /// The host's reply (not `Fatal`).
    Reply(EngineReply),
    /// The host is gone (already reported).
    Lost,
    /// The run must stop (already reported).
    Stop,
}

/// Commands an engine proxy batches into its next `Step`, in the host's order: adds, resumes,
/// cancels.
#[derive(Debug, Default)]
struct Queued {
    adds: Vec<Add>,
    resumes: Vec<Moved>,
    cancels: Vec<RequestId>,
}

impl Queued {
    fn is_empty(&self) -> bool {
        self.adds.is_empty() && self.resumes.is_empty() && self.cancels.is_empty()
    }
}
