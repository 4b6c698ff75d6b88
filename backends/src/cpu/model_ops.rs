//! The CPU as the model's [`Ops`]: the plain reference ops of `cpu::ops` on `Vec` buffers,
//! over a [`Model`]'s storage (f32 or 16-bit weights) and, when training, its flat gradient
//! sums.
//!
//! Buffers are sized for exactly the largest batch seen ([`Ops::capacity`] is the identity);
//! each op takes its rows from its arguments and slices the buffers. Attention runs per
//! sequence in parallel, saving one log-sum-exp per head and row (the backward recomputes the
//! probabilities); the lm_head is the chunked one of `cpu::lm_head`; the cheap activations are
//! recomputed in the backward ([`Ops::RECOMPUTE`]), which is what keeps a Qwen3-0.6B GRPO step
//! within the memory budget of `docs/performance.md`.

use std::ops::Range;

use rayon::prelude::*;

use super::lm_head::{lm_head_logprob_bwd, lm_head_logprob_fwd};
use super::model::Model;
use super::ops::*;
use crate::error::Result;
use crate::model::loss::flags;
use crate::model::ops::{Acc, Heads, LogProbs, LossBufs, Ops};
use crate::model::{Loss, LossSums, ParamId};

/// The reference's [`Ops`] over one model: its weights and, for training, its gradient sums.
pub struct CpuOps<'a, T> {
    m: &'a Model<T>,
    grads: Option<&'a mut [T]>,
    /// The fused lm_head's chunk scratch (grow-only).
    scratch: &'a mut Vec<T>,
}

impl<'a, T: Float> CpuOps<'a, T> {
    /// Ops over `m`'s weights; `grads` (the layout's flat sums) receives weight gradients.
    pub fn new(m: &'a Model<T>, grads: Option<&'a mut [T]>, scratch: &'a mut Vec<T>) -> Self {
        Self { m, grads, scratch }
    }

    /// The model's configuration.
    pub fn cfg(&self) -> &crate::config::ModelConfig {
        &self.m.cfg
    }

    /// The gradient sum of tensor `id`.
    ///
    /// # Panics
    /// In a backward without gradient sums (the model refuses training without them first).
    fn grad(&mut self, id: ParamId) -> &mut [T] {
        let r = self.m.layout.range(id);
        let g = self
            .grads
            .as_deref_mut()
            .expect("a backward runs with gradient sums");
        &mut g[r]
    }
}

/// Zeroes `x` where an op that adds writes instead.
fn set<T: Float>(x: &mut [T], acc: Acc) {
    if acc == Acc::Set {
        x.fill(T::ZERO);
    }
}

