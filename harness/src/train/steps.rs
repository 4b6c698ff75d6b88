//! The work of each worker role, one call per unit of work: an engine's admissions, cancels,
//! weight loads and decode iterations; the trainer's micro-batches, optimizer steps and exports;
//! a verifier's scoring.
//!
//! The in-process threads (`workers`) and the remote hosts (`remote`, driven over the wire by
//! Ray actors or any other transport) both call these, so a run behaves the same whichever
//! transport carries its messages. Nothing here knows about threads, channels, clocks of the
//! scheduler or the wire: callers add those.
use std::collections::HashMap;
use std::time::Instant;

use anyhow::anyhow;
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, AdamW, GenRequest, ModelConfig, Objective, OptStats, RequestKey, ResumeState,
    SamplingParams, Sequence, SyncTarget, TrainBatch, TrainSequence, WeightSnapshot, Weights,
    advantages, normalizer,
};
use rolloutpipe_core::{PolicyVersion, RequestId};

use super::config::{OldLogprobs, TrainConfig};
use super::workers::{EngineBackend, GroupBatch, TrainerBackend, TrainerSetup, make_trainer};
use crate::tasks::{Problem, Task, Tokenizer};

/// Packs a request id into an engine key; the step is implied (one step per engine at a time).
fn key_of(r: RequestId) -> RequestKey {
    RequestKey(((r.group.0 as u64) << 24) | ((r.sample as u64) << 8) | r.attempt as u64)
}

/// What an engine reports.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineOut {
    /// A request finished generating.
    Generated {
        /// Request.
        rid: RequestId,
        /// The engine's weights version.
        version: PolicyVersion,
        /// Response tokens.
        tokens: Vec<u32>,
        /// Their log-probs.
        logprobs: Vec<f32>,
    },
    /// A cancel took effect.
    Aborted(RequestId),
    /// The engine failed (injected fault): these requests will never finish.
    Lost(Vec<RequestId>),
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
    /// Requests whose re-prefill the last iteration ran: (request, tokens, seconds).
    reprefilled: Vec<(RequestId, u32, f64)>,
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
            .map(|(r, n)| (r, n, secs))
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
    pub fn migrate_out(
        &mut self,
        min_generated: u32,
    ) -> anyhow::Result<Option<(RequestId, ResumeState)>> {
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
        Ok(self.active.remove(&key).map(|rid| (rid, st)))
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

    /// The requests whose re-prefill the last iteration ran: (request, tokens generated
    /// before the move, the iteration's seconds).
    pub fn take_reprefilled(&mut self) -> Vec<(RequestId, u32, f64)> {
        std::mem::take(&mut self.reprefilled)
    }
}

/// Sums of one accumulated micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatchStats {
    /// Sums over its tokens.
    pub stats: AccumStats,
    /// Its response tokens.
    pub tokens: usize,
    /// Its prompt + response tokens (what a forward/backward pass processes).
    pub all_tokens: usize,
}

/// What an optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptDone {
    /// Norm and clip.
    pub stats: OptStats,
    /// Sums over the step's micro-batches.
    pub accum: AccumStats,
    /// The normaliser used.
    pub normalizer: f64,
}

/// The trainer: its backend, its settings and the micro-batches since the last optimizer step.
pub struct TrainerStep {
    backend: TrainerBackend,
    setup: TrainerSetup,
    since_opt: Vec<TrainBatch>,
    accum: AccumStats,
}

impl TrainerStep {
    /// A trainer with zeroed gradients.
    pub fn new(mut backend: TrainerBackend, setup: TrainerSetup) -> anyhow::Result<Self> {
        backend
            .as_dyn()
            .zero_grad()
            .map_err(|e| anyhow!("trainer: {e}"))?;
        Ok(TrainerStep {
            backend,
            setup,
            since_opt: Vec::new(),
            accum: AccumStats::default(),
        })
    }

    /// Forward/backward of one micro-batch, accumulating unnormalised gradient sums.
    pub fn micro_batch(&mut self, groups: Vec<GroupBatch>) -> anyhow::Result<MicroBatchStats> {
        let (batch, stats) = train_micro_batch(&mut self.backend, &mut self.setup, groups)
            .map_err(|e| anyhow!("trainer: {e:#}"))?;
        let tokens = batch.response_tokens();
        let all_tokens = batch
            .sequences
            .iter()
            .map(|s| s.prompt.len() + s.response.len())
            .sum();
        self.accum.merge(&stats);
        self.since_opt.push(batch);
        Ok(MicroBatchStats {
            stats,
            tokens,
            all_tokens,
        })
    }

