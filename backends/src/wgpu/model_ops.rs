//! The wgpu device as the model's [`Ops`]: every op records its WGSL launches into the call's
//! [`Exec`] (nothing runs until a result is read back), over a [`DeviceModel`]'s parameter and
//! gradient buffers.
//!
//! Buffers are allocated for a power-of-two capacity of rows, so a call binds the buffers the
//! previous one did and reuses every cached bind group. Index buffers that a backward
//! scatters into carry their positions grouped by row ([`ScatterIndex`]), built on the host
//! when they are written, which is what makes `embedding_bwd` add in the CPU reference's
//! order. The lm_head runs chunked ([`LmHead`]); attention saves log-sum-exps and recomputes
//! the probabilities, writing `dk` and `dv` through one buffer (the backward kernel's binding
//! count) that they are copied out of.

use wgpu::Buffer;

use super::gpu::{Exec, Gpu};
use super::lm_head::{LmHead, LmPlan};
use super::model::DeviceModel;
use super::ops::{self, LogprobBufs, ScatterIndex, VocabChunk};
use crate::error::{BackendError, Result};
use crate::model::ops::{Acc, Heads, LogProbs, LossBufs, Ops};
use crate::model::{Loss, LossSums, ParamId};

/// An index buffer, with the positions of a scatter into it grouped by row when it has one.
#[derive(Debug)]
pub struct Idx {
    /// The indices.
    pub buf: Buffer,
    scatter: Option<Scatter>,
    cap: usize,
}

/// A [`ScatterIndex`] on the device.
#[derive(Debug)]
struct Scatter {
    starts: Buffer,
    pairs: Buffer,
    touched: usize,
}

/// Each packed row's attention window: `(start, pos)` for the forward, `(start, len)` for the
/// backward.
#[derive(Debug)]
pub struct Seqs {
    qmeta: Buffer,
    rowmeta: Buffer,
}

/// Scratch of the ops that the activations do not hold, sized with them.
#[derive(Debug)]
pub struct Scratch {
    cap_m: usize,
    /// Partial column sums of `rmsnorm_bwd`'s `dw`.
    dw_part: Buffer,
    /// `[dk, dv]` of the attention backward.
    dkv: Buffer,
    lm: LmPlan,
    lm_scratch: Buffer,
    /// The fused lm_head's running log-sum-exp state, `[rows, 4]`.
    lm_state: Buffer,
    loss_stats: Buffer,
}

impl Scratch {
    fn new(gpu: &Gpu, md: &DeviceModel, cap_n: usize, cap_m: usize, lm: LmPlan) -> Self {
        let c = &md.cfg;
        let (n, d, hd) = (cap_n, c.hidden_size, c.head_dim);
        let (h, kvh) = (c.num_attention_heads, c.num_key_value_heads);
        let dw = ops::rmsnorm_dw_scratch(n, d)
            .max(ops::rmsnorm_dw_scratch(n * h, hd))
            .max(ops::rmsnorm_dw_scratch(n * kvh, hd));
        Self {
            cap_m,
            dw_part: gpu.buffer("rmsnorm dw partials", dw),
            dkv: gpu.buffer("dkv", 2 * n * c.kv_dim()),
            lm,
            lm_scratch: gpu.buffer("lm_head chunk", lm.scratch_len(cap_m)),
            lm_state: gpu.buffer("lm_head state", 4 * cap_m),
            loss_stats: gpu.buffer("loss stats", 4),
        }
    }
}

/// The wgpu backend's [`Ops`] over one model.
pub struct WgpuOps<'a> {
    ex: &'a mut Exec,
    md: &'a DeviceModel,
    scratch: &'a mut Option<Scratch>,
}

impl<'a> WgpuOps<'a> {
    /// Ops recording into `ex` over `md`'s buffers, with `scratch` kept by the caller.
    pub fn new(ex: &'a mut Exec, md: &'a DeviceModel, scratch: &'a mut Option<Scratch>) -> Self {
        Self { ex, md, scratch }
    }

