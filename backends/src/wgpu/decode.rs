//! One decode step on the device: its buffers ([`StepBufs`]), the device-side token feedback
//! of a look-ahead step ([`feed_tokens`]) and the recording of the model's forward and the
//! sampling ([`encode_step`]). The engine state that decides what a step holds is
//! [`super::generate`].

use wgpu::Buffer;

use super::gpu::{Exec, Gpu};
use super::kv::{KvPool, StepRows};
use super::model::DeviceModel;
use super::ops;
use crate::config::ModelConfig;
use crate::error::Result;

/// Per-step buffers for up to `cap_n` rows, `cap_r` requests and `cap_p` page-table entries.
#[derive(Debug)]
pub(super) struct StepBufs {
    pub(super) cap_n: usize,
    pub(super) cap_r: usize,
    pub(super) cap_p: usize,
    pub(super) ids: Buffer,
    pub(super) pos: Buffer,
    pub(super) meta: Buffer,
    pub(super) pages: Buffer,
    pub(super) last: Buffer,
    pub(super) rowp: Buffer,
    pub(super) x: Buffer,
    pub(super) x_mid: Buffer,
    pub(super) ln: Buffer,
    pub(super) rstd: Buffer,
    pub(super) q_pre: Buffer,
    pub(super) q: Buffer,
    pub(super) k_pre: Buffer,
    pub(super) k: Buffer,
    pub(super) v: Buffer,
    pub(super) att_out: Buffer,
    /// Decode attention's running max and sum per (row, head) between split launches.
    pub(super) att_state: Buffer,
    pub(super) tmp: Buffer,
    pub(super) gate: Buffer,
    pub(super) up: Buffer,
    pub(super) h: Buffer,
    pub(super) hsel: Buffer,
    pub(super) hnorm: Buffer,
    pub(super) logits: Buffer,
    pub(super) tokens: Buffer,
    pub(super) logp: Buffer,
}

impl StepBufs {
    pub(super) fn new(gpu: &Gpu, c: &ModelConfig, n: usize, r: usize, pages: usize) -> Self {
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

/// Device-side token feedback: copies each `(row, sampled row)` pair's token from the front
/// step's `sampled` buffer into this step's `ids`, one copy per run of consecutive pairs (the
/// rows keep the front's order, so a run breaks only where a request left).
pub(super) fn feed_tokens(ex: &mut Exec, sampled: &Buffer, ids: &Buffer, pairs: &[(u32, u32)]) {
    let mut i = 0;
    while i < pairs.len() {
        let (dst, src) = pairs[i];
        let mut len = 1;
        while pairs
            .get(i + len)
            .is_some_and(|&(d, s)| d == dst + len as u32 && s == src + len as u32)
        {
            len += 1;
        }
        ex.copy(sampled, src as u64 * 4, ids, dst as u64 * 4, len as u64 * 4);
        i += len;
    }
}

/// Records the model's forward over the step's `n` rows (positions up to `max_pos`) and the
/// sampling of its `r` requests' last rows (`np` page-table entries).
#[allow(clippy::too_many_arguments)]
pub(super) fn encode_step(
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
        ops::rmsnorm_fwd(ex, &s.ln, &s.rstd, &s.x, &p[li.input_norm.0], n, d, eps);
        ops::matmul_fwd_as(ex, &s.q_pre, &s.ln, &p[li.q.0], wf, n, d, qd, false);
        ops::matmul_fwd_as(ex, &s.k_pre, &s.ln, &p[li.k.0], wf, n, d, kd, false);
        ops::matmul_fwd_as(ex, &s.v, &s.ln, &p[li.v.0], wf, n, d, kd, false);
        ops::rmsnorm_fwd(ex, &s.q, &s.rstd, &s.q_pre, &p[li.q_norm.0], n * h, hd, eps);
        ops::rmsnorm_fwd(
            ex,
            &s.k,
            &s.rstd,
            &s.k_pre,
            &p[li.k_norm.0],
            n * kvh,
            hd,
            eps,
        );
        ops::rope_fwd(ex, &s.q, &s.pos, &md.cos, &md.sin, n, h, hd, maxp);
        ops::rope_fwd(ex, &s.k, &s.pos, &md.cos, &md.sin, n, kvh, hd, maxp);
        rows.kv_append(ex, pool, l, c)?;
        rows.attention_decode(ex, pool, l, c)?;
        ops::matmul_fwd_as(ex, &s.tmp, &s.att_out, &p[li.o.0], wf, n, qd, d, false);
        ops::residual_fwd(ex, &s.x_mid, &s.x, &s.tmp, n * d);
        ops::rmsnorm_fwd(ex, &s.ln, &s.rstd, &s.x_mid, &p[li.post_norm.0], n, d, eps);
        ops::matmul_fwd_as(ex, &s.gate, &s.ln, &p[li.gate.0], wf, n, d, f, false);
        ops::matmul_fwd_as(ex, &s.up, &s.ln, &p[li.up.0], wf, n, d, f, false);
        ops::swiglu_fwd(ex, &s.h, &s.gate, &s.up, n * f);
        ops::matmul_fwd_as(ex, &s.tmp, &s.h, &p[li.down.0], wf, n, f, d, false);
        ops::residual_fwd(ex, &s.x, &s.x_mid, &s.tmp, n * d);
    }
    ops::embedding_fwd(ex, &s.hsel, &s.last, &s.x, r, d, n);
    ops::rmsnorm_fwd(ex, &s.hnorm, &s.rstd, &s.hsel, &p[md.final_norm], r, d, eps);
    ops::matmul_fwd_as(ex, &s.logits, &s.hnorm, &p[md.lm_head], wf, r, d, v, false);
    ops::sample(ex, &s.tokens, &s.logp, &s.logits, &s.rowp, r, v);
    Ok(())
}
