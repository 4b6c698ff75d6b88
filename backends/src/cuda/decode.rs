//! Generation on a CUDA device: the one engine's decode steps (`model::decode`) launched on
//! the context's stream, over a KV cache of fixed-size slots (the engine's
//! [`Slots`](crate::engine::Slots) store), with sampling on the device.
//!
//! The attention kernel reads a row's keys as one contiguous run of the cache (`qmeta` =
//! slot base, position), so each request's new keys and values are copied into its slot
//! before the layer's attention. `submit_step` runs the step; `poll_step` returns it.

use std::sync::Arc;

use super::device::{Cuda, DBuf};
use super::model::DeviceModel;
use super::model_ops::{CudaOps, Scratch};
use super::ops;
use super::plan;
use crate::engine::{Decoder, Sampled, StepPlan};
use crate::error::{BackendError, Result};
use crate::model::decode::{Decode, StepBufs, decode};
use crate::model::ops::{Heads, Ops};

/// Every layer's keys and values, `[pages · page_rows, kv_dim]`.
#[derive(Debug, Default)]
pub struct CudaKv {
    k: Vec<DBuf<f32>>,
    v: Vec<DBuf<f32>>,
    pages: usize,
    page_rows: usize,
}

impl CudaKv {
    /// Re-lays the cache out as `pages` slots of `page_rows` rows, copying every old slot
    /// whole to its new place; a no-op when the geometry is unchanged.
    fn fit(
        &mut self,
        cu: &Arc<Cuda>,
        layers: usize,
        kd: usize,
        pages: usize,
        page_rows: usize,
    ) -> Result<()> {
        if (pages, page_rows) == (self.pages, self.page_rows) {
            return Ok(());
        }
        let len = pages * page_rows * kd;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(cu.alloc::<f32>(len)?);
            v.push(cu.alloc::<f32>(len)?);
        }
        let rows = self.page_rows * kd;
        for p in 0..self.pages {
            let (src, dst) = (p * rows, p * page_rows * kd);
            for l in 0..self.k.len() {
                k[l].copy_from(dst, &self.k[l], src, rows)?;
                v[l].copy_from(dst, &self.v[l], src, rows)?;
            }
        }
        (self.k, self.v, self.pages, self.page_rows) = (k, v, pages, page_rows);
        Ok(())
    }
}

/// A step's rows as the KV kernels read them: `(slot base, position)` per row, the
/// attention statistics scratch, each request's rows `(start, len, first cache row)`, and
/// the cache's rows.
#[derive(Debug)]
pub struct CudaRows {
    qmeta: DBuf<u32>,
    stats: DBuf<f32>,
    chunks: Vec<(usize, usize, usize)>,
    n_k: usize,
}

#[allow(clippy::too_many_arguments)]
impl Decode for CudaOps<'_> {
    type Kv = CudaKv;
    type Rows = CudaRows;
    type Sample = DBuf<f32>;

    fn kv_append(
        &mut self,
        kv: &mut CudaKv,
        layer: usize,
        k: &DBuf<f32>,
        v: &DBuf<f32>,
        rows: &CudaRows,
        _n: usize,
    ) -> Result<()> {
        let kd = self.model().cfg.kv_dim();
        for &(start, len, dst) in &rows.chunks {
            kv.k[layer].copy_from(dst * kd, k, start * kd, len * kd)?;
            kv.v[layer].copy_from(dst * kd, v, start * kd, len * kd)?;
        }
        Ok(())
    }

    fn attention_decode(
        &mut self,
        out: &mut DBuf<f32>,
        q: &DBuf<f32>,
        kv: &CudaKv,
        layer: usize,
        rows: &mut CudaRows,
        n: usize,
        _heads: Heads,
    ) -> Result<()> {
        let (cu, s) = (self.cuda(), self.model().attn(n, rows.n_k));
        let (k, v) = (&kv.k[layer], &kv.v[layer]);
        ops::attention_fwd(cu, out, &rows.stats, q, k, v, &rows.qmeta, s)
    }

    fn sample(
        &mut self,
        tokens: &mut DBuf<u32>,
        logp: &mut DBuf<f32>,
        logits: &DBuf<f32>,
        rows: &DBuf<f32>,
        r: usize,
        v: usize,
    ) -> Result<()> {
        ops::sample(self.cuda(), tokens, logp, logits, rows, r, v)
    }
}

