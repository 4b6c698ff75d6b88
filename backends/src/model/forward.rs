//! The training forward and its backward: the only layer loops of a packed batch.
//!
//! Per layer, Qwen3's pre-norm block: `x_mid = x + o(attention(rope(q_norm(q(ln1))),
//! rope(k_norm(k(ln1))), v(ln1)))` with `ln1 = rmsnorm(x)`, then `x_out = x_mid +
//! down(silu(gate(ln2))·up(ln2))` with `ln2 = rmsnorm(x_mid)`. The forward ends at the final
//! norm of the scored rows (`hsel`); the lm_head runs fused with the log-probs
//! ([`Ops::lm_head_logprob_fwd`]). The backward walks the same ops in reverse, adding every
//! weight's gradient into its sum.
//!
//! The steps that can be recomputed ([`Recomputed`]) are small functions that the forward and
//! a recomputing backend's backward both call, so the recomputed values are the forward's.

use super::acts::{ActsOf, LayerActs, Recomputed};
use super::layout::{LayerParams, ParamIds};
use super::ops::{Acc, Heads, Ops};
use crate::config::ModelConfig;
use crate::error::Result;

/// The shapes every op of a layer reads.
#[derive(Debug, Clone, Copy)]
struct Dims {
    n: usize,
    d: usize,
    f: usize,
    qd: usize,
    kd: usize,
    heads: Heads,
    eps: f64,
}

impl Dims {
    fn new(c: &ModelConfig, n: usize) -> Self {
        Self {
            n,
            d: c.hidden_size,
            f: c.intermediate_size,
            qd: c.q_dim(),
            kd: c.kv_dim(),
            heads: Heads::of(c),
            eps: c.rms_norm_eps,
        }
    }
}

/// `ln1 = rmsnorm(x_in)`.
fn norm_in<O: Ops>(
    o: &mut O,
    z: Dims,
    w: &LayerParams,
    la: &mut LayerActs<O::Buf>,
    r: &mut Recomputed<O::Buf>,
    x_in: &O::Buf,
) -> Result<()> {
    o.rmsnorm_fwd(
        &mut r.ln1,
        &mut la.ln1_rstd,
        x_in,
        w.input_norm,
        z.n,
        z.d,
        z.eps,
    )
}

/// `q = rope(q_norm(q_pre))`, `k = rope(k_norm(k_pre))`.
fn qk_norm_rope<O: Ops>(
    o: &mut O,
    z: Dims,
    w: &LayerParams,
    la: &mut LayerActs<O::Buf>,
    r: &mut Recomputed<O::Buf>,
    pos: &O::Idx,
) -> Result<()> {
    let (n, Heads { h, kvh, hd }) = (z.n, z.heads);
    o.rmsnorm_fwd(
        &mut r.q,
        &mut la.q_rstd,
        &la.q_pre,
        w.q_norm,
        n * h,
        hd,
        z.eps,
    )?;
    o.rmsnorm_fwd(
        &mut r.k,
        &mut la.k_rstd,
        &la.k_pre,
        w.k_norm,
        n * kvh,
        hd,
        z.eps,
    )?;
    o.rope_fwd(&mut r.q, pos, n, h, hd)?;
    o.rope_fwd(&mut r.k, pos, n, kvh, hd)
}

/// `ln2 = rmsnorm(x_mid)`.
fn norm_post<O: Ops>(
    o: &mut O,
    z: Dims,
    w: &LayerParams,
    la: &mut LayerActs<O::Buf>,
    r: &mut Recomputed<O::Buf>,
) -> Result<()> {
    o.rmsnorm_fwd(
        &mut r.ln2,
        &mut la.ln2_rstd,
        &la.x_mid,
        w.post_norm,
        z.n,
        z.d,
        z.eps,
    )
}

/// `h = silu(gate)·up`.
fn swiglu<O: Ops>(
    o: &mut O,
    z: Dims,
    la: &LayerActs<O::Buf>,
    r: &mut Recomputed<O::Buf>,
) -> Result<()> {
    o.swiglu_fwd(&mut r.h, &la.gate, &la.up, z.n * z.f)
}

/// Refills a layer's [`Recomputed`] values from what it saved, with the forward's own steps.
fn recompute<O: Ops>(
    o: &mut O,
    z: Dims,
    w: &LayerParams,
    la: &mut LayerActs<O::Buf>,
    r: &mut Recomputed<O::Buf>,
    x_in: &O::Buf,
    pos: &O::Idx,
) -> Result<()> {
    norm_in(o, z, w, la, r, x_in)?;
    qk_norm_rope(o, z, w, la, r, pos)?;
    norm_post(o, z, w, la, r)?;
    swiglu(o, z, la, r)
}

