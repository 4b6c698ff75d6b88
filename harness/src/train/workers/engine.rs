//! A rollout engine worker: [`EngineStep`] is one engine's work, one call per unit (an
//! admission, a cancel, a weight load, a decode iteration, a migration), shared by the
//! in-process thread ([`engine_thread`]) and the remote `EngineHost`; the thread adds the
//! channels and the timestamps of the requests it runs.
use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use anyhow::anyhow;
use rolloutpipe_backends::{
    GenRequest, RequestKey, ResumeState, SamplingParams, Sequence, SyncTarget, WeightSnapshot,
    Weights,
};
use rolloutpipe_core::{PolicyVersion, RequestId};

use super::backend::{EngineBackend, TrainerBackend};
use crate::train::msg::{Add, EngineCmd, EngineOut, Event, Moved, RefDone, RefPass, Reprefilled};

/// Packs a request id into an engine key; the step is implied (one step per engine at a time).
fn key_of(r: RequestId) -> RequestKey {
    RequestKey(((r.group.0 as u64) << 24) | ((r.sample as u64) << 8) | r.attempt as u64)
}

/// One rollout engine: its backend, the requests it runs, its weights version and the decode
/// timings since the last weight sync.
pub struct EngineStep {
    engine: u16,
    backend: EngineBackend,
    version: PolicyVersion,
    active: HashMap<RequestKey, RequestId>,
    decode: Vec<(u32, f64)>,
    added: u64,
    dead: bool,
    fail_at_request: Option<u64>,
    /// Decode iterations so far, and per running request the iteration count at which it
    /// would have been added had it run here from its start: every iteration gives every
    /// running request one token, so the difference is the tokens it generated (at most: with
    /// look-ahead decoding a request added while no step was queued starts an iteration early).
    decodes: i64,
    born: HashMap<RequestKey, i64>,
    /// Requests resumed since the last iteration (long-tail migration) and their tokens.
    resumed: Vec<(RequestId, u32)>,
    /// Requests whose re-prefill the last iteration ran.
    reprefilled: Vec<Reprefilled>,
}

impl EngineStep {
    /// Engine `engine` over `backend`; with `fail_at_request = Some(n)` it fails at its n-th
    /// admission (fault injection, `fault.fail_engine_at_request`).
    pub fn new(engine: u16, backend: EngineBackend, fail_at_request: Option<u64>) -> Self {
        EngineStep {
            engine,
            backend,
            version: PolicyVersion(0),
            active: HashMap::new(),
            decode: Vec::new(),
            added: 0,
            dead: false,
            fail_at_request,
            decodes: 0,
            born: HashMap::new(),
            resumed: Vec::new(),
            reprefilled: Vec::new(),
        }
    }

    /// Whether requests are running (a caller keeps decoding while they are).
    pub fn has_work(&self) -> bool {
        !self.active.is_empty()
    }

    /// Requests running.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Where and in which dtype the engine wants its weight snapshots.
    pub fn sync_target(&self) -> SyncTarget {
        self.backend.sync_target()
    }