    /// The model the ops read.
    pub fn model(&self) -> &'a DeviceModel {
        self.md
    }

    /// The recorder the ops record into.
    pub fn exec(&mut self) -> &mut Exec {
        self.ex
    }

    fn scratch(&mut self) -> Result<&mut Scratch> {
        let s = self
            .scratch
            .as_mut()
            .ok_or_else(|| BackendError::Device("op scratch missing".into()))?;
        // A changed binding limit (`WgpuBackend::cap_storage_binding`) changes the lm_head plan.
        let lm = LmPlan::new(self.ex.binding_limit());
        if s.lm != lm {
            s.lm = lm;
            s.lm_scratch = self
                .ex
                .gpu()
                .buffer("lm_head chunk", lm.scratch_len(s.cap_m));
            self.ex.forget_bind_groups();
        }
        Ok(s)
    }

    fn p(&self, id: ParamId) -> &'a Buffer {
        &self.md.params[id.0]
    }

    fn g(&self, id: ParamId) -> &'a Buffer {
        &self.md.grads[id.0]
    }

    fn rows_of(&self, id: ParamId, d: usize) -> usize {
        self.md.layout.entry(id).len / d.max(1)
    }

    /// The fused lm_head over weight `w`, with the scratch's chunk buffer and state.
    fn lm_head(&mut self, w: ParamId, d: usize, v: usize) -> Result<(LmHead<'a>, Buffer, Buffer)> {
        let (wb, format) = (self.p(w), self.md.weights);
        let s = self.scratch()?;
        let (scratch, state, plan) = (s.lm_scratch.clone(), s.lm_state.clone(), s.lm);
        Ok((
            LmHead {
                w: wb,
                format,
                plan,
                d,
                v,
            },
            scratch,
            state,
        ))
    }
}

/// `true` where `acc` adds (the kernels' `accumulate` flag).
fn adds(acc: Acc) -> bool {
    acc == Acc::Add
}