/// The forward of the `n` rows loaded into `a` up to the final norm of its `m` scored rows
/// (`a.hsel`).
pub fn forward<O: Ops>(
    o: &mut O,
    c: &ModelConfig,
    p: &ParamIds,
    a: &mut ActsOf<O>,
    n: usize,
    m: usize,
) -> Result<()> {
    let z = Dims::new(c, n);
    let (d, f, qd) = (z.d, z.f, z.qd);
    let nl = p.layers.len();
    o.embedding_fwd(&mut a.resid[0], &a.ids, p.embed, n, d)?;
    for (l, w) in p.layers.iter().enumerate() {
        let (lo, hi) = a.resid.split_at_mut(l + 1);
        let (x_in, x_out) = (&lo[l], &mut hi[0]);
        let la = &mut a.layers[l];
        let r = &mut a.re[if O::RECOMPUTE { 0 } else { l }];
        norm_in(o, z, w, la, r, x_in)?;
        o.matmul_fwd(&mut la.q_pre, &r.ln1, w.q, n, d, qd)?;
        o.matmul_fwd(&mut la.k_pre, &r.ln1, w.k, n, d, z.kd)?;
        o.matmul_fwd(&mut la.v, &r.ln1, w.v, n, d, z.kd)?;
        qk_norm_rope(o, z, w, la, r, &a.pos)?;
        let (out, stats) = (&mut la.att_out, &mut la.att_stats);
        o.attention_fwd(out, stats, &r.q, &r.k, &la.v, &a.seqs, n, z.heads)?;
        o.matmul_fwd(&mut a.tmp, &la.att_out, w.o, n, qd, d)?;
        o.residual_fwd(&mut la.x_mid, x_in, &a.tmp, n * d)?;
        norm_post(o, z, w, la, r)?;
        o.matmul_fwd(&mut la.gate, &r.ln2, w.gate, n, d, f)?;
        o.matmul_fwd(&mut la.up, &r.ln2, w.up, n, d, f)?;
        swiglu(o, z, la, r)?;
        o.matmul_fwd(&mut a.tmp, &r.h, w.down, n, f, d)?;
        o.residual_fwd(x_out, &la.x_mid, &a.tmp, n * d)?;
    }
    let eps = c.rms_norm_eps;
    o.rmsnorm_fwd(
        &mut a.lnf,
        &mut a.lnf_rstd,
        &a.resid[nl],
        p.final_norm,
        n,
        d,
        eps,
    )?;
    o.gather_rows(&mut a.hsel, &a.lnf, &a.rows, m, n, d)
}

/// The backward after [`forward`] and the lm_head's log-probs at `temperature`, from the
/// gradient of the loss with respect to those log-probs in `a.dlogp`: adds every weight's
/// gradient into its sum.
pub fn backward<O: Ops>(
    o: &mut O,
    c: &ModelConfig,
    p: &ParamIds,
    a: &mut ActsOf<O>,
    n: usize,
    m: usize,
    temperature: f64,
) -> Result<()> {
    let z = Dims::new(c, n);
    let (d, v) = (z.d, c.vocab_size);
    let nl = p.layers.len();
    let (dhsel, hsel) = (&mut a.dhsel, &a.hsel);
    o.lm_head_logprob_bwd(
        dhsel,
        &a.dlogp,
        hsel,
        p.lm_head,
        &a.targets,
        &a.lse,
        m,
        d,
        v,
        temperature,
    )?;
    o.scatter_rows(&mut a.dlnf, &a.dhsel, &a.rows, m, n, d)?;
    let fin = (&a.resid[nl], &a.lnf_rstd);
    o.rmsnorm_bwd(
        &mut a.dres,
        Acc::Set,
        &a.dlnf,
        fin.0,
        p.final_norm,
        fin.1,
        n,
        d,
    )?;
    for l in (0..nl).rev() {
        let w = &p.layers[l];
        let r = &mut a.re[if O::RECOMPUTE { 0 } else { l }];
        if O::RECOMPUTE {
            recompute(o, z, w, &mut a.layers[l], r, &a.resid[l], &a.pos)?;
        }
        let b = Grads {
            dres: &mut a.dres,
            dh: &mut a.dh,
            dgate: &mut a.dgate,
            dup: &mut a.dup,
            dln: &mut a.dln,
            datt: &mut a.datt,
            dq: &mut a.dq,
            dk: &mut a.dk,
            dv: &mut a.dv,
            dq_pre: &mut a.dq_pre,
            dk_pre: &mut a.dk_pre,
        };
        let la = &mut a.layers[l];
        layer_bwd(o, z, w, la, r, b, &a.resid[l], &a.pos, &a.seqs)?;
    }
    o.embedding_bwd(p.embed, &a.dres, &a.ids, n, d)
}

