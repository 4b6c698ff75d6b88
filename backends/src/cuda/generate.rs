//! Continuous-batching generation on a CUDA device: a KV cache of fixed-size slots, one
//! forward per engine step, and sampling on the device (the wgpu backend's `generate`, op
//! for op).
//!
//! Each step packs, per active request, the tokens not yet in its cache (its prompt when it
//! just joined, else its last token). The projections are single GEMMs over all rows; each
//! request's new keys and values are copied into its cache slot; attention reads the slot
//! (`qmeta` = slot base, position). Only the last row of each request reaches the final
//! norm, lm_head and `sample`, and only the sampled tokens and their log-probs come back.
//!
//! Sampling uses the CPU reference's per-request stream (ChaCha8 seeded with the request's
//! seed, one 53-bit uniform per token), so tokens depend only on the seed and the weights.

use std::sync::Arc;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;

use super::device::{Cuda, DBuf};
use super::model::DeviceModel;
use super::ops;
use super::plan;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::check::validate_request;
use crate::model::sampling::{finish_reason, sample_row, uniform};
use crate::seam::{GenOutput, GenRequest, RequestKey, SamplingParams};

#[derive(Debug)]
struct Active {
    id: RequestKey,
    prompt: Vec<u32>,
    params: SamplingParams,
    rng: ChaCha8Rng,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    slot: usize,
    cached: usize,
}

/// Per-step buffers for up to `cap_n` rows and `cap_r` requests.
#[derive(Debug)]
struct StepBufs {
    cap_n: usize,
    cap_r: usize,
    ids: DBuf<u32>,
    pos: DBuf<u32>,
    qmeta: DBuf<u32>,
    last: DBuf<u32>,
    rowp: DBuf<f32>,
    x: DBuf<f32>,
    x_mid: DBuf<f32>,
    ln: DBuf<f32>,
    rstd: DBuf<f32>,
    q_pre: DBuf<f32>,
    q: DBuf<f32>,
    k_pre: DBuf<f32>,
    k: DBuf<f32>,
    v: DBuf<f32>,
    att_out: DBuf<f32>,
    att_stats: DBuf<f32>,
    tmp: DBuf<f32>,
    gate: DBuf<f32>,
    up: DBuf<f32>,
    h: DBuf<f32>,
    hsel: DBuf<f32>,
    hnorm: DBuf<f32>,
    logits: DBuf<f32>,
    tokens: DBuf<u32>,
    logp: DBuf<f32>,
}

impl StepBufs {
    fn new(cu: &Arc<Cuda>, c: &ModelConfig, n: usize, r: usize) -> Result<Self> {
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qd, kd, h) = (c.q_dim(), c.kv_dim(), c.num_attention_heads);
        let b = |len: usize| cu.alloc::<f32>(len);
        let u = |len: usize| cu.alloc::<u32>(len);
        Ok(Self {
            cap_n: n,
            cap_r: r,
            ids: u(n)?,
            pos: u(n)?,
            qmeta: u(2 * n)?,
            last: u(r)?,
            rowp: b(4 * r)?,
            x: b(n * d)?,
            x_mid: b(n * d)?,
            ln: b(n * d)?,
            rstd: b(n * h)?,
            q_pre: b(n * qd)?,
            q: b(n * qd)?,
            k_pre: b(n * kd)?,
            k: b(n * kd)?,
            v: b(n * kd)?,
            att_out: b(n * qd)?,
            att_stats: b(2 * n * h)?,
            tmp: b(n * d)?,
            gate: b(n * f)?,
            up: b(n * f)?,
            h: b(n * f)?,
            hsel: b(r * d)?,
            hnorm: b(r * d)?,
            logits: b(r * v)?,
            tokens: u(r)?,
            logp: b(r)?,
        })
    }
}

/// The engine state: active requests, the KV cache and the step buffers.
#[derive(Debug, Default)]
pub struct Generator {
    active: Vec<Active>,
    free_slots: Vec<usize>,
    slots: usize,
    slot_rows: usize,
    /// Per layer `[slots*slot_rows, kv_dim]`.
    kcache: Vec<DBuf<f32>>,
    vcache: Vec<DBuf<f32>>,
    bufs: Option<StepBufs>,
    ids: Vec<u32>,
    pos: Vec<u32>,
    qmeta: Vec<u32>,
    last: Vec<u32>,
    rowp: Vec<f32>,
    chunks: Vec<(usize, usize)>,
}