#[allow(clippy::too_many_arguments)]
impl<T: Float> Ops for CpuOps<'_, T> {
    type Buf = Vec<T>;
    type Idx = Vec<u32>;
    type Seqs = Vec<Range<usize>>;

    const RECOMPUTE: bool = true;

    fn buf(&mut self, len: usize) -> Result<Vec<T>> {
        Ok(vec![T::ZERO; len])
    }

    fn idx(&mut self, len: usize) -> Result<Vec<u32>> {
        Ok(vec![0; len])
    }

    fn seqs(&mut self, _n: usize) -> Result<Vec<Range<usize>>> {
        Ok(Vec::new())
    }

    fn capacity(&self, n: usize) -> usize {
        n
    }

    fn write_buf(&mut self, dst: &mut Vec<T>, src: &[f32]) -> Result<()> {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = T::from_f64(*s as f64);
        }
        Ok(())
    }

    fn write_idx(&mut self, dst: &mut Vec<u32>, src: &[u32], _: Option<usize>) -> Result<()> {
        dst[..src.len()].copy_from_slice(src);
        Ok(())
    }

    fn write_seqs(&mut self, dst: &mut Vec<Range<usize>>, seqs: &[Range<usize>]) -> Result<()> {
        dst.clear();
        dst.extend_from_slice(seqs);
        Ok(())
    }

    fn read(&mut self, src: &Vec<T>, len: usize) -> Result<Vec<f32>> {
        Ok(src[..len].iter().map(|x| x.to_f64() as f32).collect())
    }

    fn embedding_fwd(
        &mut self,
        out: &mut Vec<T>,
        ids: &Vec<u32>,
        table: ParamId,
        n: usize,
        d: usize,
    ) -> Result<()> {
        embedding_fwd(&mut out[..n * d], &ids[..n], self.m.tensor(table), d);
        Ok(())
    }

    fn embedding_bwd(
        &mut self,
        table: ParamId,
        dout: &Vec<T>,
        ids: &Vec<u32>,
        n: usize,
        d: usize,
    ) -> Result<()> {
        embedding_bwd(self.grad(table), &dout[..n * d], &ids[..n], d);
        Ok(())
    }

    fn gather_rows(
        &mut self,
        out: &mut Vec<T>,
        x: &Vec<T>,
        rows: &Vec<u32>,
        m: usize,
        _n: usize,
        d: usize,
    ) -> Result<()> {
        for (i, &r) in rows[..m].iter().enumerate() {
            let r = r as usize;
            out[i * d..(i + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        Ok(())
    }

    fn scatter_rows(
        &mut self,
        dx: &mut Vec<T>,
        dout: &Vec<T>,
        rows: &Vec<u32>,
        m: usize,
        n: usize,
        d: usize,
    ) -> Result<()> {
        dx[..n * d].fill(T::ZERO);
        for (i, &r) in rows[..m].iter().enumerate() {
            let r = r as usize;
            for (x, y) in dx[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&dout[i * d..(i + 1) * d])
            {
                *x += *y;
            }
        }
        Ok(())
    }

    fn rmsnorm_fwd(
        &mut self,
        out: &mut Vec<T>,
        rstd: &mut Vec<T>,
        x: &Vec<T>,
        w: ParamId,
        rows: usize,
        d: usize,
        eps: f64,
    ) -> Result<()> {
        let w = self.m.small(w);
        rmsnorm_fwd(
            &mut out[..rows * d],
            &mut rstd[..rows],
            &x[..rows * d],
            w,
            d,
            eps,
        );
        Ok(())
    }

    fn rmsnorm_bwd(
        &mut self,
        dx: &mut Vec<T>,
        acc: Acc,
        dout: &Vec<T>,
        x: &Vec<T>,
        w: ParamId,
        rstd: &Vec<T>,
        rows: usize,
        d: usize,
    ) -> Result<()> {
        let len = rows * d;
        set(&mut dx[..len], acc);
        let m = self.m;
        let (dout, x, rstd) = (&dout[..len], &x[..len], &rstd[..rows]);
        rmsnorm_bwd(&mut dx[..len], self.grad(w), dout, x, m.small(w), rstd, d);
        Ok(())
    }

    fn matmul_fwd(
        &mut self,
        out: &mut Vec<T>,
        x: &Vec<T>,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        let w = self.m.tensor(w);
        matmul_fwd(&mut out[..n * dout], &x[..n * din], w, n, din, dout);
        Ok(())
    }

    fn matmul_bwd(
        &mut self,
        dx: Option<(&mut Vec<T>, Acc)>,
        dy: &Vec<T>,
        x: &Vec<T>,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        let dx = dx.map(|(b, acc)| {
            set(&mut b[..n * din], acc);
            &mut b[..n * din]
        });
        let m = self.m;
        let (dy, x) = (&dy[..n * dout], &x[..n * din]);
        matmul_bwd(dx, self.grad(w), dy, x, m.full(w), n, din, dout);
        Ok(())
    }

    fn rope_fwd(
        &mut self,
        x: &mut Vec<T>,
        pos: &Vec<u32>,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()> {
        rope_fwd(
            &mut x[..rows * heads * hd],
            &pos[..rows],
            heads,
            &self.m.rope,
        );
        Ok(())
    }

    fn rope_bwd(
        &mut self,
        dx: &mut Vec<T>,
        pos: &Vec<u32>,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()> {
        rope_bwd(
            &mut dx[..rows * heads * hd],
            &pos[..rows],
            heads,
            &self.m.rope,
        );
        Ok(())
    }

    fn attention_stats_len(&self, n: usize, heads: Heads) -> usize {
        heads.h * n
    }

    fn attention_fwd(
        &mut self,
        out: &mut Vec<T>,
        stats: &mut Vec<T>,
        q: &Vec<T>,
        k: &Vec<T>,
        v: &Vec<T>,
        seqs: &Vec<Range<usize>>,
        n: usize,
        hs: Heads,
    ) -> Result<()> {
        let Heads { h, kvh, hd } = hs;
        let (qd, kd) = (h * hd, kvh * hd);
        // Each sequence's rows of the output and its [h, len] block of log-sum-exps.
        let mut tasks = Vec::with_capacity(seqs.len());
        let (mut out_rest, mut lse_rest) = (&mut out[..n * qd], &mut stats[..h * n]);
        for s in seqs {
            let (o, r) = std::mem::take(&mut out_rest).split_at_mut(s.len() * qd);
            out_rest = r;
            let (l, r) = std::mem::take(&mut lse_rest).split_at_mut(h * s.len());
            lse_rest = r;
            tasks.push((s.clone(), o, l));
        }
        tasks.into_par_iter().for_each(|(s, o, l)| {
            let m = s.len();
            let mut scratch = vec![T::ZERO; m];
            let (q, k, v) = (
                &q[s.start * qd..s.end * qd],
                &k[s.start * kd..s.end * kd],
                &v[s.start * kd..s.end * kd],
            );
            attention_fwd_lse(o, l, &mut scratch, q, k, v, m, m, h, kvh, hd);
        });
        Ok(())
    }

    fn attention_bwd(
        &mut self,
        dq: &mut Vec<T>,
        dk: &mut Vec<T>,
        dv: &mut Vec<T>,
        stats: &mut Vec<T>,
        dout: &Vec<T>,
        q: &Vec<T>,
        k: &Vec<T>,
        v: &Vec<T>,
        _out: &Vec<T>,
        seqs: &Vec<Range<usize>>,
        n: usize,
        hs: Heads,
    ) -> Result<()> {
        let Heads { h, kvh, hd } = hs;
        let (qd, kd) = (h * hd, kvh * hd);
        let mut tasks = Vec::with_capacity(seqs.len());
        let (mut dq_r, mut dk_r, mut dv_r) =
            (&mut dq[..n * qd], &mut dk[..n * kd], &mut dv[..n * kd]);
        for s in seqs {
            let ml = s.len();
            let (x, r) = std::mem::take(&mut dq_r).split_at_mut(ml * qd);
            dq_r = r;
            let (y, r) = std::mem::take(&mut dk_r).split_at_mut(ml * kd);
            dk_r = r;
            let (z, r) = std::mem::take(&mut dv_r).split_at_mut(ml * kd);
            dv_r = r;
            tasks.push((s.clone(), x, y, z));
        }
        let lse = &stats[..h * n];
        tasks.into_par_iter().for_each(|(s, dq, dk, dv)| {
            let ml = s.len();
            dq.fill(T::ZERO);
            dk.fill(T::ZERO);
            dv.fill(T::ZERO);
            let mut scratch = vec![T::ZERO; 2 * ml];
            attention_bwd_lse(
                dq,
                dk,
                dv,
                &mut scratch,
                &dout[s.start * qd..s.end * qd],
                &lse[h * s.start..h * s.end],
                &q[s.start * qd..s.end * qd],
                &k[s.start * kd..s.end * kd],
                &v[s.start * kd..s.end * kd],
                ml,
                ml,
                h,
                kvh,
                hd,
            );
        });
        Ok(())
    }

    fn swiglu_fwd(
        &mut self,
        out: &mut Vec<T>,
        gate: &Vec<T>,
        up: &Vec<T>,
        len: usize,
    ) -> Result<()> {
        swiglu_fwd(&mut out[..len], &gate[..len], &up[..len]);
        Ok(())
    }

    fn swiglu_bwd(
        &mut self,
        dgate: &mut Vec<T>,
        dup: &mut Vec<T>,
        dout: &Vec<T>,
        gate: &Vec<T>,
        up: &Vec<T>,
        len: usize,
    ) -> Result<()> {
        dgate[..len].fill(T::ZERO);
        dup[..len].fill(T::ZERO);
        swiglu_bwd(
            &mut dgate[..len],
            &mut dup[..len],
            &dout[..len],
            &gate[..len],
            &up[..len],
        );
        Ok(())
    }

    fn residual_fwd(&mut self, out: &mut Vec<T>, a: &Vec<T>, b: &Vec<T>, len: usize) -> Result<()> {
        residual_fwd(&mut out[..len], &a[..len], &b[..len]);
        Ok(())
    }

    fn logprob_fwd(
        &mut self,
        out: LogProbs<'_, Vec<T>>,
        logits: &Vec<T>,
        targets: &Vec<u32>,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        logprob_fwd(
            &mut out.logp[..m],
            &mut out.entropy[..m],
            &mut out.lse[..m],
            &logits[..m * v],
            &targets[..m],
            v,
            temperature,
        );
        Ok(())
    }

    fn logprob_bwd(
        &mut self,
        dlogits: &mut Vec<T>,
        dlogp: &Vec<T>,
        logits: &Vec<T>,
        targets: &Vec<u32>,
        lse: &Vec<T>,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        dlogits[..m * v].fill(T::ZERO);
        let (z, t, l) = (&logits[..m * v], &targets[..m], &lse[..m]);
        logprob_bwd(&mut dlogits[..m * v], &dlogp[..m], z, t, l, v, temperature);
        Ok(())
    }

    fn lm_head_logprob_fwd(
        &mut self,
        out: LogProbs<'_, Vec<T>>,
        x: &Vec<T>,
        w: ParamId,
        targets: &Vec<u32>,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        lm_head_logprob_fwd(
            &mut out.logp[..m],
            &mut out.entropy[..m],
            &mut out.lse[..m],
            &x[..m * d],
            self.m.tensor(w),
            &targets[..m],
            m,
            d,
            v,
            temperature,
            self.scratch,
        );
        Ok(())
    }

    fn lm_head_logprob_bwd(
        &mut self,
        dx: &mut Vec<T>,
        dlogp: &Vec<T>,
        x: &Vec<T>,
        w: ParamId,
        targets: &Vec<u32>,
        lse: &Vec<T>,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        dx[..m * d].fill(T::ZERO);
        let model = self.m;
        let r = model.layout.range(w);
        let (grads, scratch) = (self.grads.as_deref_mut(), &mut *self.scratch);
        let dw = &mut grads.expect("a backward runs with gradient sums")[r];
        lm_head_logprob_bwd(
            &mut dx[..m * d],
            dw,
            &dlogp[..m],
            &x[..m * d],
            model.full(w),
            &targets[..m],
            &lse[..m],
            m,
            d,
            v,
            temperature,
            scratch,
        );
        Ok(())
    }

    fn loss_fwd(
        &mut self,
        logp: &Vec<T>,
        entropy: &Vec<T>,
        inputs: &LossBufs<Vec<T>, Vec<u32>>,
        m: usize,
        loss: Loss,
    ) -> Result<LossSums> {
        let entropy = entropy[..m].iter().map(|x| x.to_f64()).sum();
        let w = &inputs.wts[..m];
        let logp = &logp[..m];
        let Loss::Grpo { .. } = loss else {
            let l = -(0..m).map(|t| (w[t] * logp[t]).to_f64()).sum::<f64>();
            return Ok(LossSums {
                loss: l,
                entropy,
                ..Default::default()
            });
        };
        let (old, refp) = resolved(inputs, logp, m);
        let (mut l, mut kl, mut clipped) = (vec![T::ZERO; m], vec![T::ZERO; m], vec![false; m]);
        let c = coefs(loss);
        grpo_loss_fwd(
            &mut l,
            &mut kl,
            &mut clipped,
            logp,
            &old,
            &refp,
            &inputs.adv[..m],
            w,
            c,
        );
        Ok(LossSums {
            loss: l.iter().map(|x| x.to_f64()).sum(),
            kl: kl.iter().map(|x| x.to_f64()).sum(),
            clipped: clipped.iter().filter(|c| **c).count(),
            entropy,
        })
    }

    fn loss_bwd(
        &mut self,
        dlogp: &mut Vec<T>,
        logp: &Vec<T>,
        inputs: &LossBufs<Vec<T>, Vec<u32>>,
        m: usize,
        loss: Loss,
    ) -> Result<()> {
        let (dlogp, w, logp) = (&mut dlogp[..m], &inputs.wts[..m], &logp[..m]);
        dlogp.fill(T::ZERO);
        match loss {
            Loss::Sft => dlogp.iter_mut().zip(w).for_each(|(d, w)| *d = -*w),
            Loss::Grpo { .. } => {
                let (old, refp) = resolved(inputs, logp, m);
                grpo_loss_bwd(dlogp, logp, &old, &refp, &inputs.adv[..m], w, coefs(loss));
            }
        }
        Ok(())
    }
}

/// The GRPO coefficients of `loss` (SFT has none).
fn coefs(loss: Loss) -> GrpoCoefs {
    match loss {
        Loss::Grpo {
            eps_low,
            eps_high,
            beta,
        } => GrpoCoefs {
            eps_low,
            eps_high,
            beta,
        },
        Loss::Sft => GrpoCoefs {
            eps_low: 0.0,
            eps_high: 0.0,
            beta: 0.0,
        },
    }
}

/// The old and reference log-probs the loss reads: the stored ones where a token has them,
/// else the current log-probs, detached (a constant of the backward: ratio 1, KL 0).
fn resolved<T: Float>(x: &LossBufs<Vec<T>, Vec<u32>>, logp: &[T], m: usize) -> (Vec<T>, Vec<T>) {
    let pick = |stored: &[T], bit: u32| -> Vec<T> {
        (0..m)
            .map(|t| {
                if x.flags[t] & bit != 0 {
                    stored[t]
                } else {
                    logp[t]
                }
            })
            .collect()
    };
    (pick(&x.old, flags::HAS_OLD), pick(&x.refp, flags::HAS_REF))
}
