//! The rollout engine, written once for every backend: continuous batching, request limits,
//! seeded sampling streams, shared group prefixes, export and resume for long-tail migration,
//! and submit/poll stepping with optional look-ahead.
//!
//! Each step packs, per active request, the tokens not yet in its cache (its prompt when it
//! just joined, else its last token) into one [`StepPlan`]; a backend's [`Decoder`] runs the
//! one decode forward (`model::decode`) over it on its device and samples each request's
//! last row. A request samples from its own ChaCha8 stream (seeded by its `seed`, one draw
//! per token) and every row's computation depends only on its own inputs (batch invariance),
//! so its tokens depend only on its seed and the weights, never on which requests share a
//! step.
//!
//! Host state changes at once: a request added or cancelled while a step is in flight joins
//! (or leaves) the next step, and the in-flight step's row of a cancelled request is dropped
//! when it is collected. KV pages come from the backend's [`KvStore`]; a group's samples
//! share their prompt's prefix where the store can ([`KvStore::shared`]): in the group's first
//! step one sample prefills the whole prompt, writing the shared pages, and every other
//! sample computes only the prompt positions past them, reading the pages written by the
//! same step (bit-identical to independent requests, by batch invariance).
//!
//! With look-ahead ([`Engine::set_lookahead`], for a decoder that [`Decoder::queues`]) each
//! submission also queues the step after it: every request of the running step continues
//! one position later from the token that step samples, which the device copies into the
//! next step's input (token feedback), so the device never waits for the host between
//! steps. What the host learns from the running step (a stop token, a cancel) drops that
//! request's row in the queued one.

pub mod host;
pub mod kv;

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;

use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::check::{validate_request, validate_resume};
use crate::model::sampling::{exported, finish_reason, not_started, sample_row, uniform};
use crate::seam::{
    EngineLimits, EngineLoad, GenOutput, GenRequest, GroupRequest, Rejected, RequestKey,
    ResumeState, SamplingParams,
};
pub use kv::{KvStore, PAGE, Paged, Slots};

/// One request's sampling settings and its uniform draw for this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    /// Temperature (0: greedy).
    pub temperature: f32,
    /// Top-k (0: off).
    pub top_k: usize,
    /// Top-p.
    pub top_p: f32,
    /// The draw, uniform in [0, 1).
    pub u: f64,
}

impl SampleRow {
    /// The row as the device `sample` kernels read it.
    pub fn packed(&self) -> [f32; 4] {
        sample_row(self.temperature, self.top_k, self.top_p, self.u)
    }

    /// The settings as the CPU reference's sampler reads them.
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            ..Default::default()
        }
    }
}

/// One step laid out on the host: what a [`Decoder`] uploads and runs.
#[derive(Debug, Default, Clone)]
pub struct StepPlan {
    /// Token id of each row (0 where the device feeds the token back).
    pub ids: Vec<u32>,
    /// Position of each row in its request.
    pub pos: Vec<u32>,
    /// `(page-table offset, position)` per row.
    pub meta: Vec<u32>,
    /// The concatenated page tables.
    pub pages: Vec<u32>,
    /// Positions per page.
    pub page_rows: usize,
    /// Pages the KV memory must hold.
    pub kv_pages: usize,
    /// The last row of each request (the one its next token is sampled from).
    pub last: Vec<u32>,
    /// Each request's sampling settings and draw.
    pub sample: Vec<SampleRow>,
    /// Look-ahead: `(row of this step, sampled row of the step before)` whose token the
    /// device copies in.
    pub feedback: Vec<(u32, u32)>,
}

impl StepPlan {
    /// Rows.
    pub fn n(&self) -> usize {
        self.ids.len()
    }

    /// Requests (sampled rows).
    pub fn r(&self) -> usize {
        self.last.len()
    }

    /// The largest position of the step's rows.
    pub fn max_pos(&self) -> usize {
        self.pos.iter().copied().max().unwrap_or(0) as usize
    }

    fn clear(&mut self) {
        self.ids.clear();
        self.pos.clear();
        self.meta.clear();
        self.pages.clear();
        self.last.clear();
        self.sample.clear();
        self.feedback.clear();
    }
}

/// A step's sampled tokens and their log-probs, one per request of its plan.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Sampled {
    /// Tokens.
    pub tokens: Vec<u32>,
    /// Their log-probs under the sampling distribution.
    pub logp: Vec<f32>,
}