impl Generator {
    /// Requests added and not finished or cancelled.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Queues a request (prefilled at the next step).
    pub fn add(&mut self, cu: &Arc<Cuda>, c: &ModelConfig, req: GenRequest) -> Result<()> {
        validate_request(c, &req)?;
        if self.active.iter().any(|a| a.id == req.id) {
            return Err(BackendError::DuplicateRequest(req.id));
        }
        // The cache never holds a request's last sampled token.
        let need = req.prompt.len() + req.params.max_new_tokens;
        let (slots, rows) = plan::slot_plan(
            self.slots,
            self.slot_rows,
            self.free_slots.len(),
            need,
            c.max_position_embeddings,
        );
        if rows != self.slot_rows || slots != self.slots {
            self.resize(cu, c, slots, rows)?;
        }
        let slot = self
            .free_slots
            .pop()
            .ok_or_else(|| BackendError::Device("no KV cache slot after growing".into()))?;
        self.active.push(Active {
            id: req.id,
            rng: ChaCha8Rng::seed_from_u64(req.params.seed),
            tokens: Vec::with_capacity(req.params.max_new_tokens),
            logprobs: Vec::with_capacity(req.params.max_new_tokens),
            prompt: req.prompt,
            params: req.params,
            slot,
            cached: 0,
        });
        Ok(())
    }