#[allow(clippy::too_many_arguments)]
impl Ops for WgpuOps<'_> {
    type Buf = Buffer;
    type Idx = Idx;
    type Seqs = Seqs;

    fn buf(&mut self, len: usize) -> Result<Buffer> {
        Ok(self.ex.gpu().buffer("activation", len))
    }

    fn idx(&mut self, len: usize) -> Result<Idx> {
        Ok(Idx {
            buf: self.ex.gpu().buffer("indices", len),
            scatter: None,
            cap: len,
        })
    }

    fn seqs(&mut self, n: usize) -> Result<Seqs> {
        let gpu = self.ex.gpu();
        Ok(Seqs {
            qmeta: gpu.buffer("qmeta", 2 * n),
            rowmeta: gpu.buffer("rowmeta", 2 * n),
        })
    }

    fn capacity(&self, n: usize) -> usize {
        n.next_power_of_two().max(64)
    }

    fn replaced(&mut self, cap_n: usize, cap_m: usize) -> Result<()> {
        // The old buffers' bind groups go with them.
        self.ex.forget_bind_groups();
        let lm = LmPlan::new(self.ex.binding_limit());
        *self.scratch = None;
        *self.scratch = Some(Scratch::new(self.ex.gpu(), self.md, cap_n, cap_m, lm));
        Ok(())
    }

    fn write_buf(&mut self, dst: &mut Buffer, src: &[f32]) -> Result<()> {
        self.ex.gpu().write(dst, src);
        Ok(())
    }

    fn write_idx(&mut self, dst: &mut Idx, src: &[u32], scatter: Option<usize>) -> Result<()> {
        let gpu = std::sync::Arc::clone(self.ex.gpu());
        gpu.write(&dst.buf, src);
        if let Some(rows) = scatter {
            let ix = ScatterIndex::new(src, rows);
            let cap = dst.cap;
            let s = dst.scatter.get_or_insert_with(|| Scatter {
                starts: gpu.buffer("scatter starts", ScatterIndex::starts_len(cap)),
                pairs: gpu.buffer("scatter pairs", ScatterIndex::pairs_len(cap)),
                touched: 0,
            });
            gpu.write(&s.starts, &ix.starts);
            gpu.write(&s.pairs, &ix.pairs);
            s.touched = ix.touched();
        }
        Ok(())
    }

    fn write_seqs(&mut self, dst: &mut Seqs, seqs: &[std::ops::Range<usize>]) -> Result<()> {
        let (mut q, mut r) = (Vec::new(), Vec::new());
        for s in seqs {
            for t in 0..s.len() {
                q.extend([s.start as u32, t as u32]);
                r.extend([s.start as u32, s.len() as u32]);
            }
        }
        let gpu = self.ex.gpu();
        gpu.write(&dst.qmeta, &q);
        gpu.write(&dst.rowmeta, &r);
        Ok(())
    }

    fn read(&mut self, src: &Buffer, len: usize) -> Result<Vec<f32>> {
        let t = self.ex.read_back(src, 0, len * 4);
        Ok(self.ex.submit()?.get::<f32>(t))
    }

    fn embedding_fwd(
        &mut self,
        out: &mut Buffer,
        ids: &Idx,
        table: ParamId,
        n: usize,
        d: usize,
    ) -> Result<()> {
        let vocab = self.rows_of(table, d);
        let (t, f) = (self.p(table), self.md.weights);
        ops::embedding_fwd_as(self.ex, out, &ids.buf, t, f, n, d, vocab);
        Ok(())
    }

    fn embedding_bwd(
        &mut self,
        table: ParamId,
        dout: &Buffer,
        ids: &Idx,
        _n: usize,
        d: usize,
    ) -> Result<()> {
        let s = scatter_of(ids)?;
        let vocab = self.rows_of(table, d);
        let dt = self.g(table);
        ops::embedding_bwd(self.ex, dt, dout, &s.starts, &s.pairs, s.touched, d, vocab);
        Ok(())
    }

    fn gather_rows(
        &mut self,
        out: &mut Buffer,
        x: &Buffer,
        rows: &Idx,
        m: usize,
        n: usize,
        d: usize,
    ) -> Result<()> {
        // A row gather is the embedding kernel with `x` as the table.
        ops::embedding_fwd(self.ex, out, &rows.buf, x, m, d, n);
        Ok(())
    }

    fn scatter_rows(
        &mut self,
        dx: &mut Buffer,
        dout: &Buffer,
        rows: &Idx,
        _m: usize,
        n: usize,
        d: usize,
    ) -> Result<()> {
        let s = scatter_of(rows)?;
        self.ex.clear(dx);
        ops::embedding_bwd(self.ex, dx, dout, &s.starts, &s.pairs, s.touched, d, n);
        Ok(())
    }

    fn rmsnorm_fwd(
        &mut self,
        out: &mut Buffer,
        rstd: &mut Buffer,
        x: &Buffer,
        w: ParamId,
        rows: usize,
        d: usize,
        eps: f64,
    ) -> Result<()> {
        ops::rmsnorm_fwd(self.ex, out, rstd, x, self.p(w), rows, d, eps);
        Ok(())
    }

    fn rmsnorm_bwd(
        &mut self,
        dx: &mut Buffer,
        acc: Acc,
        dout: &Buffer,
        x: &Buffer,
        w: ParamId,
        rstd: &Buffer,
        rows: usize,
        d: usize,
    ) -> Result<()> {
        let (wb, gb) = (self.p(w), self.g(w));
        let part = self.scratch()?.dw_part.clone();
        ops::rmsnorm_bwd(
            self.ex,
            dx,
            gb,
            &part,
            dout,
            x,
            wb,
            rstd,
            rows,
            d,
            adds(acc),
        );
        Ok(())
    }

    fn matmul_fwd(
        &mut self,
        out: &mut Buffer,
        x: &Buffer,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        let (wb, f) = (self.p(w), self.md.weights);
        ops::matmul_fwd_as(self.ex, out, x, wb, f, n, din, dout, false);
        Ok(())
    }

    fn matmul_bwd(
        &mut self,
        dx: Option<(&mut Buffer, Acc)>,
        dy: &Buffer,
        x: &Buffer,
        w: ParamId,
        n: usize,
        din: usize,
        dout: usize,
    ) -> Result<()> {
        let dx = dx.map(|(b, acc)| (&*b, adds(acc)));
        let (wb, gb) = (self.p(w), self.g(w));
        ops::matmul_bwd(self.ex, dx, gb, dy, x, wb, n, din, dout);
        Ok(())
    }

    fn rope_fwd(
        &mut self,
        x: &mut Buffer,
        pos: &Idx,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()> {
        let (md, maxp) = (self.md, self.md.cfg.max_position_embeddings);
        ops::rope_fwd(
            self.ex, x, &pos.buf, &md.cos, &md.sin, rows, heads, hd, maxp,
        );
        Ok(())
    }

    fn rope_bwd(
        &mut self,
        dx: &mut Buffer,
        pos: &Idx,
        rows: usize,
        heads: usize,
        hd: usize,
    ) -> Result<()> {
        let (md, maxp) = (self.md, self.md.cfg.max_position_embeddings);
        ops::rope_bwd(
            self.ex, dx, &pos.buf, &md.cos, &md.sin, rows, heads, hd, maxp,
        );
        Ok(())
    }

    fn attention_stats_len(&self, n: usize, heads: Heads) -> usize {
        // The log-sum-exps, then the backward's row sums (or a split forward's state).
        2 * n * heads.h
    }

    fn attention_fwd(
        &mut self,
        out: &mut Buffer,
        stats: &mut Buffer,
        q: &Buffer,
        k: &Buffer,
        v: &Buffer,
        seqs: &Seqs,
        n: usize,
        hs: Heads,
    ) -> Result<()> {
        let Heads { h, kvh, hd } = hs;
        ops::attention_fwd(self.ex, out, stats, q, k, v, &seqs.qmeta, n, n, h, kvh, hd);
        Ok(())
    }

    fn attention_bwd(
        &mut self,
        dq: &mut Buffer,
        dk: &mut Buffer,
        dv: &mut Buffer,
        stats: &mut Buffer,
        dout: &Buffer,
        q: &Buffer,
        k: &Buffer,
        v: &Buffer,
        out: &Buffer,
        seqs: &Seqs,
        n: usize,
        hs: Heads,
    ) -> Result<()> {
        let Heads { h, kvh, hd } = hs;
        let dkv = self.scratch()?.dkv.clone();
        let rm = &seqs.rowmeta;
        ops::attention_bwd(
            self.ex, dq, &dkv, stats, dout, q, k, v, out, rm, n, h, kvh, hd,
        );
        let bytes = (n * kvh * hd * 4) as u64;
        self.ex.copy(&dkv, 0, dk, 0, bytes);
        self.ex.copy(&dkv, bytes, dv, 0, bytes);
        Ok(())
    }

    fn swiglu_fwd(
        &mut self,
        out: &mut Buffer,
        gate: &Buffer,
        up: &Buffer,
        len: usize,
    ) -> Result<()> {
        ops::swiglu_fwd(self.ex, out, gate, up, len);
        Ok(())
    }

    fn swiglu_bwd(
        &mut self,
        dgate: &mut Buffer,
        dup: &mut Buffer,
        dout: &Buffer,
        gate: &Buffer,
        up: &Buffer,
        len: usize,
    ) -> Result<()> {
        ops::swiglu_bwd(self.ex, dgate, dup, dout, gate, up, len);
        Ok(())
    }

    fn residual_fwd(&mut self, out: &mut Buffer, a: &Buffer, b: &Buffer, len: usize) -> Result<()> {
        ops::residual_fwd(self.ex, out, a, b, len);
        Ok(())
    }

    fn logprob_fwd(
        &mut self,
        out: LogProbs<'_, Buffer>,
        logits: &Buffer,
        targets: &Idx,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        // The whole vocabulary as one chunk.
        let state = self.ex.gpu().buffer("logprob state", 4 * m);
        let bufs = LogprobBufs {
            state: &state,
            logp: out.logp,
            entropy: out.entropy,
            lse: out.lse,
        };
        let c = VocabChunk {
            row0: 0,
            rows: m,
            v0: 0,
            cols: v,
        };
        ops::logprob_fwd(self.ex, bufs, logits, &targets.buf, c, true, temperature);
        ops::logprob_fwd_finish(self.ex, bufs, 0, m);
        Ok(())
    }

    fn logprob_bwd(
        &mut self,
        dlogits: &mut Buffer,
        dlogp: &Buffer,
        logits: &Buffer,
        targets: &Idx,
        lse: &Buffer,
        m: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        // The kernel turns logits into their gradient in place.
        self.ex.copy(logits, 0, dlogits, 0, (m * v * 4) as u64);
        let c = VocabChunk {
            row0: 0,
            rows: m,
            v0: 0,
            cols: v,
        };
        ops::logprob_bwd(self.ex, dlogits, dlogp, lse, &targets.buf, c, temperature);
        Ok(())
    }

    fn lm_head_logprob_fwd(
        &mut self,
        out: LogProbs<'_, Buffer>,
        x: &Buffer,
        w: ParamId,
        targets: &Idx,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        let (head, scratch, state) = self.lm_head(w, d, v)?;
        let bufs = LogprobBufs {
            state: &state,
            logp: out.logp,
            entropy: out.entropy,
            lse: out.lse,
        };
        head.logprob_fwd(self.ex, &scratch, bufs, x, &targets.buf, m, temperature);
        Ok(())
    }

    fn lm_head_logprob_bwd(
        &mut self,
        dx: &mut Buffer,
        dlogp: &Buffer,
        x: &Buffer,
        w: ParamId,
        targets: &Idx,
        lse: &Buffer,
        m: usize,
        d: usize,
        v: usize,
        temperature: f64,
    ) -> Result<()> {
        let (head, scratch, _) = self.lm_head(w, d, v)?;
        let dw = self.g(w);
        let t = &targets.buf;
        head.logprob_bwd(self.ex, &scratch, dx, dw, dlogp, lse, x, t, m, temperature);
        Ok(())
    }

    fn lm_head_logits(
        &mut self,
        x: &Buffer,
        w: ParamId,
        m: usize,
        d: usize,
        v: usize,
    ) -> Result<Vec<f32>> {
        let (head, scratch, _) = self.lm_head(w, d, v)?;
        head.read_logits(self.ex, &scratch, x, m)
    }

    fn loss_fwd(
        &mut self,
        logp: &Buffer,
        entropy: &Buffer,
        x: &LossBufs<Buffer, Idx>,
        m: usize,
        loss: Loss,
    ) -> Result<LossSums> {
        let stats = self.scratch()?.loss_stats.clone();
        let (f, ex) = (&x.flags.buf, &mut *self.ex);
        ops::grpo_loss_fwd(
            ex, &stats, logp, &x.old, &x.refp, &x.adv, &x.wts, entropy, f, m, loss,
        );
        let t = ex.read_back(&stats, 0, 16);
        Ok(LossSums::from_kernel(&ex.submit()?.get::<f32>(t)))
    }

    fn loss_bwd(
        &mut self,
        dlogp: &mut Buffer,
        logp: &Buffer,
        x: &LossBufs<Buffer, Idx>,
        m: usize,
        loss: Loss,
    ) -> Result<()> {
        let f = &x.flags.buf;
        ops::grpo_loss_bwd(
            self.ex, dlogp, logp, &x.old, &x.refp, &x.adv, &x.wts, f, m, loss,
        );
        Ok(())
    }
}

/// The scatter index written with `ix` ([`Ops::write_idx`] with a row count).
fn scatter_of(ix: &Idx) -> Result<&Scatter> {
    ix.scatter
        .as_ref()
        .ok_or_else(|| BackendError::Device("a scatter without its index".into()))
}
