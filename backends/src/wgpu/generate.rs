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
//! [`Generator::poll`] collects it, so the host is free while the device runs.
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

use super::gpu::{Exec, Gpu, Ticket};
use super::inflight::InFlight;
use super::kv::{KvPool, PAGE, StepRows, pages_for};
use super::model::DeviceModel;
use super::ops;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::seam::{GenOutput, GenRequest, Rejected, RequestKey, ResumeState, SamplingParams};

// The CPU reference's draw and finish rule, shared so both backends sample the same stream
// and end requests alike (requests are checked by the backend, with the CPU's checks).
use crate::cpu::generate::{exported, finish_reason, not_started, uniform};

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

/// Per-step buffers for up to `cap_n` rows, `cap_r` requests and `cap_p` page-table entries.
#[derive(Debug)]
struct StepBufs {
    cap_n: usize,
    cap_r: usize,
    cap_p: usize,
    ids: Buffer,
    pos: Buffer,
    meta: Buffer,
    pages: Buffer,
    last: Buffer,
    rowp: Buffer,
    x: Buffer,
    x_mid: Buffer,
    ln: Buffer,
    rstd: Buffer,
    q_pre: Buffer,
    q: Buffer,
    k_pre: Buffer,
    k: Buffer,
    v: Buffer,
    att_out: Buffer,
    /// Decode attention's running max and sum per (row, head) between split launches.
    att_state: Buffer,
    tmp: Buffer,
    gate: Buffer,
    up: Buffer,
    h: Buffer,
    hsel: Buffer,
    hnorm: Buffer,
    logits: Buffer,
    tokens: Buffer,
    logp: Buffer,
}

impl StepBufs {
    fn new(gpu: &Gpu, c: &ModelConfig, n: usize, r: usize, pages: usize) -> Self {
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qd, kd, h) = (c.q_dim(), c.kv_dim(), c.num_attention_heads);
        let b = |name: &str, len: usize| gpu.buffer(&format!("decode {name}"), len);
        Self {
            cap_n: n,
            cap_r: r,
            cap_p: pages,
            ids: b("ids", n),
            pos: b("pos", n),
            meta: b("row meta", 2 * n),
            pages: b("page tables", pages),
            last: b("last rows", r),
            rowp: b("sampling rows", 4 * r),
            x: b("x", n * d),
            x_mid: b("x_mid", n * d),
            ln: b("ln", n * d),
            rstd: b("rstd", n * h),
            q_pre: b("q_pre", n * qd),
            q: b("q", n * qd),
            k_pre: b("k_pre", n * kd),
            k: b("k", n * kd),
            v: b("v", n * kd),
            att_out: b("att_out", n * qd),
            att_state: b("attention state", 2 * n * h),
            tmp: b("tmp", n * d),
            gate: b("gate", n * f),
            up: b("up", n * f),
            h: b("h", n * f),
            hsel: b("hsel", r * d),
            hnorm: b("hnorm", r * d),
            logits: b("logits", r * v),
            tokens: b("tokens", r),
            logp: b("token logp", r),
        }
    }
}

