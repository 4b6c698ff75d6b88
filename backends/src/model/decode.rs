//! The decode step: the one layer loop of generation.
//!
//! A step's rows are every active request's new tokens (its prompt when it joins, else its
//! last token). The projections are single products over all rows; per layer each row's
//! key and value are appended to its request's KV pages ([`Decode::kv_append`]) before every
//! row attends over its request's positions ([`Decode::attention_decode`]), so a group's
//! samples can read the prefix one of them writes in the same step. Only each request's
//! last row reaches the final norm, the lm_head and the sampler.

use super::layout::ParamIds;
use super::ops::{Heads, Ops};
use crate::config::ModelConfig;
use crate::error::Result;

/// What decoding needs from a backend beyond [`Ops`]: its KV memory, where a step's rows live
/// in it, and sampling.
#[allow(clippy::too_many_arguments)]
pub trait Decode: Ops {
    /// The KV memory of every layer.
    type Kv;
    /// Where each row of a step reads and writes keys and values.
    type Rows;
    /// Each request's sampling settings and draw.
    type Sample;

    /// Writes each of the `n` rows' key and value (`k`, `v`: `[n, kv_dim]`) at its position
    /// in layer `layer`.
    fn kv_append(
        &mut self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        rows: &Self::Rows,
        n: usize,
    ) -> Result<()>;
    /// `out`: each row's causal attention over positions `0 ..= pos` of its request in layer
    /// `layer` (after [`Decode::kv_append`] of the step's rows).
    fn attention_decode(
        &mut self,
        out: &mut Self::Buf,
        q: &Self::Buf,
        kv: &Self::Kv,
        layer: usize,
        rows: &mut Self::Rows,
        n: usize,
        heads: Heads,
    ) -> Result<()>;
    /// One token per row of `logits[r, v]` with its log-prob under the sampling
    /// distribution (before top-k/top-p truncation).
    fn sample(
        &mut self,
        tokens: &mut Self::Idx,
        logp: &mut Self::Buf,
        logits: &Self::Buf,
        rows: &Self::Sample,
        r: usize,
        v: usize,
    ) -> Result<()>;
}

/// A step's buffers for up to `cap_n` rows and `cap_r` requests.
#[derive(Debug)]
#[allow(missing_docs)]
pub struct StepBufs<B, I> {
    pub cap_n: usize,
    pub cap_r: usize,
    pub ids: I,
    pub pos: I,
    /// Each request's last row.
    pub last: I,
    pub x: B,
    pub x_mid: B,
    pub ln: B,
    pub rstd: B,
    pub q_pre: B,
    pub q: B,
    pub k_pre: B,
    pub k: B,
    pub v: B,
    pub att_out: B,
    pub tmp: B,
    pub gate: B,
    pub up: B,
    pub h: B,
    pub hsel: B,
    pub hnorm: B,
    pub logits: B,
    pub tokens: I,
    pub logp: B,
}

/// The step buffers of backend `O`.
pub type StepBufsOf<O> = StepBufs<<O as Ops>::Buf, <O as Ops>::Idx>;

impl<B, I> StepBufs<B, I> {
    /// Buffers for `cap_n` rows and `cap_r` requests of model `c`.
    pub fn new<O: Ops<Buf = B, Idx = I>>(
        o: &mut O,
        c: &ModelConfig,
        cap_n: usize,
        cap_r: usize,
    ) -> Result<Self> {
        let (n, r) = (cap_n, cap_r);
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qd, kd, h) = (c.q_dim(), c.kv_dim(), c.num_attention_heads);
        Ok(Self {
            cap_n,
            cap_r,
            ids: o.idx(n)?,
            pos: o.idx(n)?,
            last: o.idx(r)?,
            x: o.buf(n * d)?,
            x_mid: o.buf(n * d)?,
            ln: o.buf(n * d)?,
            rstd: o.buf(n * h)?,
            q_pre: o.buf(n * qd)?,
            q: o.buf(n * qd)?,
            k_pre: o.buf(n * kd)?,
            k: o.buf(n * kd)?,
            v: o.buf(n * kd)?,
            att_out: o.buf(n * qd)?,
            tmp: o.buf(n * d)?,
            gate: o.buf(n * f)?,
            up: o.buf(n * f)?,
            h: o.buf(n * f)?,
            hsel: o.buf(r * d)?,
            hnorm: o.buf(r * d)?,
            logits: o.buf(r * v)?,
            tokens: o.idx(r)?,
            logp: o.buf(r)?,
        })
    }
}

