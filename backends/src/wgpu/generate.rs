//! Continuous-batching generation on the device: the paged KV pool ([`super::kv`]), one
//! non-blocking submission per decode step, and sampling on the device.
//!
//! Each step packs, per active request, the tokens not yet in its cache (its prompt when it
//! just joined, else its last token), exactly as the CPU reference's `cpu::generate`. The
//! projections are single matmuls over all rows; per layer one KV-append dispatch writes
//! every row's new keys and values into its request's pages, and the decode attention reads
//! each row's positions through its page table. Only the last row of each request reaches
//! the final norm, `lm_head` and `sample`, and only the sampled tokens and their log-probs
//! come back (8 bytes per request). [`Generator::submit`] queues the step and returns;
//! [`Generator::poll`] collects it, so the host is free while the device runs. The step's
//! buffers and its recording are in `wgpu/decode.rs`.
//!
//! With look-ahead ([`Generator::set_lookahead`]) each submission also queues the step after
//! it: every request of the running step continues one position later from the token that
//! step samples, which the device copies into the next step's input (token feedback), so the
//! host never waits for a token before it can queue work. What the host learns from the
//! running step (a stop token, a cancel) drops that request's row in the queued one.
//!
//! A group's samples share the pages of their prompt's first [`shared_prefix`] positions
//! (whole pages). In the group's first step one sample (the first still active) prefills the
//! whole prompt, writing the shared pages; every other sample computes only the prompt
//! positions past the shared pages (fewer than a page plus one), against the shared pages
//! written by the same step's KV-append. Every row's result depends only on its own inputs
//! (batch invariance), so a sample's keys, values and tokens equal those it would have
//! generated alone, bit for bit.
//!
//! Sampling uses the same per-request stream as the CPU: a ChaCha8 generator seeded with the
//! request's seed, one 53-bit uniform per token, so that tokens depend only on the seed and
//! the weights (batch invariance). Where float differences can still flip a token, see the
//! `sample` kernel's notes and the conformance suite.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use wgpu::Buffer;

use std::collections::HashMap;

use super::decode::{StepBufs, encode_step, feed_tokens};
use super::gpu::{Exec, Gpu, Ticket};
use super::inflight::InFlight;
use super::kv::{KvPool, PAGE, pages_for};
use super::model::DeviceModel;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::seam::{GenOutput, GenRequest, Rejected, RequestKey, ResumeState, SamplingParams};

use crate::model::sampling::{exported, finish_reason, not_started, sample_row, uniform};

/// Positions of a group's prompt stored once for all samples: the whole pages before the
/// prompt's last position (whose logits each sample needs, so each computes it).
pub fn shared_prefix(prompt_len: usize) -> usize {
    (prompt_len.saturating_sub(1) / PAGE) * PAGE
}

/// Positions `reqs` store once: a group (`group`) of two or more samples shares its prompt's
/// [`shared_prefix`]; a lone request shares nothing.
pub fn shared_positions(reqs: &[GenRequest], group: bool) -> usize {
    match reqs {
        [first, _, ..] if group => shared_prefix(first.prompt.len()),
        _ => 0,
    }
}

/// The pool in `slot`, made for `c` on `gpu` the first time.
fn pool_in<'p>(slot: &'p mut Option<KvPool>, gpu: &Gpu, c: &ModelConfig) -> Result<&'p mut KvPool> {
    let pool = match slot.take() {
        Some(p) => p,
        None => KvPool::new(gpu, c)?,
    };
    Ok(slot.insert(pool))
}

#[derive(Debug)]
struct Active {
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
    /// The group prefix whose pages hold positions `0..prefix.len` (`None`: none).
    prefix: Option<u64>,
    /// Pages of the positions past the prefix.
    own: Vec<u32>,
    /// Positions whose keys and values are in the pool.
    cached: usize,
}

/// A group's shared prompt pages.
#[derive(Debug)]
struct Prefix {
    pages: Vec<u32>,
    len: usize,
    /// Samples still holding it.
    refs: usize,
    /// Whether a step has written its pages (a sample was chosen to prefill the prompt).
    filled: bool,
}

/// A submitted step: its requests (by [`Active::uid`]) with the positions each computes, in
/// the order of their sampled rows, and where their tokens come back.
#[derive(Debug)]
struct Stepped {
    run: InFlight,
    rows: Vec<(u64, usize)>,
    /// The buffer its sampler writes the tokens to, which a look-ahead step behind it reads
    /// its input tokens from (kept here so that a reallocation of the step buffers cannot
    /// drop it first).
    sampled: Buffer,
    tokens: Ticket,
    logp: Ticket,
}

