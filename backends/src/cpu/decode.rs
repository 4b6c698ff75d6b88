//! Generation on the CPU: the one engine's decode steps (`model::decode`) on the backend's
//! own thread pool, over a paged KV pool in host memory.
//!
//! A step's state (the KV pool, the step buffers) moves to the pool with the step and comes
//! back when it is collected, so the caller's thread prepares the next step (adds, cancels,
//! its own work) while the pool decodes; the engine's host bookkeeping does not wait for it.
//! Attention reads each request's positions through its page table (`cpu::ops::PagedRows`),
//! with the arithmetic of the contiguous reference, so its outputs are the same bits.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError, channel};

use rayon::prelude::*;

use super::model::Model;
use super::model_ops::CpuOps;
use super::ops::{PagedRows, attention_fwd_rows, sample};
use crate::engine::{Decoder, SampleRow, Sampled, StepPlan};
use crate::error::{BackendError, Result};
use crate::model::decode::{Decode, StepBufs, decode};
use crate::model::ops::{Heads, Ops};

/// Every layer's keys and values: `[rows, kv_dim]` each, addressed through page tables.
#[derive(Debug, Default)]
pub struct CpuKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

/// A step's rows as the KV ops read them: each row's `(page-table offset, position)`, the
/// tables, and each request's rows `(start, len)` with its attention scratch.
#[derive(Debug, Default)]
pub struct CpuRows {
    meta: Vec<u32>,
    pages: Vec<u32>,
    page_rows: usize,
    chunks: Vec<(usize, usize)>,
    /// Each request's attention probabilities, `[heads, len, keys]` (grow-only).
    att: Vec<Vec<f32>>,
}

impl CpuRows {
    /// The pool row that row `t` writes.
    fn dst(&self, t: usize) -> usize {
        let table = &self.pages[self.meta[2 * t] as usize..];
        let pos = self.meta[2 * t + 1] as usize;
        table[pos / self.page_rows] as usize * self.page_rows + pos % self.page_rows
    }
}

#[allow(clippy::too_many_arguments)]
impl Decode for CpuOps<'_, f32> {
    type Kv = CpuKv;
    type Rows = CpuRows;
    type Sample = Vec<SampleRow>;

    fn kv_append(
        &mut self,
        kv: &mut CpuKv,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: &CpuRows,
        n: usize,
    ) -> Result<()> {
        let kd = self.cfg().kv_dim();
        let (kp, vp) = (&mut kv.k[layer], &mut kv.v[layer]);
        for t in 0..n {
            let dst = rows.dst(t);
            kp[dst * kd..(dst + 1) * kd].copy_from_slice(&k[t * kd..(t + 1) * kd]);
            vp[dst * kd..(dst + 1) * kd].copy_from_slice(&v[t * kd..(t + 1) * kd]);
        }
        Ok(())
    }

    fn attention_decode(
        &mut self,
        out: &mut Vec<f32>,
        q: &Vec<f32>,
        kv: &CpuKv,
        layer: usize,
        rows: &mut CpuRows,
        n: usize,
        hs: Heads,
    ) -> Result<()> {
        let Heads { h, kvh, hd } = hs;
        let (qd, kd) = (h * hd, kvh * hd);
        let (kp, vp) = (&kv.k[layer], &kv.v[layer]);
        rows.att.resize_with(rows.chunks.len(), Vec::new);
        let CpuRows {
            meta,
            pages,
            page_rows,
            chunks,
            att,
        } = rows;
        let view = |t: usize, pool| PagedRows {
            pool,
            table: &pages[meta[2 * t] as usize..],
            page_rows: *page_rows,
            kd,
        };
        // Each request's rows of the output and its scratch, attending in parallel.
        let mut tasks = Vec::with_capacity(chunks.len());
        let mut rest = &mut out[..n * qd];
        for (&(start, len), a) in chunks.iter().zip(att.iter_mut()) {
            let (o, r) = std::mem::take(&mut rest).split_at_mut(len * qd);
            rest = r;
            tasks.push((start, len, o, a));
        }
        tasks.into_par_iter().for_each(|(start, len, o, a)| {
            let nk = meta[2 * (start + len - 1) + 1] as usize + 1;
            a.clear();
            a.resize(h * len * nk, 0.0);
            let q = &q[start * qd..(start + len) * qd];
            let (k, v) = (view(start, kp), view(start, vp));
            attention_fwd_rows(o, a, q, &k, &v, len, nk, h, kvh, hd);
        });
        Ok(())
    }

    fn sample(
        &mut self,
        tokens: &mut Vec<u32>,
        logp: &mut Vec<f32>,
        logits: &Vec<f32>,
        rows: &Vec<SampleRow>,
        r: usize,
        v: usize,
    ) -> Result<()> {
        // Each row's draw depends only on its own logits, settings and draw, so the rows are
        // sampled in parallel (a 151,936-entry softmax per row is not free).
        let draws: Vec<(u32, f32)> = rows[..r]
            .par_iter()
            .enumerate()
            .map_init(Vec::new, |scratch, (i, s)| {
                sample(&logits[i * v..(i + 1) * v], &s.params(), s.u, scratch)
            })
            .collect();
        for (i, (t, l)) in draws.into_iter().enumerate() {
            tokens[i] = t;
            logp[i] = l;
        }
        Ok(())
    }
}

