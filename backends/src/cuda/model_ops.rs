//! The CUDA device as the model's [`Ops`]: each op launches its PTX entries (`ops`) on the
//! context's stream, over a [`DeviceModel`]'s parameter and gradient buffers.
//!
//! The PTX backward kernels add into their outputs, so an op whose [`Acc`] says `Set` clears
//! its output first. The lm_head walks the vocabulary in chunks ([`plan::vocab_chunks`])
//! whose logits are folded into an online log-sum-exp (forward) or turned into their
//! gradient and applied at once (backward), so no `[rows × vocab]` values are stored.

use std::sync::Arc;

use super::device::{Cuda, DBuf};
use super::layout::logits_len;
use super::model::DeviceModel;
use super::ops::{self, LossBufs as KernelLoss};
use super::plan::{self, GemmF32};
use crate::error::{BackendError, Result};
use crate::model::ops::{Acc, Heads, LogProbs, LossBufs, Ops};
use crate::model::{Loss, LossSums, ParamId};

/// Scratch of the ops that the activations do not hold, sized with them.
#[derive(Debug)]
pub struct Scratch {
    /// One vocabulary chunk's logits for every scored row.
    logits: DBuf<f32>,
    /// The chunked log-probs' running state, `[rows, 4]`.
    lp_state: DBuf<f32>,
    loss_stats: DBuf<f32>,
}

/// The CUDA backend's [`Ops`] over one model.
pub struct CudaOps<'a> {
    cuda: &'a Arc<Cuda>,
    md: &'a DeviceModel,
    scratch: &'a mut Option<Scratch>,
}

impl<'a> CudaOps<'a> {
    /// Ops launching on `cuda` over `md`'s buffers, with `scratch` kept by the caller.
    pub fn new(cuda: &'a Arc<Cuda>, md: &'a DeviceModel, scratch: &'a mut Option<Scratch>) -> Self {
        Self { cuda, md, scratch }
    }

    /// The context the ops launch on.
    pub fn cuda(&self) -> &'a Arc<Cuda> {
        self.cuda
    }

    /// The model the ops read.
    pub fn model(&self) -> &'a DeviceModel {
        self.md
    }

    fn p(&self, id: ParamId) -> &'a DBuf<f32> {
        &self.md.params[id.0]
    }

    fn g(&self, id: ParamId) -> &'a DBuf<f32> {
        &self.md.grads[id.0]
    }

    fn rows_of(&self, id: ParamId, d: usize) -> usize {
        self.md.layout.entry(id).len / d.max(1)
    }

    fn scratch(&self) -> Result<&Scratch> {
        self.scratch
            .as_ref()
            .ok_or_else(|| BackendError::Device("op scratch missing".into()))
    }

    /// One vocabulary chunk's logits `[m, len]` (tokens `v0..v0+len`) of the rows of `x`
    /// through `w` into the scratch.
    fn chunk_logits(
        &self,
        x: &DBuf<f32>,
        w: ParamId,
        m: usize,
        d: usize,
        v0: usize,
        len: usize,
    ) -> Result<()> {
        let s = self.scratch()?;
        let g = GemmF32::fwd(m, d, len);
        ops::gemm_f32(self.cuda, (&s.logits, 0), (x, 0), (self.p(w), v0 * d), g)
    }

    /// The vocabulary chunks of `m` scored rows under the scratch's size.
    fn chunks(&self, m: usize, v: usize) -> Result<Vec<(usize, usize)>> {
        Ok(plan::vocab_chunks(m, v, self.scratch()?.logits.len()))
    }
}