    /// Re-lays the KV cache out as `slots` slots of `rows` positions, copying every active
    /// request's cached rows to its slot's new place.
    fn resize(&mut self, cu: &Arc<Cuda>, c: &ModelConfig, slots: usize, rows: usize) -> Result<()> {
        let kd = c.kv_dim();
        let len = slots * rows * kd;
        let mut kc = Vec::with_capacity(c.num_hidden_layers);
        let mut vc = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            kc.push(cu.alloc::<f32>(len)?);
            vc.push(cu.alloc::<f32>(len)?);
        }
        for a in &self.active {
            let (src, dst) = (a.slot * self.slot_rows * kd, a.slot * rows * kd);
            for l in 0..self.kcache.len() {
                kc[l].copy_from(dst, &self.kcache[l], src, a.cached * kd)?;
                vc[l].copy_from(dst, &self.vcache[l], src, a.cached * kd)?;
            }
        }
        self.kcache = kc;
        self.vcache = vc;
        // Lower slots are handed out first (pop from the end).
        self.free_slots.extend((self.slots..slots).rev());
        self.slots = slots;
        self.slot_rows = rows;
        Ok(())
    }

    /// Aborts a request, freeing its slot.
    pub fn cancel(&mut self, id: RequestKey) -> Result<()> {
        let i = self
            .active
            .iter()
            .position(|a| a.id == id)
            .ok_or(BackendError::UnknownRequest(id))?;
        let a = self.active.remove(i);
        self.free_slots.push(a.slot);
        Ok(())
    }

    /// One engine step; returns the requests that finished.
    pub fn step(&mut self, md: &DeviceModel) -> Result<Vec<GenOutput>> {
        if self.active.is_empty() {
            return Ok(Vec::new());
        }
        let cu = &md.cuda;
        let c = &md.cfg;
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let eps = c.rms_norm_eps;
        let maxp = c.max_position_embeddings;
        self.ids.clear();
        self.pos.clear();
        self.qmeta.clear();
        self.last.clear();
        self.rowp.clear();
        self.chunks.clear();
        for a in &mut self.active {
            let start = self.ids.len();
            if a.cached == 0 {
                self.ids.extend_from_slice(&a.prompt);
            } else {
                self.ids
                    .push(*a.tokens.last().unwrap_or(&a.prompt[a.prompt.len() - 1]));
            }
            let len = self.ids.len() - start;
            let base = (a.slot * self.slot_rows) as u32;
            for t in a.cached..a.cached + len {
                self.pos.push(t as u32);
                self.qmeta.extend([base, t as u32]);
            }
            self.last.push((start + len - 1) as u32);
            self.chunks.push((start, len));
            let u = uniform(&mut a.rng);
            let p = &a.params;
            self.rowp
                .extend(sample_row(p.temperature, p.top_k, p.top_p, u));
        }
        let (n, r) = (self.ids.len(), self.active.len());
        if self
            .bufs
            .as_ref()
            .is_none_or(|b| b.cap_n < n || b.cap_r < r)
        {
            self.bufs = None;
            self.bufs = Some(StepBufs::new(
                cu,
                c,
                plan::capacity(n, 64),
                plan::capacity(r, 16),
            )?);
        }
        let Some(s) = self.bufs.as_ref() else {
            return Err(BackendError::Device("decode buffers missing".into()));
        };
        s.ids.write(0, &self.ids)?;
        s.pos.write(0, &self.pos)?;
        s.qmeta.write(0, &self.qmeta)?;
        s.last.write(0, &self.last)?;
        s.rowp.write(0, &self.rowp)?;
        let p = &md.params;
        let n_k = self.slots * self.slot_rows;
        ops::embedding_fwd(cu, &s.x, &p[md.embed], &s.ids, n, d, v)?;
        for (l, li) in md.layers.iter().enumerate() {
            ops::rmsnorm_fwd(cu, &s.ln, &s.rstd, &s.x, &p[li.input_norm.0], n, d, eps)?;
            ops::matmul_fwd(cu, &s.q_pre, &s.ln, &p[li.q.0], n, d, qd)?;
            ops::matmul_fwd(cu, &s.k_pre, &s.ln, &p[li.k.0], n, d, kd)?;
            ops::matmul_fwd(cu, &s.v, &s.ln, &p[li.v.0], n, d, kd)?;
            ops::rmsnorm_fwd(cu, &s.q, &s.rstd, &s.q_pre, &p[li.q_norm.0], n * h, hd, eps)?;
            ops::rmsnorm_fwd(
                cu,
                &s.k,
                &s.rstd,
                &s.k_pre,
                &p[li.k_norm.0],
                n * kvh,
                hd,
                eps,
            )?;
            ops::rope(cu, true, &s.q, &s.pos, &md.cos, &md.sin, n, h, hd, maxp)?;
            ops::rope(cu, true, &s.k, &s.pos, &md.cos, &md.sin, n, kvh, hd, maxp)?;
            for (a, &(start, len)) in self.active.iter().zip(&self.chunks) {
                let dst = (a.slot * self.slot_rows + a.cached) * kd;
                self.kcache[l].copy_from(dst, &s.k, start * kd, len * kd)?;
                self.vcache[l].copy_from(dst, &s.v, start * kd, len * kd)?;
            }
            ops::attention_fwd(
                cu,
                &s.att_out,
                &s.att_stats,
                &s.q,
                &self.kcache[l],
                &self.vcache[l],
                &s.qmeta,
                md.attn(n, n_k),
            )?;
            ops::matmul_fwd(cu, &s.tmp, &s.att_out, &p[li.o.0], n, qd, d)?;
            ops::residual_fwd(cu, &s.x_mid, &s.x, &s.tmp, n * d)?;
            ops::rmsnorm_fwd(cu, &s.ln, &s.rstd, &s.x_mid, &p[li.post_norm.0], n, d, eps)?;
            ops::matmul_fwd(cu, &s.gate, &s.ln, &p[li.gate.0], n, d, f)?;
            ops::matmul_fwd(cu, &s.up, &s.ln, &p[li.up.0], n, d, f)?;
            ops::swiglu_fwd(cu, &s.h, &s.gate, &s.up, n * f)?;
            ops::matmul_fwd(cu, &s.tmp, &s.h, &p[li.down.0], n, f, d)?;
            ops::residual_fwd(cu, &s.x, &s.x_mid, &s.tmp, n * d)?;
        }
        ops::embedding_fwd(cu, &s.hsel, &s.x, &s.last, r, d, n)?;
        ops::rmsnorm_fwd(cu, &s.hnorm, &s.rstd, &s.hsel, &p[md.final_norm], r, d, eps)?;
        ops::matmul_fwd(cu, &s.logits, &s.hnorm, &p[md.lm_head], r, d, v)?;
        ops::sample(cu, &s.tokens, &s.logp, &s.logits, &s.rowp, r, v)?;
        let toks = s.tokens.read(0, r)?;
        let lps = s.logp.read(0, r)?;
        let mut finished = Vec::new();
        let mut i = 0;
        let mut row = 0;
        while i < self.active.len() {
            let len = self.chunks[row].1;
            let (tok, lp) = (toks[row], lps[row]);
            row += 1;
            let a = &mut self.active[i];
            a.cached += len;
            a.tokens.push(tok);
            a.logprobs.push(lp);
            match finish_reason(&a.params, tok, a.tokens.len()) {
                Some(finish) => {
                    let a = self.active.remove(i);
                    self.free_slots.push(a.slot);
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
        Ok(finished)
    }
}