/// A step's state on the pool: the KV pool, the step buffers and the rows' placement.
#[derive(Debug, Default)]
pub struct CpuStep {
    kv: CpuKv,
    bufs: Option<StepBufs<Vec<f32>, Vec<u32>>>,
    rows: CpuRows,
    sample: Vec<SampleRow>,
    scratch: Vec<f32>,
}

impl CpuStep {
    /// Takes in `plan`: the KV pool grown to its pages, the step buffers to its rows, its
    /// rows and sampling written.
    fn load(&mut self, m: &Model<f32>, plan: &StepPlan) -> Result<()> {
        let c = &m.cfg;
        let rows = plan.kv_pages * plan.page_rows * c.kv_dim();
        self.kv.k.resize_with(c.num_hidden_layers, Vec::new);
        self.kv.v.resize_with(c.num_hidden_layers, Vec::new);
        for b in self.kv.k.iter_mut().chain(&mut self.kv.v) {
            if b.len() < rows {
                b.resize(rows, 0.0);
            }
        }
        let (n, r) = (plan.n(), plan.r());
        let mut o = CpuOps::new(m, None, &mut self.scratch);
        if self
            .bufs
            .as_ref()
            .is_none_or(|b| b.cap_n < n || b.cap_r < r)
        {
            self.bufs = None;
            self.bufs = Some(StepBufs::new(&mut o, c, n, r)?);
        }
        let s = self
            .bufs
            .as_mut()
            .ok_or_else(|| BackendError::Device("decode buffers missing".into()))?;
        o.write_idx(&mut s.ids, &plan.ids, None)?;
        o.write_idx(&mut s.pos, &plan.pos, None)?;
        o.write_idx(&mut s.last, &plan.last, None)?;
        let rw = &mut self.rows;
        rw.meta.clone_from(&plan.meta);
        rw.pages.clone_from(&plan.pages);
        rw.page_rows = plan.page_rows;
        rw.chunks.clear();
        let mut start = 0;
        for &last in &plan.last {
            rw.chunks.push((start, last as usize + 1 - start));
            start = last as usize + 1;
        }
        self.sample.clone_from(&plan.sample);
        Ok(())
    }

    /// Runs the loaded step.
    fn run(&mut self, m: &Model<f32>, n: usize, r: usize) -> Result<Sampled> {
        let s = self
            .bufs
            .as_mut()
            .ok_or_else(|| BackendError::Device("decode buffers missing".into()))?;
        let mut o = CpuOps::new(m, None, &mut self.scratch);
        let (c, ids) = (&m.cfg, &m.layout.ids);
        decode(
            &mut o,
            c,
            ids,
            s,
            &mut self.kv,
            &mut self.rows,
            &self.sample,
            n,
            r,
        )?;
        Ok(Sampled {
            tokens: s.tokens[..r].to_vec(),
            logp: s.logp[..r].to_vec(),
        })
    }
}

/// A submitted step: its state and result come back through the channel.
pub type CpuRun = Receiver<(Box<CpuStep>, Result<Sampled>)>;

/// The CPU's [`Decoder`]: runs steps on the backend's thread pool.
pub struct CpuDecoder<'a> {
    /// The weights, shared with a step in flight (training needs them unshared).
    pub model: &'a Arc<Model<f32>>,
    /// The backend's threads.
    pub pool: &'a Arc<rayon::ThreadPool>,
    /// The step state, away while a step runs.
    pub state: &'a mut Option<Box<CpuStep>>,
    /// Whether the last poll lost the state with its thread.
    pub lost: bool,
}

impl Decoder for CpuDecoder<'_> {
    type Run = CpuRun;

    fn launch(&mut self, plan: &StepPlan, _front: Option<&CpuRun>) -> Result<CpuRun> {
        let mut st = self
            .state
            .take()
            .ok_or(BackendError::StepInFlight("submit_step"))?;
        if let Err(e) = st.load(self.model, plan) {
            *self.state = Some(st);
            return Err(e);
        }
        let (n, r) = (plan.n(), plan.r());
        let (tx, rx) = channel();
        let model = Arc::clone(self.model);
        self.pool.spawn(move || {
            let out = st.run(&model, n, r);
            // Release the model before answering: once polled, training must find it
            // unshared (`Arc::get_mut`).
            drop(model);
            // The receiver is gone only when the backend was dropped mid-step.
            let _ = tx.send((st, out));
        });
        Ok(rx)
    }

    fn poll(&mut self, run: &mut CpuRun, wait: bool) -> Result<Option<Sampled>> {
        let got = if wait {
            run.recv().ok()
        } else {
            match run.try_recv() {
                Ok(r) => Some(r),
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => None,
            }
        };
        let Some((st, out)) = got else {
            // The step's thread died: the KV pool went with it.
            *self.state = Some(Box::default());
            self.lost = true;
            return Err(BackendError::Device(
                "the decode step's thread stopped; every active request was lost".into(),
            ));
        };
        *self.state = Some(st);
        out.map(Some)
    }

    fn lost_cache(&self) -> bool {
        self.lost
    }
}
