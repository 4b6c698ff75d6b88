//! Generation on the device: the one engine's decode steps (`model::decode`) recorded into
//! one submission each and submitted without blocking ([`WgpuDecoder`]), over the paged KV
//! pool ([`KvPool`]), with sampling on the device.
//!
//! Only the sampled tokens and their log-probs come back (8 bytes per request). A look-ahead
//! step is queued behind the one before it: its input tokens are copied on the device from
//! that step's sampler output ([`feed_tokens`]), so the host never waits between steps.

use std::sync::Arc;

use wgpu::Buffer;

use super::gpu::{Exec, Gpu, Ticket};
use super::inflight::InFlight;
use super::kv::{KvPool, StepRows};
use super::model::DeviceModel;
use super::model_ops::{Idx, Scratch, WgpuOps};
use super::ops;
use crate::engine::{Decoder, Sampled, StepPlan};
use crate::error::{BackendError, Result};
use crate::model::decode::{Decode, StepBufs, decode};
use crate::model::ops::Heads;

/// A step's rows as the KV kernels bind them: per-row metadata and page tables, the decode
/// attention's state, and the step's query and output buffers (the KV-append binds the same
/// set as the attention, so the two share one bind group).
#[derive(Debug)]
pub struct WgpuRows {
    cap_n: usize,
    cap_p: usize,
    meta: Buffer,
    pages: Buffer,
    /// Decode attention's running max and sum per (row, head) between split launches.
    state: Buffer,
    q: Buffer,
    out: Buffer,
    k: Buffer,
    v: Buffer,
    pages_len: usize,
    max_pos: usize,
}

#[allow(clippy::too_many_arguments)]
impl Decode for WgpuOps<'_> {
    type Kv = KvPool;
    type Rows = WgpuRows;
    type Sample = Buffer;

    fn kv_append(
        &mut self,
        kv: &mut KvPool,
        layer: usize,
        _k: &Buffer,
        _v: &Buffer,
        rows: &WgpuRows,
        n: usize,
    ) -> Result<()> {
        // `rows` binds the step's own k and v buffers (see `WgpuRows`).
        let c = &self.model().cfg;
        step_rows(rows, n).kv_append(self.exec(), kv, layer, c)
    }

    fn attention_decode(
        &mut self,
        _out: &mut Buffer,
        _q: &Buffer,
        kv: &KvPool,
        layer: usize,
        rows: &mut WgpuRows,
        n: usize,
        _heads: Heads,
    ) -> Result<()> {
        // `rows` binds the step's own q and output buffers (see `WgpuRows`).
        let c = &self.model().cfg;
        step_rows(rows, n).attention_decode(self.exec(), kv, layer, c)
    }

    fn sample(
        &mut self,
        tokens: &mut Idx,
        logp: &mut Buffer,
        logits: &Buffer,
        rows: &Buffer,
        r: usize,
        v: usize,
    ) -> Result<()> {
        ops::sample(self.exec(), &tokens.buf, logp, logits, rows, r, v);
        Ok(())
    }
}

/// The kernels' view of a step's `n` rows.
fn step_rows(rows: &WgpuRows, n: usize) -> StepRows<'_> {
    StepRows {
        q: &rows.q,
        out: &rows.out,
        state: &rows.state,
        k: &rows.k,
        v: &rows.v,
        meta: &rows.meta,
        pages: &rows.pages,
        n,
        pages_len: rows.pages_len,
        max_pos: rows.max_pos,
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

/// The decoder's buffers: the KV pool and the step buffers (reallocated only when a step
/// needs more rows, requests or page-table entries).
#[derive(Debug, Default)]
pub struct WgpuStep {
    pool: KvPool,
    bufs: Option<(StepBufs<Buffer, Idx>, WgpuRows, Buffer)>,
    /// Most pages the pool may grow to.
    pub max_pages: usize,
}

impl WgpuStep {
    /// Buffers for a pool of at most `max_pages` pages, allocated as steps need them.
    pub fn new(max_pages: usize) -> Self {
        Self {
            max_pages,
            ..Self::default()
        }
    }
}

/// A submitted step: where its tokens come back, and the buffer its sampler writes them to,
/// which a look-ahead step behind it reads its input tokens from (kept here so that a
/// reallocation of the step buffers cannot drop it first).
#[derive(Debug)]
pub struct WgpuRun {
    run: InFlight,
    sampled: Buffer,
    tokens: Ticket,
    logp: Ticket,
}

/// The wgpu backend's [`Decoder`].
pub struct WgpuDecoder<'a> {
    /// The device.
    pub gpu: &'a Arc<Gpu>,
    /// The recorder.
    pub ex: &'a mut Exec,
    /// The weights.
    pub md: &'a DeviceModel,
    /// The pool and step buffers.
    pub step: &'a mut WgpuStep,
    /// The ops' scratch.
    pub scratch: &'a mut Option<Scratch>,
}