/// A backend's device side of the engine: runs the decode forward of a [`StepPlan`].
pub trait Decoder {
    /// A step submitted and not yet collected.
    type Run;
    /// Whether a step can be queued behind one that is not collected yet (look-ahead).
    fn queues(&self) -> bool {
        false
    }
    /// Uploads and submits a step; behind `front` (whose sampled tokens the plan's feedback
    /// rows read) for a look-ahead step.
    fn launch(&mut self, plan: &StepPlan, front: Option<&Self::Run>) -> Result<Self::Run>;
    /// Collects a step: its tokens, or `None` while it runs and `wait` is false.
    fn poll(&mut self, run: &mut Self::Run, wait: bool) -> Result<Option<Sampled>>;
    /// After a failed [`Decoder::poll`]: whether the cached keys and values went with it (the
    /// engine then drops every request).
    fn lost_cache(&self) -> bool {
        false
    }
}

#[derive(Debug)]
struct Active<L> {
    id: RequestKey,
    /// The engine's own serial for this admission: a step's rows name it, so that a request
    /// cancelled and added again under the same key never receives the old one's row.
    uid: u64,
    /// Where its sampling stream stood before the draw for its row in the look-ahead step
    /// (`None`: it has no row there); an export rewinds to it, as that row is dropped.
    ahead_rng: Option<u128>,
    /// The prompt, and after a resume the tokens generated before it (prefilled together).
    prompt: Vec<u32>,
    /// Length of the prompt as the request was asked.
    orig: usize,
    params: SamplingParams,
    rng: ChaCha8Rng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    lease: L,
    /// Positions whose keys and values are in its pages.
    cached: usize,
}

/// A submitted step: its requests (by uid) with the positions each computes, in the order of
/// their sampled rows.
#[derive(Debug)]
struct Stepped<R> {
    run: R,
    rows: Vec<(u64, usize)>,
}

/// The engine over KV store `S`, whose decoder's steps are `R` (see the module docs).
#[derive(Debug)]
pub struct Engine<S: KvStore, R> {
    cfg: ModelConfig,
    store: S,
    active: Vec<Active<S::Lease>>,
    limits: EngineLimits,
    /// The step submitted and not yet collected.
    stepped: Option<Stepped<R>>,
    /// Look-ahead: the next step, queued behind `stepped`.
    ahead: Option<Stepped<R>>,
    lookahead: bool,
    next_uid: u64,
    plan: StepPlan,
}

impl<S: KvStore, R> Engine<S, R> {
    /// An idle engine for model `cfg` over `store`, without limits.
    pub fn new(cfg: &ModelConfig, store: S) -> Self {
        Self {
            cfg: cfg.clone(),
            store,
            active: Vec::new(),
            limits: EngineLimits::default(),
            stepped: None,
            ahead: None,
            lookahead: false,
            next_uid: 0,
            plan: StepPlan::default(),
        }
    }

    /// The KV store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The KV store, for capacity changes.
    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    /// The admission limits.
    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// Sets the admission limits (requests already admitted stay).
    pub fn set_limits(&mut self, limits: EngineLimits) -> Result<()> {
        self.limits = limits.validate()?;
        Ok(())
    }

    /// Requests admitted and not finished, cancelled or exported.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Whether request `id` is active.
    pub fn contains(&self, id: RequestKey) -> bool {
        self.active.iter().any(|a| a.id == id)
    }

    /// What the engine holds: its requests, and the KV positions they reserve (each shared
    /// prefix once).
    pub fn load(&self) -> EngineLoad {
        let own: usize = self
            .active
            .iter()
            .map(|a| a.orig + a.params.max_new_tokens - self.store.prefix_len(&a.lease))
            .sum();
        EngineLoad {
            requests: self.active.len(),
            kv_tokens: own + self.store.shared_positions(),
        }
    }

    /// Whether a step is submitted and not yet collected.
    pub fn in_flight(&self) -> bool {
        self.stepped.is_some()
    }

    /// Whether a look-ahead step is queued (behind the submitted step, or, once that is
    /// collected, waiting to become the next submission).
    pub fn ahead_in_flight(&self) -> bool {
        self.ahead.is_some()
    }

