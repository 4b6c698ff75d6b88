//! The buffers of a training or scoring pass: a packed batch's inputs, what the forward saves
//! for the backward, and the backward's scratch, in any backend's buffer types.
//!
//! Buffers are allocated for a capacity of rows ([`Ops::capacity`]) and replaced only when a
//! batch needs more, so in steady state a call reuses every buffer (and a device every
//! binding it cached).
//!
//! The activations that are cheap to recompute from what a layer keeps ([`Recomputed`]: `ln1`
//! from its input, `q`/`k` from `q_pre`/`k_pre`, `ln2` from `x_mid`, `h` from `gate`/`up`,
//! each with the saved rstd) are 8,192 of the 21,504 values per token and layer at
//! Qwen3-0.6B's shapes. A backend that recomputes them ([`Ops::RECOMPUTE`]) holds one set that
//! every layer's forward writes and the backward refills per layer with the very same ops
//! (so the values are bit-identical); the others keep one set per layer.

use super::batch::Packed;
use super::loss::LossInputs;
use super::ops::{Heads, LossBufs, Ops};
use crate::config::ModelConfig;
use crate::error::Result;

/// The activations one layer's backward can recompute (see the module docs).
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct Recomputed<B> {
    pub ln1: B,
    pub q: B,
    pub k: B,
    pub ln2: B,
    pub h: B,
}

/// What one layer's forward saves for its backward (besides [`Recomputed`]).
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct LayerActs<B> {
    pub ln1_rstd: B,
    pub q_pre: B,
    pub q_rstd: B,
    pub k_pre: B,
    pub k_rstd: B,
    pub v: B,
    /// The attention statistics ([`Ops::attention_stats_len`]).
    pub att_stats: B,
    pub att_out: B,
    pub x_mid: B,
    pub ln2_rstd: B,
    pub gate: B,
    pub up: B,
}

/// Inputs, activations and backward scratch of a packed batch, for up to `cap_n` token rows
/// and `cap_m` scored rows.
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct Acts<B, I, S> {
    pub cap_n: usize,
    pub cap_m: usize,
    // inputs
    pub ids: I,
    pub pos: I,
    pub rows: I,
    pub targets: I,
    pub seqs: S,
    /// Present once a training batch was loaded.
    pub loss: Option<LossBufs<B, I>>,
    // forward
    /// Residual stream: `resid[0]` the embeddings, `resid[l + 1]` the output of layer `l`.
    pub resid: Vec<B>,
    pub layers: Vec<LayerActs<B>>,
    /// One set (recomputing backends) or one per layer.
    pub re: Vec<Recomputed<B>>,
    pub tmp: B,
    pub lnf: B,
    pub lnf_rstd: B,
    /// Final norm rows at the scored positions, `[m, d]`.
    pub hsel: B,
    pub logp: B,
    pub entropy: B,
    pub lse: B,
    // backward
    pub dlogp: B,
    pub dhsel: B,
    pub dlnf: B,
    pub dres: B,
    pub dh: B,
    pub dgate: B,
    pub dup: B,
    pub dln: B,
    pub datt: B,
    pub dq: B,
    pub dk: B,
    pub dv: B,
    pub dq_pre: B,
    pub dk_pre: B,
}

/// The activation set of backend `O`.
pub type ActsOf<O> = Acts<<O as Ops>::Buf, <O as Ops>::Idx, <O as Ops>::Seqs>;