    /// Adds a request to the continuous batch. A failed engine loses it (`Lost`).
    pub fn add(
        &mut self,
        rid: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> anyhow::Result<Option<EngineOut>> {
        let engine = self.engine;
        if self.dead {
            // A request sent before the scheduler saw the failure is lost as well.
            return Ok(Some(EngineOut::Lost(vec![rid])));
        }
        self.added += 1;
        let key = key_of(rid);
        let lag = self.backend.admission_lag();
        let be = self.backend.as_dyn();
        be.add_request(GenRequest {
            id: key,
            prompt,
            params,
        })
        .map_err(|e| anyhow!("engine {engine}: {e}"))?;
        self.active.insert(key, rid);
        // Counted from when its first step can run, so that the count never exceeds the
        // tokens generated (a migration exports only requests that have started).
        self.born.insert(key, self.decodes + lag);
        if self.fail_at_request == Some(self.added) {
            // Injected failure: every running request is lost and the engine stops generating
            // (its backend state is gone with it).
            self.dead = true;
            self.born.clear();
            let lost: Vec<RequestId> = self.active.drain().map(|(_, r)| r).collect();
            for r in &lost {
                let _ = be.cancel_request(key_of(*r));
            }
            tracing::warn!(engine, lost = lost.len(), "injected engine failure");
            return Ok(Some(EngineOut::Lost(lost)));
        }
        Ok(None)
    }

    /// Aborts a request; `None` when it already finished (it was reported; the core discards
    /// it) or was never here.
    pub fn cancel(&mut self, rid: RequestId) -> anyhow::Result<Option<EngineOut>> {
        let key = key_of(rid);
        if self.active.remove(&key).is_none() {
            return Ok(None);
        }
        self.born.remove(&key);
        self.resumed.retain(|(r, _)| *r != rid);
        let engine = self.engine;
        self.backend
            .as_dyn()
            .cancel_request(key)
            .map_err(|e| anyhow!("engine {engine}: {e}"))?;
        Ok(Some(EngineOut::Aborted(rid)))
    }

    /// Replaces the weights (between steps, nothing in flight) with `snap`, made for this
    /// engine's [`SyncTarget`], as version `v`. Returns the decode timings since the last sync:
    /// (running requests, seconds).
    pub fn sync(
        &mut self,
        snap: &WeightSnapshot,
        v: PolicyVersion,
    ) -> anyhow::Result<Vec<(u32, f64)>> {
        if !self.dead {
            let engine = self.engine;
            self.backend
                .as_dyn()
                .load_weights(snap)
                .map_err(|e| anyhow!("engine {engine} sync: {e}"))?;
        }
        self.version = v;
        Ok(std::mem::take(&mut self.decode))
    }

    /// [`EngineStep::sync`] from the trainer's f32 master weights, converted here to the
    /// engine's dtype (a remote engine receives the master weights, not a snapshot).
    pub fn sync_master(
        &mut self,
        master: &Weights,
        v: PolicyVersion,
    ) -> anyhow::Result<Vec<(u32, f64)>> {
        let engine = self.engine;
        let dtype = self.sync_target().dtype;
        let be = self.backend.as_dyn();
        let snap = WeightSnapshot::host(be.config(), master, dtype)
            .map_err(|e| anyhow!("engine {engine} sync: {e}"))?;
        self.sync(&snap, v)
    }

    /// One decode iteration of the continuous batch (nothing when idle); the requests it
    /// finished.
    pub fn decode(&mut self) -> anyhow::Result<Vec<EngineOut>> {
        if self.active.is_empty() {
            return Ok(Vec::new());
        }
        let engine = self.engine;
        let be = self.backend.as_dyn();
        let running = be.active_requests() as u32;
        let t = Instant::now();
        let out = be
            .decode_step()
            .map_err(|e| anyhow!("engine {engine} decode: {e}"))?;
        let secs = t.elapsed().as_secs_f64();
        self.decode.push((running, secs));
        self.decodes += 1;
        self.reprefilled = (self.resumed.drain(..))
            .map(|(rid, tokens)| Reprefilled { rid, tokens, secs })
            .collect();
        let mut done = Vec::with_capacity(out.len());
        for o in out {
            self.born.remove(&o.id);
            if let Some(rid) = self.active.remove(&o.id) {
                done.push(EngineOut::Generated {
                    rid,
                    version: self.version,
                    tokens: o.tokens,
                    logprobs: o.logprobs,
                });
            }
        }
        Ok(done)
    }
}

impl EngineStep {
    /// Long-tail migration, source side: exports the running request that has generated the
    /// most tokens (the lowest key among equals), when it has generated at least
    /// `min_generated`; `None` when none has (or the engine failed).
    pub fn migrate_out(&mut self, min_generated: u32) -> anyhow::Result<Option<Moved>> {
        if self.dead {
            return Ok(None);
        }
        let best = (self.active.keys())
            .map(|k| {
                (
                    self.decodes - self.born.get(k).copied().unwrap_or(self.decodes),
                    *k,
                )
            })
            .max_by_key(|&(n, k)| (n, std::cmp::Reverse(k)));
        let Some((n, key)) = best else {
            return Ok(None);
        };
        if n < i64::from(min_generated.max(1)) {
            return Ok(None);
        }
        let engine = self.engine;
        let st = (self.backend.as_dyn().export_request(key))
            .map_err(|e| anyhow!("engine {engine} migration: {e}"))?;
        self.born.remove(&key);
        Ok(self.active.remove(&key).map(|rid| Moved { rid, state: st }))
    }

    /// Long-tail migration, target side: resumes an exported request; its next iteration
    /// re-prefills prompt + generated tokens (timed, see [`EngineStep::take_reprefilled`]). A
    /// failed engine loses it (`Lost`).
    pub fn resume(&mut self, rid: RequestId, st: ResumeState) -> anyhow::Result<Option<EngineOut>> {
        if self.dead {
            return Ok(Some(EngineOut::Lost(vec![rid])));
        }
        let (engine, key, n) = (self.engine, st.request.id, st.tokens.len());
        (self.backend.as_dyn().resume_request(st))
            .map_err(|e| anyhow!("engine {engine} resume: {e}"))?;
        self.active.insert(key, rid);
        self.born
            .insert(key, self.decodes - n as i64 + self.backend.admission_lag());
        self.resumed.push((rid, n as u32));
        Ok(None)
    }

