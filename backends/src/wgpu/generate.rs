//! Continuous-batching generation on the device: a KV cache of fixed-size slots, one
//! submission per decode step, and sampling on the device.
//!
//! Each step packs, per active request, the tokens not yet in its cache (its prompt when it
//! just joined, else its last token), exactly as the CPU reference's `cpu::generate`. The
//! projections are single matmuls over all rows; each request's new keys and values are
//! copied into its cache slot; attention reads the slot (`qmeta` = slot base, position).
//! Only the last row of each request reaches the final norm, `lm_head` and `sample`, and only
//! the sampled tokens and their log-probs come back (8 bytes per request).
//!
//! Sampling uses the same per-request stream as the CPU: a ChaCha8 generator seeded with the
//! request's seed, one 53-bit uniform per token, so that tokens depend only on the seed and
//! the weights (batch invariance). Where float differences can still flip a token, see the
//! `sample` kernel's notes and the conformance suite.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use wgpu::Buffer;

use super::gpu::{Exec, Gpu};
use super::model::DeviceModel;
use super::ops;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::seam::{GenOutput, GenRequest, RequestKey, SamplingParams};

// The CPU reference's draw and request checks, shared so both backends sample the same
// stream and refuse the same requests with the same errors.
use crate::cpu::generate::{finish_reason, uniform, validate_request};

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
    ids: Buffer,
    pos: Buffer,
    qmeta: Buffer,
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
    att_stats: Buffer,
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
    fn new(gpu: &Gpu, c: &ModelConfig, n: usize, r: usize) -> Self {
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qd, kd, h) = (c.q_dim(), c.kv_dim(), c.num_attention_heads);
        let b = |name: &str, len: usize| gpu.buffer(&format!("decode {name}"), len);
        Self {
            cap_n: n,
            cap_r: r,
            ids: b("ids", n),
            pos: b("pos", n),
            qmeta: b("qmeta", 2 * n),
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
            att_stats: b("att_stats", n * h),
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

/// The engine state: active requests, the KV cache and the step buffers.
#[derive(Debug, Default)]
pub struct Generator {
    active: Vec<Active>,
    free_slots: Vec<usize>,
    slots: usize,
    /// Positions per slot (the longest request so far, rounded up).
    slot_rows: usize,
    /// Per layer `[slots·slot_rows, kv_dim]`.
    kcache: Vec<Buffer>,
    vcache: Vec<Buffer>,
    bufs: Option<StepBufs>,
    ids: Vec<u32>,
    pos: Vec<u32>,
    qmeta: Vec<u32>,
    last: Vec<u32>,
    rowp: Vec<[f32; 4]>,
    chunks: Vec<(usize, usize)>,
}

impl Generator {
    /// Requests added and not finished or cancelled.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Queues a request (prefilled at the next step).
    pub fn add(
        &mut self,
        gpu: &Gpu,
        ex: &mut Exec,
        c: &ModelConfig,
        req: GenRequest,
    ) -> Result<()> {
        validate_request(c, &req)?;
        if self.active.iter().any(|a| a.id == req.id) {
            return Err(BackendError::DuplicateRequest(req.id));
        }
        // The cache never holds a request's last sampled token.
        let need = req.prompt.len() + req.params.max_new_tokens;
        let rows = if need > self.slot_rows {
            need.next_power_of_two()
                .clamp(64, c.max_position_embeddings.max(need))
        } else {
            self.slot_rows
        };
        let slots = if self.free_slots.is_empty() {
            (self.slots * 2).max(16)
        } else {
            self.slots
        };
        if rows != self.slot_rows || slots != self.slots {
            self.resize(gpu, ex, c, slots, rows)?;
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

    /// Re-lays the KV cache out as `slots` slots of `rows` positions each (both at least
    /// the current ones), copying every active request's cached rows to its slot's new place.
    /// Slots start sized for the longest request seen (not the model's position limit, which
    /// can be 40k), and grow when a longer one arrives.
    fn resize(
        &mut self,
        gpu: &Gpu,
        ex: &mut Exec,
        c: &ModelConfig,
        slots: usize,
        rows: usize,
    ) -> Result<()> {
        let kd = c.kv_dim();
        let len = slots * rows * kd;
        let max = gpu.device().limits().max_storage_buffer_binding_size as usize / 4;
        if len > max {
            return Err(BackendError::Device(format!(
                "KV cache of {slots} slots × {rows} positions needs {len} values per layer, the device binds at most {max}"
            )));
        }
        let mk = |name: &str, l: usize| gpu.buffer(&format!("layer {l} {name} cache"), len);
        let kc: Vec<Buffer> = (0..c.num_hidden_layers).map(|l| mk("k", l)).collect();
        let vc: Vec<Buffer> = (0..c.num_hidden_layers).map(|l| mk("v", l)).collect();
        let row_bytes = (kd * 4) as u64;
        for a in &self.active {
            let (src, dst) = (
                (a.slot * self.slot_rows) as u64 * row_bytes,
                (a.slot * rows) as u64 * row_bytes,
            );
            for l in 0..self.kcache.len() {
                ex.copy(
                    &self.kcache[l],
                    src,
                    &kc[l],
                    dst,
                    a.cached as u64 * row_bytes,
                );
                ex.copy(
                    &self.vcache[l],
                    src,
                    &vc[l],
                    dst,
                    a.cached as u64 * row_bytes,
                );
            }
        }
        ex.submit()?;
        self.kcache = kc;
        self.vcache = vc;
        ex.forget_bind_groups();
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
    pub fn step(&mut self, gpu: &Gpu, ex: &mut Exec, md: &DeviceModel) -> Result<Vec<GenOutput>> {
        if self.active.is_empty() {
            return Ok(Vec::new());
        }
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
            // One draw per token per request, as the CPU reference (which draws after the
            // forward; the stream is the request's own, so the order across requests is moot).
            let u = uniform(&mut a.rng);
            let p = &a.params;
            self.rowp
                .push(ops::sample_row(p.temperature, p.top_k, p.top_p, u));
        }
        let (n, r) = (self.ids.len(), self.active.len());
        if self
            .bufs
            .as_ref()
            .is_none_or(|b| b.cap_n < n || b.cap_r < r)
        {
            let cap_n = n.next_power_of_two().max(64);
            let cap_r = r.next_power_of_two().max(16);
            self.bufs = None;
            ex.forget_bind_groups();
            self.bufs = Some(StepBufs::new(gpu, c, cap_n, cap_r));
        }
        let Some(s) = self.bufs.as_ref() else {
            return Err(BackendError::Device("decode buffers missing".into()));
        };
        gpu.write(&s.ids, &self.ids);
        gpu.write(&s.pos, &self.pos);
        gpu.write(&s.qmeta, &self.qmeta);
        gpu.write(&s.last, &self.last);
        gpu.write(&s.rowp, &self.rowp);
        let p = &md.params;
        let n_k = self.slots * self.slot_rows;
        let wf = md.weights;
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
            let row_bytes = (kd * 4) as u64;
            for (a, &(start, len)) in self.active.iter().zip(&self.chunks) {
                let dst = (a.slot * self.slot_rows + a.cached) as u64 * row_bytes;
                let (src, size) = (start as u64 * row_bytes, len as u64 * row_bytes);
                ex.copy(&s.k, src, &self.kcache[l], dst, size);
                ex.copy(&s.v, src, &self.vcache[l], dst, size);
            }
            ops::attention_fwd(
                ex,
                &s.att_out,
                &s.att_stats,
                &s.q,
                &self.kcache[l],
                &self.vcache[l],
                &s.qmeta,
                n,
                n_k,
                h,
                kvh,
                hd,
            );
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
        let tt = ex.read_back(&s.tokens, 0, r * 4);
        let tl = ex.read_back(&s.logp, 0, r * 4);
        let back = ex.submit()?;
        let (toks, lps) = (back.get::<u32>(tt), back.get::<f32>(tl));
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
            let finish = finish_reason(&a.params, tok, a.tokens.len());
            match finish {
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