    /// Normalises, clips and applies AdamW over the micro-batches since the last step.
    pub fn opt_step(&mut self) -> anyhow::Result<OptDone> {
        // The normaliser of the whole optimizer step, known only now (SPEC §2).
        let norm = normalizer(self.setup.agg, &self.since_opt);
        let be = self.backend.as_dyn();
        let stats = be
            .optimizer_step(norm, &self.setup.opt)
            .and_then(|st| be.zero_grad().map(|()| st))
            .map_err(|e| anyhow!("trainer optimizer step: {e}"))?;
        self.since_opt.clear();
        Ok(OptDone {
            stats,
            accum: std::mem::take(&mut self.accum),
            normalizer: norm,
        })
    }

    /// The f32 master weights, and the AdamW moments when `optimizer` (checkpoints only: the
    /// moments do not cross the seam every step).
    pub fn export(&mut self, optimizer: bool) -> anyhow::Result<(Weights, Option<AdamState>)> {
        let be = self.backend.as_dyn();
        let w = be
            .export_weights()
            .map_err(|e| anyhow!("trainer export: {e}"))?;
        let adam = if optimizer {
            Some(
                be.checkpoint_optimizer()
                    .map_err(|e| anyhow!("trainer export: {e}"))?,
            )
        } else {
            None
        };
        Ok((w, adam))
    }
}

/// The trainer's settings for `cfg`; `reference` is the KL reference model's weights
/// (`rl.beta > 0`), run on the CPU backend.
pub fn trainer_setup(
    cfg: &TrainConfig,
    model_cfg: &ModelConfig,
    reference: Option<&Weights>,
) -> anyhow::Result<TrainerSetup> {
    Ok(TrainerSetup {
        opt: AdamW {
            lr: cfg.rl.lr,
            weight_decay: cfg.rl.weight_decay,
            max_grad_norm: (cfg.rl.max_grad_norm > 0.0).then_some(cfg.rl.max_grad_norm),
            ..AdamW::default()
        },
        objective: Objective::Grpo {
            eps_low: cfg.rl.eps_low,
            eps_high: cfg.rl.eps_high,
            beta: cfg.rl.beta,
            temperature: cfg.rl.temperature as f64,
        },
        agg: cfg.aggregation()?,
        std: cfg.std_mode()?,
        rollout_logprobs: cfg.rl.old_logprobs == OldLogprobs::Rollout,
        reference: match reference {
            Some(r) => Some(make_trainer(
                "cpu",
                model_cfg,
                r,
                cfg.trainer.threads,
                false,
            )?),
            None => None,
        },
        temperature: cfg.rl.temperature,
    })
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
        // Groups a rollout engine multiplexed carry their reference log-probs (the same
        // weights and batch-invariant kernels, so the same bits); the rest are computed here,
        // in one pass. Either way each sequence's values enter the update once.
        let mut seq_of = batch.sequences.iter_mut();
        let mut missing = Vec::new();
        for g in &groups {
            for i in 0..g.samples.len() {
                let Some(seq) = seq_of.next() else { break };
                match g.ref_logprobs.as_ref().and_then(|r| r.get(i)) {
                    Some(lp) if lp.len() == seq.response.len() => {
                        seq.ref_logprobs = Some(lp.clone())
                    }
                    Some(lp) => anyhow::bail!(
                        "group {}: {} multiplexed reference log-probs for a {}-token response",
                        g.group,
                        lp.len(),
                        seq.response.len()
                    ),
                    None => missing.push(seq),
                }
            }
        }
        if !missing.is_empty() {
            let seqs: Vec<Sequence> = missing
                .iter()
                .map(|s| Sequence {
                    prompt: s.prompt.clone(),
                    response: s.response.clone(),
                })
                .collect();
            let lps = reference.as_dyn().logprobs(&seqs, setup.temperature)?;
            for (s, lp) in missing.into_iter().zip(lps) {
                s.ref_logprobs = Some(lp);
            }
        }
    }
    let stats = backend.as_dyn().accumulate(&batch, &setup.objective)?;
    Ok((batch, stats))
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