    /// The requests whose re-prefill the last iteration ran.
    pub fn take_reprefilled(&mut self) -> Vec<Reprefilled> {
        std::mem::take(&mut self.reprefilled)
    }
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
    reference: Option<EngineReference>,
) {
    let mut t = EngineThread {
        engine,
        step: EngineStep::new(engine, backend, fail_at_request),
        started: HashMap::new(),
        events,
        reference,
    };
    loop {
        // Block only when idle; while generating, take whatever arrived and keep decoding.
        let Some(cmds) = commands(&rx, !t.step.has_work()) else {
            return;
        };
        for cmd in cmds {
            match t.command(cmd) {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => return t.fatal(e),
            }
        }
        if let Err(e) = t.decode() {
            return t.fatal(e);
        }
    }
}

/// An engine thread's state: its engine and when it took each running request (for the
/// trace and the request spans).
struct EngineThread {
    engine: u16,
    step: EngineStep,
    started: HashMap<RequestId, Instant>,
    events: Sender<Event>,
    reference: Option<EngineReference>,
}

impl EngineThread {
    fn send(&self, ev: Event) {
        let _ = self.events.send(ev);
    }

    fn fatal(&self, e: anyhow::Error) {
        self.send(Event::Fatal(e.to_string()));
    }

    /// Carries out one command; `false` on `Shutdown`.
    fn command(&mut self, cmd: EngineCmd) -> anyhow::Result<bool> {
        let engine = self.engine;
        let out = match cmd {
            EngineCmd::Shutdown => return Ok(false),
            EngineCmd::Add(Add {
                rid,
                prompt,
                params,
            }) => {
                self.started.insert(rid, Instant::now());
                self.step.add(rid, prompt.as_ref().clone(), params)?
            }
            EngineCmd::Cancel(rid) => self.step.cancel(rid)?,
            EngineCmd::Migrate { min_generated } => {
                let moved = self.step.migrate_out(min_generated)?.map(|m| {
                    self.started.remove(&m.rid);
                    Box::new(m)
                });
                self.send(Event::Migrated { engine, moved });
                None
            }
            EngineCmd::Resume(m) => {
                self.started.insert(m.rid, Instant::now());
                self.step.resume(m.rid, m.state)?
            }
            EngineCmd::RefLogprobs(pass) => {
                self.ref_pass(pass)?;
                None
            }
            EngineCmd::Sync {
                snap,
                master,
                version,
            } => {
                let decode = match snap {
                    Some(s) => self.step.sync(&s, version)?,
                    None => self.step.sync_master(&master, version)?,
                };
                self.send(Event::Synced { engine, decode });
                None
            }
        };
        if let Some(o) = out {
            report(engine, o, &mut self.started, &self.events);
        }
        Ok(true)
    }

    /// A reference pass with the engine's reference model.
    fn ref_pass(&mut self, pass: RefPass) -> anyhow::Result<()> {
        let engine = self.engine;
        let Some(r) = self.reference.as_mut() else {
            anyhow::bail!("engine {engine}: a reference pass without a reference model");
        };
        let started = Instant::now();
        let logprobs = (r.logprobs(&pass.seqs, pass.temperature))
            .map_err(|e| e.context(format!("engine {engine} reference pass")))?;
        let done = RefDone {
            step: pass.step,
            index: pass.index,
            logprobs,
        };
        self.send(Event::RefLogprobs {
            engine,
            done,
            started,
            ended: Instant::now(),
        });
        Ok(())
    }

    /// One decode iteration (nothing when idle), its finished requests and re-prefills
    /// reported.
    fn decode(&mut self) -> anyhow::Result<()> {
        let outs = self.step.decode()?;
        let ended = Instant::now();
        for done in self.step.take_reprefilled() {
            let engine = self.engine;
            self.send(Event::Resumed {
                engine,
                done,
                ended,
            });
        }
        for o in outs {
            report(self.engine, o, &mut self.started, &self.events);
        }
        Ok(())
    }
}

/// Sends what an engine reported as a scheduler event, stamped with when the engine took
/// the request.
pub(crate) fn report(
    engine: u16,
    out: EngineOut,
    started: &mut HashMap<RequestId, Instant>,
    events: &Sender<Event>,
) {
    let now = Instant::now();
    let started = match &out {
        EngineOut::Generated { rid, .. } | EngineOut::Aborted(rid) => started.remove(rid),
        EngineOut::Lost(lost) | EngineOut::Preempted(lost) => {
            for r in lost {
                started.remove(r);
            }
            None
        }
    };
    let _ = events.send(Event::Engine {
        engine,
        out,
        started: started.unwrap_or(now),
    });
}
