//! Generation with continuous batching: a KV cache per request, prefill and decode in one step.
//!
//! Each `decode_step` packs, for every active request, the tokens it has not yet cached (its whole
//! prompt when it just joined, else its last sampled token) into one batch, so the projections of
//! all requests are single GEMMs while attention runs per request against its own cache. A
//! request samples from its own ChaCha stream (seeded by its `seed`, one draw per token), and
//! every per-row computation is independent of the other rows, so its tokens depend only on its
//! seed and the weights, never on which requests share the step. Buffers are grow-only and KV
//! caches are recycled, so steady-state decoding does not allocate per token.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use rayon::prelude::*;

use super::model::{Model, fit};
use super::ops::*;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::check::{validate_request, validate_resume};
use crate::model::sampling::{exported, finish_reason, not_started, uniform};
use crate::seam::{GenOutput, GenRequest, RequestKey, ResumeState, SamplingParams};

/// One active request and its KV cache.
#[derive(Debug)]
struct Active {
    id: RequestKey,
    /// What the request prefills: its prompt, followed by the tokens it had generated when it
    /// was resumed on this engine (long-tail migration).
    prompt: Vec<u32>,
    /// Length of its own prompt (`prompt.len()` unless resumed).
    orig: usize,
    params: SamplingParams,
    rng: ChaCha8Rng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    /// `[layers, cap, kv_dim]` keys and values.
    k: Vec<f32>,
    v: Vec<f32>,
    cap: usize,
    /// Positions already in the cache.
    cached: usize,
    /// Attention probabilities scratch, `[heads, chunk, cached + chunk]`.
    att: Vec<f32>,
    /// Samples of this request's group that wait for its prefill to copy the prompt's KV.
    followers: Vec<GenRequest>,
}

impl Active {
    /// A request with its KV cache (`cap` positions per layer, the first `cached` filled).
    fn new(req: GenRequest, (k, v): (Vec<f32>, Vec<f32>), cap: usize, cached: usize) -> Self {
        Active {
            id: req.id,
            rng: ChaCha8Rng::seed_from_u64(req.params.seed),
            tokens: Vec::with_capacity(req.params.max_new_tokens),
            logprobs: Vec::with_capacity(req.params.max_new_tokens),
            orig: req.prompt.len(),
            prompt: req.prompt,
            params: req.params,
            k,
            v,
            cap,
            cached,
            att: Vec::new(),
            followers: Vec::new(),
        }
    }
}

/// Grow-only buffers of a decode step.
#[derive(Debug, Default)]
struct Scratch {
    ids: Vec<u32>,
    pos: Vec<u32>,
    chunk: Vec<(usize, usize)>,
    x: Vec<f32>,
    ln: Vec<f32>,
    rstd: Vec<f32>,
    q_pre: Vec<f32>,
    q: Vec<f32>,
    k_pre: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att_out: Vec<f32>,
    tmp: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    h: Vec<f32>,
    hsel: Vec<f32>,
    logits: Vec<f32>,
}

/// The continuous-batching engine state of a backend.
#[derive(Debug, Default)]
pub struct Generator {
    active: Vec<Active>,
    free: Vec<(Vec<f32>, Vec<f32>)>,
    s: Scratch,
}

impl Generator {
    /// Requests added and not finished or cancelled.
    pub fn active(&self) -> usize {
        self.active.len() + self.active.iter().map(|a| a.followers.len()).sum::<usize>()
    }

    /// Queues a request (prefilled at the next step).
    pub fn add(&mut self, cfg: &ModelConfig, req: GenRequest) -> Result<()> {
        validate_request(cfg, &req)?;
        if self.contains(req.id) {
            return Err(BackendError::DuplicateRequest(req.id));
        }
        let (kv, cap) = Self::cache(&mut self.free, cfg, &req);
        self.active.push(Active::new(req, kv, cap, 0));
        Ok(())
    }