/// The engine state: active requests, the KV pool and the step buffers.
#[derive(Debug, Default)]
pub struct Generator {
    active: Vec<Active>,
    prefixes: HashMap<u64, Prefix>,
    next_prefix: u64,
    pool: Option<KvPool>,
    bufs: Option<StepBufs>,
    /// The step submitted by [`Generator::submit`] and not yet collected.
    stepped: Option<Stepped>,
    /// Look-ahead: the next step, queued on the device behind `stepped` (see
    /// [`Generator::set_lookahead`]).
    ahead: Option<Stepped>,
    lookahead: bool,
    next_uid: u64,
    ids: Vec<u32>,
    pos: Vec<u32>,
    meta: Vec<u32>,
    pages: Vec<u32>,
    last: Vec<u32>,
    rowp: Vec<[f32; 4]>,
    /// Rows of a look-ahead step whose input token the previous step samples:
    /// `(row of this step, sampled row of the previous step)`.
    feedback: Vec<(u32, u32)>,
}

impl Generator {
    /// Requests added and not finished or cancelled.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// KV positions reserved: every request's own positions and each shared prefix once.
    pub fn kv_positions(&self) -> usize {
        let own: usize = self
            .active
            .iter()
            .map(|a| a.orig + a.params.max_new_tokens - self.prefix_len(a))
            .sum();
        own + self.prefixes.values().map(|p| p.len).sum::<usize>()
    }

    /// Whether request `id` is active (added, not finished or cancelled).
    pub fn contains(&self, id: RequestKey) -> bool {
        self.active.iter().any(|a| a.id == id)
    }

    /// Whether a step is submitted and not yet collected.
    pub fn in_flight(&self) -> bool {
        self.stepped.is_some()
    }

    /// Whether a look-ahead step is queued on the device (behind the submitted step, or, once
    /// that is collected, waiting to become the next submission).
    pub fn ahead_in_flight(&self) -> bool {
        self.ahead.is_some()
    }

    /// Look-ahead decoding: each submission also queues the step after it, whose input
    /// tokens the device copies from the step before (device-side token feedback), so that
    /// the device runs step n + 1 while the host collects step n and prepares n + 2. The next
    /// [`submit`](Generator::submit) hands that step over and queues another. Requests added
    /// meanwhile join the step after it (one step later than without look-ahead), a request
    /// that stops at step n leaves one dropped row in step n + 1, and none is queued past a
    /// request's `max_new_tokens`. Every row depends only on its own request (batch
    /// invariance), so each request's tokens and log-probs are the same bits as without it.
    /// Turning it off queues no further step; one already queued is still handed over by the
    /// next submission.
    pub fn set_lookahead(&mut self, on: bool) {
        self.lookahead = on;
    }

    /// Whether look-ahead decoding is on ([`Generator::set_lookahead`]).
    pub fn lookahead(&self) -> bool {
        self.lookahead
    }

    /// Forgets the queued look-ahead step: no request takes its rows, and the streams of its
    /// requests are rewound past its draws. It may still run on the device; later work is
    /// queued behind it. For a step with no active request's row (none is active, the engine
    /// is idle), the step before it lost, or one that could not be submitted.
    pub fn drop_ahead(&mut self) {
        self.ahead = None;
        for a in &mut self.active {
            if let Some(pos) = a.ahead_rng.take() {
                a.rng.set_word_pos(pos);
            }
        }
    }

    fn prefix_len(&self, a: &Active) -> usize {
        a.prefix
            .and_then(|p| self.prefixes.get(&p))
            .map_or(0, |p| p.len)
    }

    /// Caps the KV pool at `pages` pages of [`PAGE`] positions (see [`KvPool::set_max_pages`]).
    pub fn set_kv_pages(&mut self, gpu: &Gpu, c: &ModelConfig, pages: usize) -> Result<()> {
        pool_in(&mut self.pool, gpu, c)?.set_max_pages(gpu, c, pages)
    }

    /// The KV pool's capacity in pages.
    pub fn kv_pages(&mut self, gpu: &Gpu, c: &ModelConfig) -> Result<usize> {
        Ok(pool_in(&mut self.pool, gpu, c)?.max_pages())
    }