/// The decode forward of a step's `n` rows loaded into `s` (ids, positions, last rows), with
/// the KV placement `rows`, then the sampling of its `r` requests into `s.tokens` and
/// `s.logp`.
#[allow(clippy::too_many_arguments)]
pub fn decode<O: Decode>(
    o: &mut O,
    c: &ModelConfig,
    p: &ParamIds,
    s: &mut StepBufsOf<O>,
    kv: &mut O::Kv,
    rows: &mut O::Rows,
    sample: &O::Sample,
    n: usize,
    r: usize,
) -> Result<()> {
    let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let heads = Heads::of(c);
    let Heads { h, kvh, hd } = heads;
    let (qd, kd, eps) = (c.q_dim(), c.kv_dim(), c.rms_norm_eps);
    o.embedding_fwd(&mut s.x, &s.ids, p.embed, n, d)?;
    for (l, w) in p.layers.iter().enumerate() {
        o.rmsnorm_fwd(&mut s.ln, &mut s.rstd, &s.x, w.input_norm, n, d, eps)?;
        o.matmul_fwd(&mut s.q_pre, &s.ln, w.q, n, d, qd)?;
        o.matmul_fwd(&mut s.k_pre, &s.ln, w.k, n, d, kd)?;
        o.matmul_fwd(&mut s.v, &s.ln, w.v, n, d, kd)?;
        o.rmsnorm_fwd(&mut s.q, &mut s.rstd, &s.q_pre, w.q_norm, n * h, hd, eps)?;
        o.rmsnorm_fwd(&mut s.k, &mut s.rstd, &s.k_pre, w.k_norm, n * kvh, hd, eps)?;
        o.rope_fwd(&mut s.q, &s.pos, n, h, hd)?;
        o.rope_fwd(&mut s.k, &s.pos, n, kvh, hd)?;
        o.kv_append(kv, l, &s.k, &s.v, rows, n)?;
        o.attention_decode(&mut s.att_out, &s.q, kv, l, rows, n, heads)?;
        o.matmul_fwd(&mut s.tmp, &s.att_out, w.o, n, qd, d)?;
        o.residual_fwd(&mut s.x_mid, &s.x, &s.tmp, n * d)?;
        o.rmsnorm_fwd(&mut s.ln, &mut s.rstd, &s.x_mid, w.post_norm, n, d, eps)?;
        o.matmul_fwd(&mut s.gate, &s.ln, w.gate, n, d, f)?;
        o.matmul_fwd(&mut s.up, &s.ln, w.up, n, d, f)?;
        o.swiglu_fwd(&mut s.h, &s.gate, &s.up, n * f)?;
        o.matmul_fwd(&mut s.tmp, &s.h, w.down, n, f, d)?;
        o.residual_fwd(&mut s.x, &s.x_mid, &s.tmp, n * d)?;
    }
    o.gather_rows(&mut s.hsel, &s.x, &s.last, r, n, d)?;
    o.rmsnorm_fwd(&mut s.hnorm, &mut s.rstd, &s.hsel, p.final_norm, r, d, eps)?;
    o.matmul_fwd(&mut s.logits, &s.hnorm, p.lm_head, r, d, v)?;
    o.sample(&mut s.tokens, &mut s.logp, &s.logits, sample, r, v)
}