    /// A recycled KV cache sized for `req`, and its capacity in positions. The cache never
    /// holds the last sampled token (generation stops right after it).
    fn cache(
        free: &mut Vec<(Vec<f32>, Vec<f32>)>,
        cfg: &ModelConfig,
        req: &GenRequest,
    ) -> ((Vec<f32>, Vec<f32>), usize) {
        let cap = req.prompt.len() + req.params.max_new_tokens;
        let size = cfg.num_hidden_layers * cap * cfg.kv_dim();
        let (mut k, mut v) = free.pop().unwrap_or_default();
        fit(&mut k, size);
        fit(&mut v, size);
        ((k, v), cap)
    }

    /// Long-tail migration: removes a request that has generated tokens and returns its state
    /// (see [`ResumeState`]); its cache is recycled.
    pub fn export(&mut self, id: RequestKey) -> Result<ResumeState> {
        let Some(i) = self.active.iter().position(|a| a.id == id) else {
            return Err(if self.contains(id) {
                not_started(id)
            } else {
                BackendError::UnknownRequest(id)
            });
        };
        if self.active[i].tokens.is_empty() {
            return Err(not_started(id));
        }
        let mut a = self.active.remove(i);
        self.free.push((a.k, a.v));
        a.prompt.truncate(a.orig);
        Ok(exported(
            a.id, a.prompt, a.params, a.tokens, a.logprobs, &a.rng,
        ))
    }

    /// Queues an exported request: the next step prefills its prompt and generated tokens in
    /// one chunk and samples its next token from the restored stream position.
    pub fn resume(&mut self, cfg: &ModelConfig, st: ResumeState) -> Result<()> {
        validate_resume(cfg, &st)?;
        if self.contains(st.request.id) {
            return Err(BackendError::DuplicateRequest(st.request.id));
        }
        let (kv, cap) = Self::cache(&mut self.free, cfg, &st.request);
        let mut a = Active::new(st.request, kv, cap, 0);
        a.prompt.extend_from_slice(&st.tokens);
        a.tokens = st.tokens;
        a.logprobs = st.logprobs;
        a.rng.set_word_pos(st.stream_words);
        self.active.push(a);
        Ok(())
    }

    /// Queues a group: the first sample prefills the prompt; the others join after that
    /// step with the prompt's KV copied (see [`Generator::fork_followers`]).
    pub fn add_group(&mut self, cfg: &ModelConfig, reqs: Vec<GenRequest>) -> Result<()> {
        let Some(first) = reqs.first() else {
            return Err(BackendError::EmptyBatch("group with no samples".into()));
        };
        for (i, r) in reqs.iter().enumerate() {
            validate_request(cfg, r)?;
            if self.contains(r.id) || reqs[..i].iter().any(|o| o.id == r.id) {
                return Err(BackendError::DuplicateRequest(r.id));
            }
            if r.prompt != first.prompt {
                return Err(BackendError::invalid(
                    "group",
                    "samples differ in their prompt",
                ));
            }
        }
        let mut reqs = reqs.into_iter();
        let leader = reqs.next().map(|r| self.add(cfg, r));
        leader.unwrap_or(Ok(()))?;
        if let Some(a) = self.active.last_mut() {
            a.followers.extend(reqs);
        }
        Ok(())
    }

    /// Whether `id` is active or waiting for its group's prefill.
    pub fn contains(&self, id: RequestKey) -> bool {
        self.active
            .iter()
            .any(|a| a.id == id || a.followers.iter().any(|f| f.id == id))
    }

    /// For every request that was prefilled in this step and leads a group, starts its
    /// followers with the first `prompt − 1` positions of its KV cache copied. The last
    /// prompt position is computed by each follower (as vLLM does on a full prefix hit),
    /// because its first token is sampled from that position's logits; every later row is
    /// the follower's own, so its tokens equal those it would have generated alone.
    fn fork_followers(
        active: &mut [Active],
        free: &mut Vec<(Vec<f32>, Vec<f32>)>,
        cfg: &ModelConfig,
        chunk: &[(usize, usize)],
    ) -> Vec<Active> {
        let kd = cfg.kv_dim();
        let mut out = Vec::new();
        for (a, &(_, len)) in active.iter_mut().zip(chunk) {
            if a.followers.is_empty() || a.cached + len < a.prompt.len() {
                continue;
            }
            let shared = a.prompt.len() - 1;
            for req in std::mem::take(&mut a.followers) {
                let ((mut k, mut v), cap) = Self::cache(free, cfg, &req);
                for l in 0..cfg.num_hidden_layers {
                    let (src, dst) = (l * a.cap * kd, l * cap * kd);
                    k[dst..dst + shared * kd].copy_from_slice(&a.k[src..src + shared * kd]);
                    v[dst..dst + shared * kd].copy_from_slice(&a.v[src..src + shared * kd]);
                }
                out.push(Active::new(req, (k, v), cap, shared));
            }
        }
        out
    }