    /// Queues requests for the next step: one alone (`group` false), or a group's samples
    /// (same prompt) sharing the prompt's [`shared_prefix`]. All or nothing: when the pool
    /// has too few free pages the requests come back as [`BackendError::EngineFull`]
    /// carrying `rejected(requests)`. Requests are validated by the caller.
    pub fn add(
        &mut self,
        gpu: &Gpu,
        c: &ModelConfig,
        reqs: Vec<GenRequest>,
        group: bool,
        rejected: impl FnOnce(Vec<GenRequest>) -> Rejected,
    ) -> Result<()> {
        if reqs.is_empty() {
            return Err(BackendError::EmptyBatch("no request".into()));
        }
        let shared = shared_positions(&reqs, group);
        let own: Vec<usize> = reqs
            .iter()
            .map(|r| pages_for(r.prompt.len() + r.params.max_new_tokens - shared))
            .collect();
        let need = pages_for(shared) + own.iter().sum::<usize>();
        let pool = pool_in(&mut self.pool, gpu, c)?;
        if need > pool.free_pages() {
            return Err(BackendError::EngineFull {
                reason: format!(
                    "{} request(s) need {need} KV pages of {PAGE} positions, {} of the pool's {} are free",
                    reqs.len(),
                    pool.free_pages(),
                    pool.max_pages()
                ),
                rejected: Box::new(rejected(reqs)),
            });
        }
        let mut alloc = |n| {
            pool.alloc(n)
                .ok_or_else(|| BackendError::Device("KV pool lost free pages".into()))
        };
        let prefix = if shared > 0 {
            let pages = alloc(pages_for(shared))?;
            let id = self.next_prefix;
            self.next_prefix += 1;
            self.prefixes.insert(
                id,
                Prefix {
                    pages,
                    len: shared,
                    refs: reqs.len(),
                    filled: false,
                },
            );
            Some(id)
        } else {
            None
        };
        let mut tables = Vec::with_capacity(reqs.len());
        for n in own {
            tables.push(alloc(n)?);
        }
        for (req, own) in reqs.into_iter().zip(tables) {
            self.next_uid += 1;
            self.active.push(Active {
                id: req.id,
                uid: self.next_uid,
                ahead_rng: None,
                rng: ChaCha8Rng::seed_from_u64(req.params.seed),
                tokens: Vec::with_capacity(req.params.max_new_tokens),
                logprobs: Vec::with_capacity(req.params.max_new_tokens),
                orig: req.prompt.len(),
                prompt: req.prompt,
                params: req.params,
                prefix,
                own,
                cached: shared,
            });
        }
        Ok(())
    }