/// The backward's scratch for one layer.
struct Grads<'a, B> {
    dres: &'a mut B,
    dh: &'a mut B,
    dgate: &'a mut B,
    dup: &'a mut B,
    dln: &'a mut B,
    datt: &'a mut B,
    dq: &'a mut B,
    dk: &'a mut B,
    dv: &'a mut B,
    dq_pre: &'a mut B,
    dk_pre: &'a mut B,
}

/// One layer's backward: `dres` holds the gradient of its output on entry and of its input
/// on return.
#[allow(clippy::too_many_arguments)]
fn layer_bwd<O: Ops>(
    o: &mut O,
    z: Dims,
    w: &LayerParams,
    la: &mut LayerActs<O::Buf>,
    r: &Recomputed<O::Buf>,
    g: Grads<'_, O::Buf>,
    x_in: &O::Buf,
    pos: &O::Idx,
    seqs: &O::Seqs,
) -> Result<()> {
    let (n, d, f, qd, kd) = (z.n, z.d, z.f, z.qd, z.kd);
    let Heads { h, kvh, hd } = z.heads;
    // MLP: x_out = x_mid + down(swiglu(gate(ln2), up(ln2)))
    o.matmul_bwd(Some((&mut *g.dh, Acc::Set)), g.dres, &r.h, w.down, n, f, d)?;
    o.swiglu_bwd(g.dgate, g.dup, g.dh, &la.gate, &la.up, n * f)?;
    o.matmul_bwd(
        Some((&mut *g.dln, Acc::Set)),
        g.dgate,
        &r.ln2,
        w.gate,
        n,
        d,
        f,
    )?;
    o.matmul_bwd(Some((&mut *g.dln, Acc::Add)), g.dup, &r.ln2, w.up, n, d, f)?;
    let post = (&la.x_mid, &la.ln2_rstd);
    o.rmsnorm_bwd(g.dres, Acc::Add, g.dln, post.0, w.post_norm, post.1, n, d)?;
    // attention: x_mid = x_in + o(attention(rope(q_norm(q)), rope(k_norm(k)), v))
    o.matmul_bwd(
        Some((&mut *g.datt, Acc::Set)),
        g.dres,
        &la.att_out,
        w.o,
        n,
        qd,
        d,
    )?;
    let (q, k, v, out) = (&r.q, &r.k, &la.v, &la.att_out);
    o.attention_bwd(
        g.dq,
        g.dk,
        g.dv,
        &mut la.att_stats,
        g.datt,
        q,
        k,
        v,
        out,
        seqs,
        n,
        z.heads,
    )?;
    o.rope_bwd(g.dq, pos, n, h, hd)?;
    o.rope_bwd(g.dk, pos, n, kvh, hd)?;
    let qn = (&la.q_pre, &la.q_rstd);
    o.rmsnorm_bwd(g.dq_pre, Acc::Set, g.dq, qn.0, w.q_norm, qn.1, n * h, hd)?;
    o.matmul_bwd(
        Some((&mut *g.dln, Acc::Set)),
        g.dq_pre,
        &r.ln1,
        w.q,
        n,
        d,
        qd,
    )?;
    let kn = (&la.k_pre, &la.k_rstd);
    o.rmsnorm_bwd(g.dk_pre, Acc::Set, g.dk, kn.0, w.k_norm, kn.1, n * kvh, hd)?;
    o.matmul_bwd(
        Some((&mut *g.dln, Acc::Add)),
        g.dk_pre,
        &r.ln1,
        w.k,
        n,
        d,
        kd,
    )?;
    o.matmul_bwd(Some((&mut *g.dln, Acc::Add)), g.dv, &r.ln1, w.v, n, d, kd)?;
    o.rmsnorm_bwd(
        g.dres,
        Acc::Add,
        g.dln,
        x_in,
        w.input_norm,
        &la.ln1_rstd,
        n,
        d,
    )
}