    /// Aborts a request, recycling its cache.
    pub fn cancel(&mut self, cfg: &ModelConfig, id: RequestKey) -> Result<()> {
        for a in &mut self.active {
            if let Some(j) = a.followers.iter().position(|f| f.id == id) {
                a.followers.remove(j);
                return Ok(());
            }
        }
        let i = self
            .active
            .iter()
            .position(|a| a.id == id)
            .ok_or(BackendError::UnknownRequest(id))?;
        let mut a = self.active.remove(i);
        // A cancelled leader that has not prefilled yet hands its group to the next sample.
        let mut followers = std::mem::take(&mut a.followers).into_iter();
        self.free.push((a.k, a.v));
        if a.cached < a.prompt.len()
            && let Some(next) = followers.next()
        {
            // Already validated with the group; only the cache is sized here.
            self.add(cfg, next)?;
            if let Some(l) = self.active.last_mut() {
                l.followers.extend(followers);
            }
        }
        Ok(())
    }

    /// Drops every request (weights changed or the engine is reset).
    pub fn clear(&mut self) {
        for a in self.active.drain(..) {
            self.free.push((a.k, a.v));
        }
    }

    /// One engine step (see the module docs); returns the requests that finished.
    pub fn step(&mut self, m: &Model<f32>) -> Result<Vec<GenOutput>> {
        if self.active.is_empty() {
            return Ok(Vec::new());
        }
        let c = &m.cfg;
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let eps = c.rms_norm_eps;
        let s = &mut self.s;
        s.ids.clear();
        s.pos.clear();
        s.chunk.clear();
        for a in &self.active {
            let start = s.ids.len();
            if a.cached < a.prompt.len() {
                s.ids.extend_from_slice(&a.prompt[a.cached..]);
            } else {
                s.ids
                    .push(*a.tokens.last().unwrap_or(&a.prompt[a.prompt.len() - 1]));
            }
            let len = s.ids.len() - start;
            s.pos.extend(a.cached as u32..(a.cached + len) as u32);
            s.chunk.push((start, len));
        }
        let n = s.ids.len();
        fit(&mut s.x, n * d);
        embedding_fwd(&mut s.x, &s.ids, m.embed_fwd(), d);
        for l in 0..c.num_hidden_layers {
            let w = m.layer_fwd(l);
            fit(&mut s.ln, n * d);
            fit(&mut s.rstd, n * h);
            rmsnorm_fwd(&mut s.ln, &mut s.rstd, &s.x, w.input_norm, d, eps);
            fit(&mut s.q_pre, n * qd);
            fit(&mut s.k_pre, n * kd);
            fit(&mut s.v, n * kd);
            matmul_fwd(&mut s.q_pre, &s.ln, w.q, n, d, qd);
            matmul_fwd(&mut s.k_pre, &s.ln, w.k, n, d, kd);
            matmul_fwd(&mut s.v, &s.ln, w.v, n, d, kd);
            fit(&mut s.q, n * qd);
            fit(&mut s.k, n * kd);
            rmsnorm_fwd(&mut s.q, &mut s.rstd, &s.q_pre, w.q_norm, hd, eps);
            rmsnorm_fwd(&mut s.k, &mut s.rstd, &s.k_pre, w.k_norm, hd, eps);
            rope_fwd(&mut s.q, &s.pos, h, &m.rope);
            rope_fwd(&mut s.k, &s.pos, kvh, &m.rope);
            fit(&mut s.att_out, n * qd);
            {
                let (q, k, vv) = (&s.q[..], &s.k[..], &s.v[..]);
                let mut tasks = Vec::with_capacity(self.active.len());
                let mut rest = &mut s.att_out[..];
                for (a, &(start, len)) in self.active.iter_mut().zip(&s.chunk) {
                    let (o, r) = std::mem::take(&mut rest).split_at_mut(len * qd);
                    rest = r;
                    tasks.push((a, o, start, len));
                }
                tasks.into_par_iter().for_each(|(a, o, start, len)| {
                    let base = l * a.cap * kd;
                    let at = base + a.cached * kd;
                    a.k[at..at + len * kd].copy_from_slice(&k[start * kd..(start + len) * kd]);
                    a.v[at..at + len * kd].copy_from_slice(&vv[start * kd..(start + len) * kd]);
                    let nk = a.cached + len;
                    fit(&mut a.att, h * len * nk);
                    attention_fwd(
                        o,
                        &mut a.att,
                        &q[start * qd..(start + len) * qd],
                        &a.k[base..base + nk * kd],
                        &a.v[base..base + nk * kd],
                        len,
                        nk,
                        h,
                        kvh,
                        hd,
                    );
                });
            }
            fit(&mut s.tmp, n * d);
            matmul_fwd(&mut s.tmp, &s.att_out, w.o, n, qd, d);
            for (x, t) in s.x.iter_mut().zip(&s.tmp) {
                *x += *t;
            }
            rmsnorm_fwd(&mut s.ln, &mut s.rstd, &s.x, w.post_norm, d, eps);
            fit(&mut s.gate, n * f);
            fit(&mut s.up, n * f);
            fit(&mut s.h, n * f);
            matmul_fwd(&mut s.gate, &s.ln, w.gate, n, d, f);
            matmul_fwd(&mut s.up, &s.ln, w.up, n, d, f);
            swiglu_fwd(&mut s.h, &s.gate, &s.up);
            matmul_fwd(&mut s.tmp, &s.h, w.down, n, f, d);
            for (x, t) in s.x.iter_mut().zip(&s.tmp) {
                *x += *t;
            }
        }
        // Only each chunk's last row predicts the next token.
        let r = self.active.len();
        fit(&mut s.tmp, r * d);
        for (i, &(start, len)) in s.chunk.iter().enumerate() {
            let row = start + len - 1;
            s.tmp[i * d..(i + 1) * d].copy_from_slice(&s.x[row * d..(row + 1) * d]);
        }
        fit(&mut s.hsel, r * d);
        fit(&mut s.rstd, r);
        rmsnorm_fwd(&mut s.hsel, &mut s.rstd, &s.tmp, m.final_norm(), d, eps);
        fit(&mut s.logits, r * v);
        matmul_fwd(&mut s.logits, &s.hsel, m.lm_head_fwd(), r, d, v);
        let forked = Self::fork_followers(&mut self.active, &mut self.free, c, &s.chunk);
        // Each row's draw depends only on its own logits, settings and stream, so the rows are
        // sampled in parallel (a 151,936-entry softmax per row is not free).
        let draws: Vec<(u32, f32)> = {
            let logits = &s.logits;
            self.active
                .par_iter_mut()
                .enumerate()
                .map_init(Vec::new, |scratch, (row, a)| {
                    let u = uniform(&mut a.rng);
                    sample(&logits[row * v..(row + 1) * v], &a.params, u, scratch)
                })
                .collect()
        };
        let mut finished = Vec::new();
        let mut i = 0;
        let mut row = 0;
        while i < self.active.len() {
            let a = &mut self.active[i];
            let len = s.chunk[row].1;
            let (tok, lp) = draws[row];
            row += 1;
            a.cached += len;
            a.tokens.push(tok);
            a.logprobs.push(lp);
            let finish = finish_reason(&a.params, tok, a.tokens.len());
            match finish {
                Some(finish) => {
                    let a = self.active.remove(i);
                    self.free.push((a.k, a.v));
                    finished.push(GenOutput {
                        id: a.id,
                        tokens: a.tokens,
                        logprobs: a.logprobs,
                        finish,
                    });
                }
                None => i += 1,
            }
        }
        self.active.extend(forked);
        Ok(finished)
    }
}