    /// Look-ahead decoding (see the module docs): each submission also queues the step after
    /// it. Requests added meanwhile join the step after it (one step later than without
    /// look-ahead), a request that stops at step n leaves one dropped row in step n + 1, and
    /// none is queued past a request's `max_new_tokens`; each request's tokens and log-probs
    /// are the same bits as without it. Turning it off queues no further step; one already
    /// queued is still handed over by the next submission.
    pub fn set_lookahead(&mut self, on: bool) {
        self.lookahead = on;
    }

    /// Whether look-ahead decoding is on.
    pub fn lookahead(&self) -> bool {
        self.lookahead
    }

    /// Steps by which a request added after a submission joins later than one added before
    /// it: 1 with look-ahead (the next step is queued already), else 0.
    pub fn admission_lag(&self) -> u64 {
        u64::from(self.lookahead)
    }

    /// Admits requests that share nothing (`group` false, one request) or a group's samples.
    fn admit(
        &mut self,
        reqs: Vec<GenRequest>,
        group: bool,
        rejected: impl FnOnce() -> Rejected,
    ) -> Result<()> {
        for (i, r) in reqs.iter().enumerate() {
            validate_request(&self.cfg, r)?;
            if self.contains(r.id) || reqs[..i].iter().any(|o| o.id == r.id) {
                return Err(BackendError::DuplicateRequest(r.id));
            }
        }
        let shared = match &reqs[..] {
            [first, ..] if group => self.store.shared(first.prompt.len(), reqs.len()),
            _ => 0,
        };
        let positions: Vec<usize> = reqs.iter().map(GenRequest::kv_tokens).collect();
        // The shared prefix is reserved once, each request's other positions on their own.
        let kv = shared + positions.iter().map(|p| p - shared).sum::<usize>();
        let load = self.load();
        if !load.admits(&self.limits, reqs.len(), kv) {
            return load.admit(&self.limits, reqs.len(), kv, rejected);
        }
        let leases = match self.store.reserve(&positions, shared) {
            Ok(l) => l,
            Err(reason) => {
                return Err(BackendError::EngineFull {
                    reason,
                    rejected: Box::new(rejected()),
                });
            }
        };
        for (req, lease) in reqs.into_iter().zip(leases) {
            let rng = ChaCha8Rng::seed_from_u64(req.params.seed);
            self.push(req, rng, lease, shared);
        }
        Ok(())
    }

    fn push(&mut self, req: GenRequest, rng: ChaCha8Rng, lease: S::Lease, cached: usize) {
        self.next_uid += 1;
        self.active.push(Active {
            id: req.id,
            uid: self.next_uid,
            ahead_rng: None,
            rng,
            tokens: Vec::with_capacity(req.params.max_new_tokens),
            logprobs: Vec::with_capacity(req.params.max_new_tokens),
            orig: req.prompt.len(),
            prompt: req.prompt,
            params: req.params,
            lease,
            cached,
        });
    }

    /// Queues a request for the next step (validated, limits and KV capacity checked; a full
    /// engine hands it back).
    pub fn add_request(&mut self, req: GenRequest) -> Result<()> {
        let back = req.clone();
        self.admit(vec![req], false, || Rejected::Request(back))
    }

    /// Queues a group's samples, all or nothing, sharing their prompt's prefix where the
    /// store can.
    pub fn add_group(&mut self, group: GroupRequest) -> Result<()> {
        if group.samples.is_empty() {
            return Err(BackendError::EmptyBatch("group with no samples".into()));
        }
        let reqs = group.clone().into_requests();
        self.admit(reqs, true, || Rejected::Group(group))
    }

    /// Removes request `i`, freeing its pages.
    fn remove(&mut self, i: usize) -> Active<S::Lease> {
        let a = self.active.remove(i);
        self.store.release(&a.lease);
        a
    }

    /// Aborts a request, freeing its pages. During a step its output is dropped; its pages can
    /// be handed out again at once, since a later step runs after the one in flight.
    pub fn cancel(&mut self, id: RequestKey) -> Result<()> {
        let i = self
            .active
            .iter()
            .position(|a| a.id == id)
            .ok_or(BackendError::UnknownRequest(id))?;
        self.remove(i);
        Ok(())
    }