/// The step buffers of this backend.
type CudaBufs = StepBufs<DBuf<f32>, DBuf<u32>>;

/// The decoder's buffers: the KV cache and the step buffers (reallocated only when a step
/// needs more rows or requests).
#[derive(Debug, Default)]
pub struct CudaStep {
    kv: CudaKv,
    /// The step buffers, rows and sampling rows.
    bufs: Option<(CudaBufs, CudaRows, DBuf<f32>)>,
}

/// The CUDA backend's [`Decoder`]: runs each step when it is submitted.
pub struct CudaDecoder<'a> {
    /// The context.
    pub cuda: &'a Arc<Cuda>,
    /// The weights.
    pub md: &'a DeviceModel,
    /// The cache and step buffers.
    pub step: &'a mut CudaStep,
    /// The ops' scratch.
    pub scratch: &'a mut Option<Scratch>,
}

impl CudaDecoder<'_> {
    /// Makes the step buffers fit `n` rows and `r` requests.
    fn fit(&mut self, n: usize, r: usize) -> Result<()> {
        if (self.step.bufs.as_ref()).is_some_and(|(b, _, _)| b.cap_n >= n && b.cap_r >= r) {
            return Ok(());
        }
        let (cap_n, cap_r) = (plan::capacity(n, 64), plan::capacity(r, 16));
        self.step.bufs = None;
        let c = &self.md.cfg;
        let mut o = CudaOps::new(self.cuda, self.md, self.scratch);
        let s = StepBufs::new(&mut o, c, cap_n, cap_r)?;
        let rows = CudaRows {
            qmeta: self.cuda.alloc(2 * cap_n)?,
            stats: self.cuda.alloc(2 * cap_n * c.num_attention_heads)?,
            chunks: Vec::new(),
            n_k: 0,
        };
        let rowp = self.cuda.alloc(4 * cap_r)?;
        self.step.bufs = Some((s, rows, rowp));
        Ok(())
    }
}

impl Decoder for CudaDecoder<'_> {
    type Run = Sampled;

    fn launch(&mut self, plan: &StepPlan, _front: Option<&Sampled>) -> Result<Sampled> {
        let c = &self.md.cfg;
        let (kd, layers) = (c.kv_dim(), c.num_hidden_layers);
        let (pages, pr) = (plan.kv_pages, plan.page_rows);
        self.step.kv.fit(self.cuda, layers, kd, pages, pr)?;
        let (n, r) = (plan.n(), plan.r());
        self.fit(n, r)?;
        let Some((s, rows, rowp)) = self.step.bufs.as_mut() else {
            return Err(BackendError::Device("decode buffers missing".into()));
        };
        // Each row's slot base (a request's table is its one slot) and position.
        let mut qmeta = Vec::with_capacity(2 * n);
        rows.chunks.clear();
        for t in 0..n {
            let base = plan.pages[plan.meta[2 * t] as usize] as usize * pr;
            let pos = plan.meta[2 * t + 1];
            qmeta.extend([base as u32, pos]);
            match rows.chunks.last_mut() {
                Some((start, len, dst))
                    if *start + *len == t && *dst + *len == base + pos as usize =>
                {
                    *len += 1
                }
                _ => rows.chunks.push((t, 1, base + pos as usize)),
            }
        }
        rows.n_k = pages * pr;
        rows.qmeta.write(0, &qmeta)?;
        let packed: Vec<f32> = plan.sample.iter().flat_map(|x| x.packed()).collect();
        rowp.write(0, &packed)?;
        let mut o = CudaOps::new(self.cuda, self.md, self.scratch);
        o.write_idx(&mut s.ids, &plan.ids, None)?;
        o.write_idx(&mut s.pos, &plan.pos, None)?;
        o.write_idx(&mut s.last, &plan.last, None)?;
        let ids = &self.md.layout.ids;
        decode(&mut o, c, ids, s, &mut self.step.kv, rows, &*rowp, n, r)?;
        Ok(Sampled {
            tokens: s.tokens.read(0, r)?,
            logp: s.logp.read(0, r)?,
        })
    }

    fn poll(&mut self, run: &mut Sampled, _wait: bool) -> Result<Option<Sampled>> {
        Ok(Some(std::mem::take(run)))
    }
}