    /// Long-tail migration: removes a request that has generated tokens and returns its state
    /// (prompt, tokens so far, stream position); its pages are freed (a group's shared prompt
    /// pages once no sample holds them). Refused while a submitted step is in flight, since
    /// that step has drawn from the request's stream already. A look-ahead step's row is
    /// dropped instead: the stream is rewound past its draw.
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
        let mut a = self.active.remove(i);
        self.release(&a);
        if let Some(pos) = a.ahead_rng {
            a.rng.set_word_pos(pos);
        }
        a.prompt.truncate(a.orig);
        Ok(exported(
            a.id, a.prompt, a.params, a.tokens, a.logprobs, &a.rng,
        ))
    }

    /// Queues an exported request (validated by the caller): the next step prefills its
    /// prompt and generated tokens in one chunk, on pages of its own, and samples its next
    /// token from the restored stream position. A pool with too few free pages hands the
    /// state back as [`Rejected::Resume`].
    pub fn resume(&mut self, gpu: &Gpu, c: &ModelConfig, st: ResumeState) -> Result<()> {
        let orig = st.request.prompt.len();
        let need = pages_for(orig + st.request.params.max_new_tokens);
        let pool = pool_in(&mut self.pool, gpu, c)?;
        if need > pool.free_pages() {
            return Err(BackendError::EngineFull {
                reason: format!(
                    "a resumed request needs {need} KV pages of {PAGE} positions, {} of the pool's {} are free",
                    pool.free_pages(),
                    pool.max_pages()
                ),
                rejected: Box::new(Rejected::Resume(Box::new(st))),
            });
        }
        let own = pool
            .alloc(need)
            .ok_or_else(|| BackendError::Device("KV pool lost free pages".into()))?;
        let ResumeState {
            request,
            tokens,
            logprobs,
            stream_words,
        } = st;
        let mut rng = ChaCha8Rng::seed_from_u64(request.params.seed);
        rng.set_word_pos(stream_words);
        let mut prompt = request.prompt;
        prompt.extend_from_slice(&tokens);
        self.next_uid += 1;
        self.active.push(Active {
            id: request.id,
            uid: self.next_uid,
            ahead_rng: None,
            prompt,
            orig,
            params: request.params,
            rng,
            tokens,
            logprobs,
            prefix: None,
            own,
            cached: 0,
        });
        Ok(())
    }

    /// Frees a request's pages, and its group prefix's once no sample holds it.
    fn release(&mut self, a: &Active) {
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        pool.release(&a.own);
        if let Some(id) = a.prefix
            && let Some(p) = self.prefixes.get_mut(&id)
        {
            p.refs -= 1;
            if p.refs == 0
                && let Some(p) = self.prefixes.remove(&id)
            {
                pool.release(&p.pages);
            }
        }
    }

    /// Aborts a request, freeing its pages. During a step its output is dropped; the pages
    /// can be handed out again at once, since a later step is queued after the running one.
    pub fn cancel(&mut self, id: RequestKey) -> Result<()> {
        let i = self
            .active
            .iter()
            .position(|a| a.id == id)
            .ok_or(BackendError::UnknownRequest(id))?;
        let a = self.active.remove(i);
        self.release(&a);
        Ok(())
    }

    /// Lays a step's rows out on the host: ids, positions, per-row page-table offsets and
    /// the sampling rows; chooses each unfilled group prefix's writer. Returns the rows'
    /// requests and lengths. `front` is the uncollected step that a look-ahead step follows
    /// (its rows): a request with a row there continues one position later, from the token
    /// that step samples (a [`Generator::feedback`] row), and has no row once that token is
    /// its last by `max_new_tokens`.
    fn pack(&mut self, front: Option<&[(u64, usize)]>) -> Vec<(u64, usize)> {
        self.ids.clear();
        self.pos.clear();
        self.meta.clear();
        self.pages.clear();
        self.last.clear();
        self.rowp.clear();
        self.feedback.clear();
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
            let table_start = self.pages.len() as u32;
            if let Some(p) = a.prefix.and_then(|id| self.prefixes.get_mut(&id)) {
                if !p.filled && a.cached == p.len {
                    // This sample prefills the whole prompt, the shared pages included.
                    p.filled = true;
                    a.cached = 0;
                }
                self.pages.extend_from_slice(&p.pages);
            }
            self.pages.extend_from_slice(&a.own);
            let start = self.ids.len();
            let from = a.cached + pending.map_or(0, |(_, len)| len);
            if let Some((src, _)) = pending {
                // The token the front step samples: copied in on the device.
                self.feedback.push((start as u32, src));
                self.ids.push(0);
            } else if a.cached < a.prompt.len() {
                self.ids.extend_from_slice(&a.prompt[a.cached..]);
            } else {
                self.ids
                    .push(*a.tokens.last().unwrap_or(&a.prompt[a.prompt.len() - 1]));
            }
            let len = self.ids.len() - start;
            for t in from..from + len {
                self.pos.push(t as u32);
                self.meta.extend([table_start, t as u32]);
            }
            self.last.push((start + len - 1) as u32);
            rows.push((a.uid, len));
            if ahead {
                a.ahead_rng = Some(a.rng.get_word_pos());
            }
            // One draw per token per request, as the CPU reference (which draws after the
            // forward; the stream is the request's own, so the order across requests is moot).
            let u = uniform(&mut a.rng);
            let p = &a.params;
            self.rowp
                .push(sample_row(p.temperature, p.top_k, p.top_p, u));
        }
        rows
    }

    /// Encodes and submits one engine step (see the module docs) without waiting for it;
    /// with look-ahead on ([`Generator::set_lookahead`]) the queued step becomes this one and
    /// the step after it is queued. Refused while the previous step has not been collected.
    pub fn submit(&mut self, gpu: &Gpu, ex: &mut Exec, md: &DeviceModel) -> Result<()> {
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
            None => self.launch(gpu, ex, md, None)?,
        };
        if self.lookahead
            && let Some(front) = self.stepped.take()
        {
            let ahead = self.launch(gpu, ex, md, Some((&front.rows, &front.sampled)));
            self.stepped = Some(front);
            // On an error the step itself is still in flight (poll collects it); nothing is
            // queued behind it and no stream has moved for it.
            self.ahead = ahead.inspect_err(|_| self.drop_ahead())?;
        }
        Ok(())
    }

    /// Packs, encodes and submits a step (`None` when no request has a row in it): behind
    /// `front` (its rows and sampled-token buffer) when a look-ahead step.
    fn launch(
        &mut self,
        gpu: &Gpu,
        ex: &mut Exec,
        md: &DeviceModel,
        front: Option<(&[(u64, usize)], &Buffer)>,
    ) -> Result<Option<Stepped>> {
        let c = &md.cfg;
        let rows = self.pack(front.map(|f| f.0));
        if rows.is_empty() {
            return Ok(None);
        }
        // A pool growth copies the old pages after the steps already queued have run.
        if pool_in(&mut self.pool, gpu, c)?.ensure_built(gpu, ex, c) {
            ex.forget_bind_groups();
        }
        let (n, r, np) = (self.ids.len(), rows.len(), self.pages.len());
        if self
            .bufs
            .as_ref()
            .is_none_or(|b| b.cap_n < n || b.cap_r < r || b.cap_p < np)
        {
            // Steps in flight keep the old buffers alive; the front's sampled tokens are read
            // from its own buffer.
            let cap_n = n.next_power_of_two().max(64);
            let cap_r = r.next_power_of_two().max(16);
            let cap_p = np.next_power_of_two().max(64);
            self.bufs = None;
            ex.forget_bind_groups();
            self.bufs = Some(StepBufs::new(gpu, c, cap_n, cap_r, cap_p));
        }
        let (Some(s), Some(pool)) = (self.bufs.as_ref(), self.pool.as_ref()) else {
            return Err(BackendError::Device("decode buffers missing".into()));
        };
        // Queue writes land after the steps already submitted have read these buffers.
        gpu.write(&s.ids, &self.ids);
        gpu.write(&s.pos, &self.pos);
        gpu.write(&s.meta, &self.meta);
        gpu.write(&s.pages, &self.pages);
        gpu.write(&s.last, &self.last);
        gpu.write(&s.rowp, &self.rowp);
        if let Some((_, sampled)) = front {
            feed_tokens(ex, sampled, &s.ids, &self.feedback);
        }
        let max_pos = self.pos.iter().copied().max().unwrap_or(0) as usize;
        encode_step(ex, md, s, pool, n, r, np, max_pos)?;
        let tokens = ex.read_back(&s.tokens, 0, r * 4);
        let logp = ex.read_back(&s.logp, 0, r * 4);
        let run = ex.submit_async()?;
        Ok(Some(Stepped {
            run,
            rows,
            sampled: s.tokens.clone(),
            tokens,
            logp,
        }))
    }

    /// Collects the submitted step: the requests that finished in it, `None` while it runs
    /// and `wait` is false, `Some(vec![])` with no step in flight. Waiting waits for this
    /// step only, not for a look-ahead step queued behind it.
    pub fn poll(&mut self, ex: &mut Exec, wait: bool) -> Result<Option<Vec<GenOutput>>> {
        let Some(mut st) = self.stepped.take() else {
            return Ok(Some(Vec::new()));
        };
        // On an error the step is lost, and a look-ahead step built on its tokens with it; its
        // requests stay and can be cancelled.
        let Some(back) = st.run.poll(wait).inspect_err(|_| self.drop_ahead())? else {
            self.stepped = Some(st);
            return Ok(None);
        };
        ex.recycle(&mut st.run);
        let (toks, lps) = (back.get::<u32>(st.tokens), back.get::<f32>(st.logp));
        let mut finished = Vec::new();
        for (row, &(uid, len)) in st.rows.iter().enumerate() {
            // Cancelled, exported or finished since the step was packed: dropped.
            let Some(i) = self.active.iter().position(|a| a.uid == uid) else {
                continue;
            };
            let (tok, lp) = (toks[row], lps[row]);
            let a = &mut self.active[i];
            a.cached += len;
            a.tokens.push(tok);
            a.logprobs.push(lp);
            if let Some(finish) = finish_reason(&a.params, tok, a.tokens.len()) {
                let a = self.active.remove(i);
                self.release(&a);
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