    /// Long-tail migration: removes a request that has generated tokens and returns its state
    /// (prompt, tokens so far, stream position); its pages are freed. Refused while a step is
    /// in flight, since that step has drawn from the request's stream already. A look-ahead
    /// step's row is dropped instead: the stream is rewound past its draw.
    pub fn export(&mut self, id: RequestKey) -> Result<ResumeState> {
        if self.in_flight() {
            return Err(BackendError::StepInFlight("export_request"));
        }
        let i = self
            .active
            .iter()
            .position(|a| a.id == id)
            .ok_or(BackendError::UnknownRequest(id))?;
        if self.active[i].tokens.is_empty() {
            return Err(not_started(id));
        }
        let mut a = self.remove(i);
        if let Some(pos) = a.ahead_rng {
            a.rng.set_word_pos(pos);
        }
        a.prompt.truncate(a.orig);
        Ok(exported(
            a.id, a.prompt, a.params, a.tokens, a.logprobs, &a.rng,
        ))
    }

    /// Queues an exported request: the next step prefills its prompt and generated tokens in
    /// one chunk and samples its next token from the restored stream position. A full engine
    /// hands the state back as [`Rejected::Resume`].
    pub fn resume(&mut self, st: ResumeState) -> Result<()> {
        validate_resume(&self.cfg, &st)?;
        if self.contains(st.request.id) {
            return Err(BackendError::DuplicateRequest(st.request.id));
        }
        let kv = st.request.kv_tokens();
        let rejected = || Rejected::Resume(Box::new(st.clone()));
        self.load().admit(&self.limits, 1, kv, rejected)?;
        let lease = match self.store.reserve(&[kv], 0) {
            Ok(mut l) => l.pop(),
            Err(reason) => {
                return Err(BackendError::EngineFull {
                    reason,
                    rejected: Box::new(rejected()),
                });
            }
        };
        let lease = lease.ok_or_else(|| BackendError::Device("KV store lost a lease".into()))?;
        let ResumeState {
            mut request,
            tokens,
            logprobs,
            stream_words,
        } = st;
        let mut rng = ChaCha8Rng::seed_from_u64(request.params.seed);
        rng.set_word_pos(stream_words);
        let orig = request.prompt.len();
        request.prompt.extend_from_slice(&tokens);
        self.push(request, rng, lease, 0);
        if let Some(a) = self.active.last_mut() {
            a.orig = orig;
            a.tokens = tokens;
            a.logprobs = logprobs;
        }
        Ok(())
    }

    /// Forgets the queued look-ahead step: no request takes its rows, and the streams of its
    /// requests are rewound past its draws. It may still run on the device; later work is
    /// queued behind it.
    pub fn drop_ahead(&mut self) {
        self.ahead = None;
        for a in &mut self.active {
            if let Some(pos) = a.ahead_rng.take() {
                a.rng.set_word_pos(pos);
            }
        }
    }
}

impl<S: KvStore, R> Engine<S, R> {
    /// Lays a step's rows out in `self.plan`: ids, positions, page tables and the sampling
    /// rows; chooses each unwritten group prefix's writer. Returns the rows' requests and
    /// lengths. `front` is the uncollected step that a look-ahead step follows (its rows): a
    /// request with a row there continues one position later, from the token that step
    /// samples (a feedback row), and has no row once that token is its last by
    /// `max_new_tokens`.
    fn pack(&mut self, front: Option<&[(u64, usize)]>) -> Vec<(u64, usize)> {
        let p = &mut self.plan;
        p.clear();
        let ahead = front.is_some();
        let front: HashMap<u64, (u32, usize)> = (front.unwrap_or_default().iter().enumerate())
            .map(|(row, &(uid, len))| (uid, (row as u32, len)))
            .collect();
        let mut rows = Vec::with_capacity(self.active.len());
        for a in &mut self.active {
            let pending = front.get(&a.uid).copied();
            if pending.is_some() && a.tokens.len() + 1 >= a.params.max_new_tokens {
                continue;
            }
            let prefix = self.store.prefix_len(&a.lease);
            if prefix > 0 && a.cached == prefix && self.store.claim_prefix(&a.lease) {
                // This sample prefills the whole prompt, the shared pages included.
                a.cached = 0;
            }
            let table_start = p.pages.len() as u32;
            self.store.table(&a.lease, &mut p.pages);
            let start = p.ids.len();
            let from = a.cached + pending.map_or(0, |(_, len)| len);
            if let Some((src, _)) = pending {
                // The token the front step samples: copied in on the device.
                p.feedback.push((start as u32, src));
                p.ids.push(0);
            } else if a.cached < a.prompt.len() {
                p.ids.extend_from_slice(&a.prompt[a.cached..]);
            } else {
                p.ids
                    .push(*a.tokens.last().unwrap_or(&a.prompt[a.prompt.len() - 1]));
            }
            let len = p.ids.len() - start;
            for t in from..from + len {
                p.pos.push(t as u32);
                p.meta.extend([table_start, t as u32]);
            }
            p.last.push((start + len - 1) as u32);
            rows.push((a.uid, len));
            if ahead {
                a.ahead_rng = Some(a.rng.get_word_pos());
            }
            // One draw per token per request, from its own stream.
            let s = &a.params;
            p.sample.push(SampleRow {
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                u: uniform(&mut a.rng),
            });
        }
        p.page_rows = self.store.page_rows();
        p.kv_pages = self.store.pages_used();
        rows
    }