impl<B, I, S> Acts<B, I, S> {
    /// A set for `cap_n` rows and `cap_m` scored rows of model `c`.
    pub fn new<O: Ops<Buf = B, Idx = I, Seqs = S>>(
        o: &mut O,
        c: &ModelConfig,
        cap_n: usize,
        cap_m: usize,
    ) -> Result<Self> {
        let (n, m) = (cap_n, cap_m);
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let heads = Heads::of(c);
        let (h, kvh) = (heads.h, heads.kvh);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let nl = c.num_hidden_layers;
        let mut layers = Vec::with_capacity(nl);
        for _ in 0..nl {
            layers.push(LayerActs {
                ln1_rstd: o.buf(n)?,
                q_pre: o.buf(n * qd)?,
                q_rstd: o.buf(n * h)?,
                k_pre: o.buf(n * kd)?,
                k_rstd: o.buf(n * kvh)?,
                v: o.buf(n * kd)?,
                att_stats: o.buf(o.attention_stats_len(n, heads))?,
                att_out: o.buf(n * qd)?,
                x_mid: o.buf(n * d)?,
                ln2_rstd: o.buf(n)?,
                gate: o.buf(n * f)?,
                up: o.buf(n * f)?,
            });
        }
        let sets = if O::RECOMPUTE { 1 } else { nl };
        let mut re = Vec::with_capacity(sets);
        for _ in 0..sets {
            re.push(Recomputed {
                ln1: o.buf(n * d)?,
                q: o.buf(n * qd)?,
                k: o.buf(n * kd)?,
                ln2: o.buf(n * d)?,
                h: o.buf(n * f)?,
            });
        }
        Ok(Self {
            cap_n,
            cap_m,
            ids: o.idx(n)?,
            pos: o.idx(n)?,
            rows: o.idx(m)?,
            targets: o.idx(m)?,
            seqs: o.seqs(n)?,
            loss: None,
            resid: (0..=nl).map(|_| o.buf(n * d)).collect::<Result<_>>()?,
            layers,
            re,
            tmp: o.buf(n * d)?,
            lnf: o.buf(n * d)?,
            lnf_rstd: o.buf(n)?,
            hsel: o.buf(m * d)?,
            logp: o.buf(m)?,
            entropy: o.buf(m)?,
            lse: o.buf(m)?,
            dlogp: o.buf(m)?,
            dhsel: o.buf(m * d)?,
            dlnf: o.buf(n * d)?,
            dres: o.buf(n * d)?,
            dh: o.buf(n * f)?,
            dgate: o.buf(n * f)?,
            dup: o.buf(n * f)?,
            dln: o.buf(n * d)?,
            datt: o.buf(n * qd)?,
            dq: o.buf(n * qd)?,
            dk: o.buf(n * kd)?,
            dv: o.buf(n * kd)?,
            dq_pre: o.buf(n * qd)?,
            dk_pre: o.buf(n * kd)?,
        })
    }
}

/// Makes sure `acts` holds at least `n` rows and `m` scored rows; a smaller set is dropped
/// before the larger one is allocated.
pub fn ensure<O: Ops>(
    o: &mut O,
    c: &ModelConfig,
    acts: &mut Option<ActsOf<O>>,
    n: usize,
    m: usize,
) -> Result<()> {
    if acts.as_ref().is_some_and(|a| a.cap_n >= n && a.cap_m >= m) {
        return Ok(());
    }
    *acts = None;
    let (cap_n, cap_m) = (o.capacity(n), o.capacity(m));
    o.replaced(cap_n, cap_m)?;
    *acts = Some(Acts::new(o, c, cap_n, cap_m)?);
    Ok(())
}

/// Writes a packed batch's inputs (and, for training, its loss inputs) into `acts`, made
/// large enough first.
pub fn load<'a, O: Ops>(
    o: &mut O,
    c: &ModelConfig,
    acts: &'a mut Option<ActsOf<O>>,
    b: &Packed,
    loss: Option<&LossInputs>,
) -> Result<&'a mut ActsOf<O>> {
    ensure(o, c, acts, b.n(), b.m())?;
    let a = acts
        .as_mut()
        .ok_or_else(|| crate::error::BackendError::Device("activations missing".into()))?;
    o.write_idx(&mut a.ids, &b.ids, Some(c.vocab_size))?;
    o.write_idx(&mut a.pos, &b.pos, None)?;
    o.write_idx(&mut a.rows, &b.rows, Some(b.n()))?;
    o.write_idx(&mut a.targets, &b.targets, None)?;
    o.write_seqs(&mut a.seqs, &b.seqs)?;
    if let Some(x) = loss {
        let m = a.cap_m;
        let l = match a.loss.take() {
            Some(l) => l,
            None => LossBufs {
                old: o.buf(m)?,
                refp: o.buf(m)?,
                adv: o.buf(m)?,
                wts: o.buf(m)?,
                flags: o.idx(m)?,
            },
        };
        let mut l = l;
        o.write_buf(&mut l.old, &x.old)?;
        o.write_buf(&mut l.refp, &x.refp)?;
        o.write_buf(&mut l.adv, &x.adv)?;
        o.write_buf(&mut l.wts, &x.wts)?;
        o.write_idx(&mut l.flags, &x.flags, None)?;
        a.loss = Some(l);
    }
    Ok(a)
}