/// Clears `b` where an op that adds writes instead.
fn set(b: &DBuf<f32>, acc: Acc) -> Result<()> {
    match acc {
        Acc::Set => b.clear(),
        Acc::Add => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
impl Ops for CudaOps<'_> {
    type Buf = DBuf<f32>;
    type Idx = DBuf<u32>;
    type Seqs = DBuf<u32>;

    fn buf(&mut self, len: usize) -> Result<DBuf<f32>> {
        self.cuda.alloc(len)
    }

    fn idx(&mut self, len: usize) -> Result<DBuf<u32>> {
        self.cuda.alloc(len)
    }

    fn seqs(&mut self, n: usize) -> Result<DBuf<u32>> {
        // `(start, pos)` per row.
        self.cuda.alloc(2 * n)
    }

    fn capacity(&self, n: usize) -> usize {
        plan::capacity(n, 64)
    }

    fn replaced(&mut self, _cap_n: usize, cap_m: usize) -> Result<()> {
        *self.scratch = None;
        let v = self.md.cfg.vocab_size;
        *self.scratch = Some(Scratch {
            logits: self.cuda.alloc(logits_len(cap_m, v))?,
            lp_state: self.cuda.alloc(4 * cap_m)?,
            loss_stats: self.cuda.alloc(4)?,
        });
        Ok(())
    }

    fn write_buf(&mut self, dst: &mut DBuf<f32>, src: &[f32]) -> Result<()> {
        dst.write(0, src)
    }

    fn write_idx(&mut self, dst: &mut DBuf<u32>, src: &[u32], _: Option<usize>) -> Result<()> {
        dst.write(0, src)
    }

    fn write_seqs(&mut self, dst: &mut DBuf<u32>, seqs: &[std::ops::Range<usize>]) -> Result<()> {
        let mut q = Vec::new();
        for s in seqs {
            for t in 0..s.len() {
                q.extend([s.start as u32, t as u32]);
            }
        }
        dst.write(0, &q)
    }

    fn read(&mut self, src: &DBuf<f32>, len: usize) -> Result<Vec<f32>> {
        src.read(0, len)
    }

    fn embedding_fwd(
        &mut self,
        out: &mut DBuf<f32>,
        ids: &DBuf<u32>,
        table: ParamId,
        n: usize,
        d: usize,
    ) -> Result<()> {
        let vocab = self.rows_of(table, d);
        ops::embedding_fwd(self.cuda, out, self.p(table), ids, n, d, vocab)
    }

    fn embedding_bwd(
        &mut self,
        table: ParamId,
        dout: &DBuf<f32>,
        ids: &DBuf<u32>,
        n: usize,
        d: usize,
    ) -> Result<()> {
        let vocab = self.rows_of(table, d);
        ops::embedding_bwd(self.cuda, self.g(table), dout, ids, n, d, vocab)
    }

    fn gather_rows(
        &mut self,
        out: &mut DBuf<f32>,
        x: &DBuf<f32>,
        rows: &DBuf<u32>,
        m: usize,
        n: usize,
        d: usize,
    ) -> Result<()> {
        // A row gather is the embedding kernel with `x` as the table.
        ops::embedding_fwd(self.cuda, out, x, rows, m, d, n)
    }

    fn scatter_rows(
        &mut self,
        dx: &mut DBuf<f32>,
        dout: &DBuf<f32>,
        rows: &DBuf<u32>,
        m: usize,
        n: usize,
        d: usize,
    ) -> Result<()> {
        dx.clear()?;
        ops::embedding_bwd(self.cuda, dx, dout, rows, m, d, n)
    }

    fn rmsnorm_fwd(
        &mut self,
        out: &mut DBuf<f32>,
        rstd: &mut DBuf<f32>,
        x: &DBuf<f32>,
        w: ParamId,
        rows: usize,
        d: usize,
        eps: f64,
    ) -> Result<()> {
        ops::rmsnorm_fwd(self.cuda, out, rstd, x, self.p(w), rows, d, eps)
    }

    fn rmsnorm_bwd(
        &mut self,
        dx: &mut DBuf<f32>,
        acc: Acc,
        dout: &DBuf<f32>,
        x: &DBuf<f32>,
        w: ParamId,
        rstd: &DBuf<f32>,
        rows: usize,
        d: usize,
    ) -> Result<()> {
        set(dx, acc)?;
        ops::rmsnorm_bwd(self.cuda, dx, self.g(w), dout, x, self.p(w), rstd, rows, d)
    }

    fn matmul_fwd(
        &mut self,
        out: &mut DBuf<f32>,
        x: &DBuf<f32>,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        ops::matmul_fwd(self.cuda, out, x, self.p(w), n, din, dout)
    }

    fn matmul_bwd(
        &mut self,
        dx: Option<(&mut DBuf<f32>, Acc)>,
        dy: &DBuf<f32>,
        x: &DBuf<f32>,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        let dx = match dx {
            Some((b, acc)) => {
                set(b, acc)?;
                Some(&*b)
            }
            None => None,
        };
        ops::matmul_bwd(self.cuda, dx, self.g(w), dy, x, self.p(w), n, din, dout)
    }

    fn rope_fwd(
        &mut self,
        x: &mut DBuf<f32>,
        pos: &DBuf<u32>,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()> {
        let (md, maxp) = (self.md, self.md.cfg.max_position_embeddings);
        ops::rope(
            self.cuda, true, x, pos, &md.cos, &md.sin, rows, heads, hd, maxp,
        )
    }

    fn rope_bwd(
        &mut self,
        dx: &mut DBuf<f32>,
        pos: &DBuf<u32>,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()> {
        let (md, maxp) = (self.md, self.md.cfg.max_position_embeddings);
        ops::rope(
            self.cuda, false, dx, pos, &md.cos, &md.sin, rows, heads, hd, maxp,
        )
    }

    fn attention_stats_len(&self, n: usize, heads: Heads) -> usize {
        // The log-sum-exps, then the backward's row sums D.
        2 * n * heads.h
    }

    fn attention_fwd(
        &mut self,
        out: &mut DBuf<f32>,
        stats: &mut DBuf<f32>,
        q: &DBuf<f32>,
        k: &DBuf<f32>,
        v: &DBuf<f32>,
        seqs: &DBuf<u32>,
        n: usize,
        _heads: Heads,
    ) -> Result<()> {
        ops::attention_fwd(self.cuda, out, stats, q, k, v, seqs, self.md.attn(n, n))
    }

    fn attention_bwd(
        &mut self,
        dq: &mut DBuf<f32>,
        dk: &mut DBuf<f32>,
        dv: &mut DBuf<f32>,
        stats: &mut DBuf<f32>,
        dout: &DBuf<f32>,
        q: &DBuf<f32>,
        k: &DBuf<f32>,
        v: &DBuf<f32>,
        out: &DBuf<f32>,
        seqs: &DBuf<u32>,
        n: usize,
        _heads: Heads,
    ) -> Result<()> {
        dq.clear()?;
        dk.clear()?;
        dv.clear()?;
        let s = self.md.attn(n, n);
        ops::attention_bwd(self.cuda, dq, dk, dv, stats, dout, out, q, k, v, seqs, s)
    }

    fn swiglu_fwd(
        &mut self,
        out: &mut DBuf<f32>,
        gate: &DBuf<f32>,
        up: &DBuf<f32>,
        len: usize,
    ) -> Result<()> {
        ops::swiglu_fwd(self.cuda, out, gate, up, len)
    }

    fn swiglu_bwd(
        &mut self,
        dgate: &mut DBuf<f32>,
        dup: &mut DBuf<f32>,
        dout: &DBuf<f32>,
        gate: &DBuf<f32>,
        up: &DBuf<f32>,
        len: usize,
    ) -> Result<()> {
        dgate.clear()?;
        dup.clear()?;
        ops::swiglu_bwd(self.cuda, dgate, dup, dout, gate, up, len)
    }

    fn residual_fwd(
        &mut self,
        out: &mut DBuf<f32>,
        a: &DBuf<f32>,
        b: &DBuf<f32>,
        len: usize,
    ) -> Result<()> {
        ops::residual_fwd(self.cuda, out, a, b, len)
    }

    fn logprob_fwd(
        &mut self,
        out: LogProbs<'_, DBuf<f32>>,
        logits: &DBuf<f32>,
        targets: &DBuf<u32>,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        // The whole vocabulary as one chunk.
        let state = self.cuda.alloc::<f32>(4 * m)?;
        ops::logprob_fwd_chunk(
            self.cuda,
            &state,
            logits,
            targets,
            m,
            v,
            0,
            true,
            temperature,
        )?;
        ops::logprob_fwd_finish(self.cuda, out.logp, out.entropy, out.lse, &state, m)
    }

    fn logprob_bwd(
        &mut self,
        dlogits: &mut DBuf<f32>,
        dlogp: &DBuf<f32>,
        logits: &DBuf<f32>,
        targets: &DBuf<u32>,
        lse: &DBuf<f32>,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        // The kernel turns logits into their gradient in place.
        dlogits.copy_from(0, logits, 0, m * v)?;
        ops::logprob_bwd_chunk(
            self.cuda,
            dlogits,
            None,
            dlogp,
            lse,
            targets,
            m,
            v,
            0,
            temperature,
        )
    }

    fn lm_head_logprob_fwd(
        &mut self,
        out: LogProbs<'_, DBuf<f32>>,
        x: &DBuf<f32>,
        w: ParamId,
        targets: &DBuf<u32>,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        for (i, (v0, len)) in self.chunks(m, v)?.into_iter().enumerate() {
            self.chunk_logits(x, w, m, d, v0, len)?;
            let s = self.scratch()?;
            let (st, z) = (&s.lp_state, &s.logits);
            ops::logprob_fwd_chunk(self.cuda, st, z, targets, m, len, v0, i == 0, temperature)?;
        }
        let st = &self.scratch()?.lp_state;
        ops::logprob_fwd_finish(self.cuda, out.logp, out.entropy, out.lse, st, m)
    }

    fn lm_head_logprob_bwd(
        &mut self,
        dx: &mut DBuf<f32>,
        dlogp: &DBuf<f32>,
        x: &DBuf<f32>,
        w: ParamId,
        targets: &DBuf<u32>,
        lse: &DBuf<f32>,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        // Per chunk: recompute the logits, turn them into dlogits in place, apply.
        dx.clear()?;
        let (wb, dw) = (self.p(w), self.g(w));
        for (v0, len) in self.chunks(m, v)? {
            self.chunk_logits(x, w, m, d, v0, len)?;
            let z = &self.scratch()?.logits;
            let cu = self.cuda;
            ops::logprob_bwd_chunk(cu, z, None, dlogp, lse, targets, m, len, v0, temperature)?;
            ops::gemm_f32(
                cu,
                (dx, 0),
                (z, 0),
                (wb, v0 * d),
                GemmF32::bwd_dx(m, d, len),
            )?;
            ops::gemm_f32(cu, (dw, v0 * d), (z, 0), (x, 0), GemmF32::bwd_dw(m, d, len))?;
        }
        Ok(())
    }

    fn lm_head_logits(
        &mut self,
        x: &DBuf<f32>,
        w: ParamId,
        m: usize,
        d: usize,
        v: usize,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; m * v];
        for (v0, len) in self.chunks(m, v)? {
            self.chunk_logits(x, w, m, d, v0, len)?;
            let part = self.scratch()?.logits.read(0, m * len)?;
            for r in 0..m {
                out[r * v + v0..r * v + v0 + len].copy_from_slice(&part[r * len..(r + 1) * len]);
            }
        }
        Ok(out)
    }

    fn loss_fwd(
        &mut self,
        logp: &DBuf<f32>,
        entropy: &DBuf<f32>,
        x: &LossBufs<DBuf<f32>, DBuf<u32>>,
        m: usize,
        loss: Loss,
    ) -> Result<LossSums> {
        let stats = &self.scratch()?.loss_stats;
        ops::grpo_loss_fwd(self.cuda, stats, kernel_loss(logp, x), entropy, m, loss)?;
        Ok(LossSums::from_kernel(&stats.read(0, 4)?))
    }

    fn loss_bwd(
        &mut self,
        dlogp: &mut DBuf<f32>,
        logp: &DBuf<f32>,
        x: &LossBufs<DBuf<f32>, DBuf<u32>>,
        m: usize,
        loss: Loss,
    ) -> Result<()> {
        ops::grpo_loss_bwd(self.cuda, dlogp, kernel_loss(logp, x), m, loss)
    }
}

/// The loss kernels' operands.
fn kernel_loss<'b>(logp: &'b DBuf<f32>, x: &'b LossBufs<DBuf<f32>, DBuf<u32>>) -> KernelLoss<'b> {
    KernelLoss {
        logp,
        old: &x.old,
        refp: &x.refp,
        adv: &x.adv,
        w: &x.wts,
        flags: &x.flags,
    }
}