    /// Packs and launches a step (`None` when no request has a row in it), behind `front`
    /// for a look-ahead step.
    fn launch<D: Decoder<Run = R>>(
        &mut self,
        dec: &mut D,
        front: Option<&Stepped<R>>,
    ) -> Result<Option<Stepped<R>>> {
        let rows = self.pack(front.map(|f| &f.rows[..]));
        if rows.is_empty() {
            return Ok(None);
        }
        let run = dec.launch(&self.plan, front.map(|f| &f.run))?;
        Ok(Some(Stepped { run, rows }))
    }

    /// Submits one engine step without waiting for it; with look-ahead on the queued step
    /// becomes this one and the step after it is queued. Refused while the previous step has
    /// not been collected.
    pub fn submit<D: Decoder<Run = R>>(&mut self, dec: &mut D) -> Result<()> {
        if self.stepped.is_some() {
            return Err(BackendError::StepInFlight("submit_step"));
        }
        if self.active.is_empty() {
            self.drop_ahead();
            return Ok(());
        }
        self.stepped = match self.ahead.take() {
            Some(next) => {
                for a in &mut self.active {
                    a.ahead_rng = None;
                }
                Some(next)
            }
            None => self.launch(dec, None)?,
        };
        if self.lookahead
            && dec.queues()
            && let Some(front) = self.stepped.take()
        {
            let ahead = self.launch(dec, Some(&front));
            self.stepped = Some(front);
            // On an error the step itself is still in flight (poll collects it); nothing is
            // queued behind it and no stream has moved for it.
            self.ahead = ahead.inspect_err(|_| self.drop_ahead())?;
        }
        Ok(())
    }

    /// Collects the submitted step: the requests that finished in it, `None` while it runs
    /// and `wait` is false, `Some(vec![])` with no step in flight. Waiting waits for this step
    /// only, not for a look-ahead step queued behind it.
    pub fn poll<D: Decoder<Run = R>>(
        &mut self,
        dec: &mut D,
        wait: bool,
    ) -> Result<Option<Vec<GenOutput>>> {
        let Some(mut st) = self.stepped.take() else {
            return Ok(Some(Vec::new()));
        };
        let back = match dec.poll(&mut st.run, wait) {
            Ok(Some(b)) => b,
            Ok(None) => {
                self.stepped = Some(st);
                return Ok(None);
            }
            Err(e) => {
                // The step is lost, and a look-ahead step built on its tokens with it; its
                // requests stay and can be cancelled, unless their caches went with it.
                self.drop_ahead();
                if dec.lost_cache() {
                    while !self.active.is_empty() {
                        self.remove(0);
                    }
                }
                return Err(e);
            }
        };
        let mut finished = Vec::new();
        for (row, &(uid, len)) in st.rows.iter().enumerate() {
            // Cancelled, exported or finished since the step was packed: dropped.
            let Some(i) = self.active.iter().position(|a| a.uid == uid) else {
                continue;
            };
            let (tok, lp) = (back.tokens[row], back.logp[row]);
            let a = &mut self.active[i];
            a.cached += len;
            a.tokens.push(tok);
            a.logprobs.push(lp);
            if let Some(finish) = finish_reason(&a.params, tok, a.tokens.len()) {
                let a = self.remove(i);
                finished.push(GenOutput {
                    id: a.id,
                    tokens: a.tokens,
                    logprobs: a.logprobs,
                    finish,
                });
            }
        }
        Ok(Some(finished))
    }
}