/// A submitted step: the requests of its rows (with their new positions) and where their
/// tokens come back.
#[derive(Debug)]
struct Stepped {
    run: InFlight,
    rows: Vec<(RequestKey, usize)>,
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
    stepped: Option<Stepped>,
    ids: Vec<u32>,
    pos: Vec<u32>,
    meta: Vec<u32>,
    pages: Vec<u32>,
    last: Vec<u32>,
    rowp: Vec<[f32; 4]>,
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
            self.active.push(Active {
                id: req.id,
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
    /// pages once no sample holds them). Refused while a step is in flight, since that step
    /// has drawn from the request's stream already.
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
        self.active.push(Active {
            id: request.id,
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

    /// Lays the step's rows out on the host: ids, positions, per-row page-table offsets and
    /// the sampling rows; chooses each unfilled group prefix's writer. Returns the rows'
    /// requests and lengths.
    fn pack(&mut self) -> Vec<(RequestKey, usize)> {
        self.ids.clear();
        self.pos.clear();
        self.meta.clear();
        self.pages.clear();
        self.last.clear();
        self.rowp.clear();
        let mut rows = Vec::with_capacity(self.active.len());
        for a in &mut self.active {
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
            if a.cached < a.prompt.len() {
                self.ids.extend_from_slice(&a.prompt[a.cached..]);
            } else {
                self.ids
                    .push(*a.tokens.last().unwrap_or(&a.prompt[a.prompt.len() - 1]));
            }
            let len = self.ids.len() - start;
            for t in a.cached..a.cached + len {
                self.pos.push(t as u32);
                self.meta.extend([table_start, t as u32]);
            }
            self.last.push((start + len - 1) as u32);
            rows.push((a.id, len));
            // One draw per token per request, as the CPU reference (which draws after the
            // forward; the stream is the request's own, so the order across requests is moot).
            let u = uniform(&mut a.rng);
            let p = &a.params;
            self.rowp
                .push(ops::sample_row(p.temperature, p.top_k, p.top_p, u));
        }
        rows
    }

    /// Encodes and submits one engine step (see the module docs) without waiting for it.
    /// Refused while the previous step has not been collected.
    pub fn submit(&mut self, gpu: &Gpu, ex: &mut Exec, md: &DeviceModel) -> Result<()> {
        if self.stepped.is_some() {
            return Err(BackendError::StepInFlight("submit_step"));
        }
        if self.active.is_empty() {
            return Ok(());
        }
        let c = &md.cfg;
        if pool_in(&mut self.pool, gpu, c)?.ensure_built(gpu, ex, c) {
            ex.forget_bind_groups();
        }
        let rows = self.pack();
        let (n, r, np) = (self.ids.len(), self.active.len(), self.pages.len());
        if self
            .bufs
            .as_ref()
            .is_none_or(|b| b.cap_n < n || b.cap_r < r || b.cap_p < np)
        {
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
        gpu.write(&s.ids, &self.ids);
        gpu.write(&s.pos, &self.pos);
        gpu.write(&s.meta, &self.meta);
        gpu.write(&s.pages, &self.pages);
        gpu.write(&s.last, &self.last);
        gpu.write(&s.rowp, &self.rowp);
        let max_pos = self.pos.iter().copied().max().unwrap_or(0) as usize;
        encode_step(ex, md, s, pool, n, r, np, max_pos)?;
        let tokens = ex.read_back(&s.tokens, 0, r * 4);
        let logp = ex.read_back(&s.logp, 0, r * 4);
        let run = ex.submit_async()?;
        self.stepped = Some(Stepped {
            run,
            rows,
            tokens,
            logp,
        });
        Ok(())
    }

    /// Collects the submitted step: the requests that finished in it, `None` while it runs
    /// and `wait` is false, `Some(vec![])` with no step in flight.
    pub fn poll(&mut self, ex: &mut Exec, wait: bool) -> Result<Option<Vec<GenOutput>>> {
        let Some(mut st) = self.stepped.take() else {
            return Ok(Some(Vec::new()));
        };
        // On an error the step is lost; its requests stay and can be cancelled.
        let Some(back) = st.run.poll(wait)? else {
            self.stepped = Some(st);
            return Ok(None);
        };
        ex.recycle(&mut st.run);
        let (toks, lps) = (back.get::<u32>(st.tokens), back.get::<f32>(st.logp));
        let mut finished = Vec::new();
        for (row, &(id, len)) in st.rows.iter().enumerate() {
            // Cancelled while the step ran: dropped.
            let Some(i) = self.active.iter().position(|a| a.id == id) else {
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

/// Records the model's forward over the step's `n` rows (positions up to `max_pos`) and the
/// sampling of its `r` requests' last rows (`np` page-table entries).
#[allow(clippy::too_many_arguments)]
fn encode_step(
    ex: &mut Exec,
    md: &DeviceModel,
    s: &StepBufs,
    pool: &KvPool,
    n: usize,
    r: usize,
    np: usize,
    max_pos: usize,
) -> Result<()> {
    let c = &md.cfg;
    let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (qd, kd) = (c.q_dim(), c.kv_dim());
    let eps = c.rms_norm_eps;
    let maxp = c.max_position_embeddings;
    let p = &md.params;
    let wf = md.weights;
    let rows = StepRows {
        q: &s.q,
        out: &s.att_out,
        state: &s.att_state,
        k: &s.k,
        v: &s.v,
        meta: &s.meta,
        pages: &s.pages,
        n,
        pages_len: np,
        max_pos,
    };
    ops::embedding_fwd_as(ex, &s.x, &s.ids, &p[md.embed], wf, n, d, v);
    for (l, li) in md.layers.iter().enumerate() {
        ops::rmsnorm_fwd(ex, &s.ln, &s.rstd, &s.x, &p[li.input_norm], n, d, eps);
        ops::matmul_fwd_as(ex, &s.q_pre, &s.ln, &p[li.q], wf, n, d, qd, false);
        ops::matmul_fwd_as(ex, &s.k_pre, &s.ln, &p[li.k], wf, n, d, kd, false);
        ops::matmul_fwd_as(ex, &s.v, &s.ln, &p[li.v], wf, n, d, kd, false);
        ops::rmsnorm_fwd(ex, &s.q, &s.rstd, &s.q_pre, &p[li.q_norm], n * h, hd, eps);
        ops::rmsnorm_fwd(ex, &s.k, &s.rstd, &s.k_pre, &p[li.k_norm], n * kvh, hd, eps);
        ops::rope_fwd(ex, &s.q, &s.pos, &md.cos, &md.sin, n, h, hd, maxp);
        ops::rope_fwd(ex, &s.k, &s.pos, &md.cos, &md.sin, n, kvh, hd, maxp);
        rows.kv_append(ex, pool, l, c)?;
        rows.attention_decode(ex, pool, l, c)?;
        ops::matmul_fwd_as(ex, &s.tmp, &s.att_out, &p[li.o], wf, n, qd, d, false);
        ops::residual_fwd(ex, &s.x_mid, &s.x, &s.tmp, n * d);
        ops::rmsnorm_fwd(ex, &s.ln, &s.rstd, &s.x_mid, &p[li.post_norm], n, d, eps);
        ops::matmul_fwd_as(ex, &s.gate, &s.ln, &p[li.gate], wf, n, d, f, false);
        ops::matmul_fwd_as(ex, &s.up, &s.ln, &p[li.up], wf, n, d, f, false);
        ops::swiglu_fwd(ex, &s.h, &s.gate, &s.up, n * f);
        ops::matmul_fwd_as(ex, &s.tmp, &s.h, &p[li.down], wf, n, f, d, false);
        ops::residual_fwd(ex, &s.x, &s.x_mid, &s.tmp, n * d);
    }
    ops::embedding_fwd(ex, &s.hsel, &s.last, &s.x, r, d, n);
    ops::rmsnorm_fwd(ex, &s.hnorm, &s.rstd, &s.hsel, &p[md.final_norm], r, d, eps);
    ops::matmul_fwd_as(ex, &s.logits, &s.hnorm, &p[md.lm_head], wf, r, d, v, false);
    ops::sample(ex, &s.tokens, &s.logp, &s.logits, &s.rowp, r, v);
    Ok(())
}