impl WgpuDecoder<'_> {
    /// Makes the step buffers fit `plan` (capacities to the next power of two).
    fn fit(&mut self, plan: &StepPlan) -> Result<()> {
        let (n, r, np) = (plan.n(), plan.r(), plan.pages.len());
        let fits = self.step.bufs.as_ref().is_some_and(|(b, rows, _)| {
            b.cap_n >= n && b.cap_r >= r && rows.cap_p >= np && rows.cap_n >= n
        });
        if fits {
            return Ok(());
        }
        // Steps in flight keep the old buffers alive; the front's sampled tokens are read
        // from its own buffer.
        let cap_n = n.next_power_of_two().max(64);
        let cap_r = r.next_power_of_two().max(16);
        let cap_p = np.next_power_of_two().max(64);
        self.step.bufs = None;
        self.ex.forget_bind_groups();
        let c = &self.md.cfg;
        let mut o = WgpuOps::new(self.ex, self.md, self.scratch);
        let s = StepBufs::new(&mut o, c, cap_n, cap_r)?;
        let b = |name: &str, len: usize| self.gpu.buffer(&format!("decode {name}"), len);
        let rows = WgpuRows {
            cap_n,
            cap_p,
            meta: b("row meta", 2 * cap_n),
            pages: b("page tables", cap_p),
            state: b("attention state", 2 * cap_n * c.num_attention_heads),
            q: s.q.clone(),
            out: s.att_out.clone(),
            k: s.k.clone(),
            v: s.v.clone(),
            pages_len: 0,
            max_pos: 0,
        };
        let rowp = b("sampling rows", 4 * cap_r);
        self.step.bufs = Some((s, rows, rowp));
        Ok(())
    }
}

impl Decoder for WgpuDecoder<'_> {
    type Run = WgpuRun;

    fn queues(&self) -> bool {
        true
    }

    fn launch(&mut self, plan: &StepPlan, front: Option<&WgpuRun>) -> Result<WgpuRun> {
        let c = &self.md.cfg;
        // A pool growth copies the old pages after the steps already queued have run.
        let (kv, max) = (plan.kv_pages, self.step.max_pages);
        if self.step.pool.ensure_built(self.gpu, self.ex, c, kv, max) {
            self.ex.forget_bind_groups();
        }
        self.fit(plan)?;
        let (n, r) = (plan.n(), plan.r());
        let Some((s, rows, rowp)) = self.step.bufs.as_mut() else {
            return Err(BackendError::Device("decode buffers missing".into()));
        };
        // Queue writes land after the steps already submitted have read these buffers.
        let gpu = self.gpu;
        gpu.write(&s.ids.buf, &plan.ids);
        gpu.write(&s.pos.buf, &plan.pos);
        gpu.write(&s.last.buf, &plan.last);
        gpu.write(&rows.meta, &plan.meta);
        gpu.write(&rows.pages, &plan.pages);
        let packed: Vec<[f32; 4]> = plan.sample.iter().map(|x| x.packed()).collect();
        gpu.write(rowp, &packed);
        rows.pages_len = plan.pages.len();
        rows.max_pos = plan.max_pos();
        if let Some(f) = front {
            feed_tokens(self.ex, &f.sampled, &s.ids.buf, &plan.feedback);
        }
        let mut o = WgpuOps::new(self.ex, self.md, self.scratch);
        let (ids, pool) = (&self.md.layout.ids, &mut self.step.pool);
        decode(&mut o, c, ids, s, pool, rows, &*rowp, n, r)?;
        let tokens = self.ex.read_back(&s.tokens.buf, 0, r * 4);
        let logp = self.ex.read_back(&s.logp, 0, r * 4);
        let run = self.ex.submit_async()?;
        Ok(WgpuRun {
            run,
            sampled: s.tokens.buf.clone(),
            tokens,
            logp,
        })
    }

    fn poll(&mut self, run: &mut WgpuRun, wait: bool) -> Result<Option<Sampled>> {
        let Some(back) = run.run.poll(wait)? else {
            return Ok(None);
        };
        self.ex.recycle(&mut run.run);
        Ok(Some(Sampled {
            tokens: back.get::<u32>(run.tokens),
            logp: back.get::<f32>(run.logp),
        }))
    }
}
