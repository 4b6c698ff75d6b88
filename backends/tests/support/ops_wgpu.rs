//! The wgpu backend behind [`OpRunner`]: upload, launch the kernel, submit, read back.

use std::sync::Arc;

use ::wgpu::Buffer;
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use rolloutpipe_backends::SamplingParams;
use rolloutpipe_backends::cpu::ops::RopeTable;
use rolloutpipe_backends::wgpu::{Exec, Gpu, ops as gpu};

use super::check::rand_vec;
use super::device;
use super::ops::{Adam, LossInputs, LossKind, OpRunner};

pub struct WgpuOps {
    g: Arc<Gpu>,
    ex: Exec,
}

impl WgpuOps {
    /// `None` (after `device::gpu` printed the SKIP) without an adapter.
    pub fn new() -> Option<Self> {
        let g = device::gpu()?;
        Some(WgpuOps {
            ex: Exec::new(Arc::clone(&g)),
            g,
        })
    }
    fn up(&self, d: &[f32]) -> Buffer {
        self.g.upload("test input", d)
    }
    fn up_u(&self, d: &[u32]) -> Buffer {
        self.g.upload("test ids", d)
    }
    fn zeros(&self, n: usize) -> Buffer {
        self.g.buffer("test output", n)
    }
    fn run(&mut self) {
        self.ex.submit().expect("submission");
    }
    fn get(&self, b: &Buffer, n: usize) -> Vec<f32> {
        self.g.read::<f32>(b, n).expect("readback")
    }
    fn get_u(&self, b: &Buffer, n: usize) -> Vec<u32> {
        self.g.read::<u32>(b, n).expect("readback")
    }
    fn rope(&mut self, x: &mut [f32], pos: &[u32], heads: usize, t: &RopeTable<f32>, fwd: bool) {
        let (rows, hd) = (pos.len(), 2 * t.half);
        let maxp = t.cos.len() / t.half;
        let (xb, pb, cb, sb) = (self.up(x), self.up_u(pos), self.up(&t.cos), self.up(&t.sin));
        let f = if fwd { gpu::rope_fwd } else { gpu::rope_bwd };
        f(&mut self.ex, &xb, &pb, &cb, &sb, rows, heads, hd, maxp);
        self.run();
        x.copy_from_slice(&self.get(&xb, x.len()));
    }
}

#[allow(clippy::too_many_arguments)]
impl OpRunner for WgpuOps {
    fn embedding_fwd(&mut self, table: &[f32], ids: &[u32], vocab: usize, dim: usize) -> Vec<f32> {
        let n = ids.len();
        let (tb, ib, ob) = (self.up(table), self.up_u(ids), self.zeros(n * dim));
        gpu::embedding_fwd(&mut self.ex, &ob, &ib, &tb, n, dim, vocab);
        self.run();
        self.get(&ob, n * dim)
    }
    fn embedding_bwd(&mut self, dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize) {
        let (n, vocab) = (ids.len(), dtable.len() / dim);
        let ix = gpu::ScatterIndex::new(ids, vocab);
        assert_eq!(ix.pairs.len(), 2 * n);
        let (gb, db) = (self.up(dtable), self.up(dout));
        let (grb, orb) = (self.up_u(&ix.starts), self.up_u(&ix.pairs));
        gpu::embedding_bwd(&mut self.ex, &gb, &db, &grb, &orb, ix.touched(), dim, vocab);
        self.run();
        dtable.copy_from_slice(&self.get(&gb, dtable.len()));
    }
    fn rmsnorm_fwd(&mut self, x: &[f32], w: &[f32], dim: usize, eps: f64) -> (Vec<f32>, Vec<f32>) {
        let rows = x.len() / dim;
        let (xb, wb, ob, rb) = (
            self.up(x),
            self.up(w),
            self.zeros(x.len()),
            self.zeros(rows),
        );
        gpu::rmsnorm_fwd(&mut self.ex, &ob, &rb, &xb, &wb, rows, dim, eps);
        self.run();
        (self.get(&ob, x.len()), self.get(&rb, rows))
    }
    fn rmsnorm_bwd(
        &mut self,
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dim: usize,
    ) {
        let rows = x.len() / dim;
        let (xb, wb, rb, db) = (self.up(x), self.up(w), self.up(rstd), self.up(dout));
        let (dxb, dwb) = (self.up(dx), self.up(dw));
        let part = self.zeros(gpu::rmsnorm_dw_scratch(rows, dim));
        // `true`: add into dx (the residual stream's gradient), as the model does.
        gpu::rmsnorm_bwd(
            &mut self.ex,
            &dxb,
            &dwb,
            &part,
            &db,
            &xb,
            &wb,
            &rb,
            rows,
            dim,
            true,
        );
        self.run();
        dx.copy_from_slice(&self.get(&dxb, dx.len()));
        dw.copy_from_slice(&self.get(&dwb, dw.len()));
    }
    fn matmul_fwd(&mut self, x: &[f32], w: &[f32], n: usize, din: usize, dout: usize) -> Vec<f32> {
        let (xb, wb, yb) = (self.up(x), self.up(w), self.zeros(n * dout));
        gpu::matmul_fwd(&mut self.ex, &yb, &xb, &wb, n, din, dout, false);
        self.run();
        self.get(&yb, n * dout)
    }
    fn matmul_bwd(
        &mut self,
        dx: &mut [f32],
        dw: &mut [f32],
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        n: usize,
        din: usize,
        dout: usize,
    ) {
        let (xb, wb, dyb, dxb, dwb) = (
            self.up(x),
            self.up(w),
            self.up(dy),
            self.up(dx),
            self.up(dw),
        );
        gpu::matmul_bwd(
            &mut self.ex,
            Some((&dxb, true)),
            &dwb,
            &dyb,
            &xb,
            &wb,
            n,
            din,
            dout,
        );
        self.run();
        dx.copy_from_slice(&self.get(&dxb, dx.len()));
        dw.copy_from_slice(&self.get(&dwb, dw.len()));
    }
    fn rope_fwd(&mut self, x: &mut [f32], pos: &[u32], heads: usize, table: &RopeTable<f32>) {
        self.rope(x, pos, heads, table, true);
    }
    fn rope_bwd(&mut self, dx: &mut [f32], pos: &[u32], heads: usize, table: &RopeTable<f32>) {
        self.rope(dx, pos, heads, table, false);
    }
    fn attention_packed(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dout: &[f32],
        lens: &[usize],
        h: usize,
        kvh: usize,
        hd: usize,
    ) -> [Vec<f32>; 4] {
        let n: usize = lens.iter().sum();
        let (qd, kd) = (h * hd, kvh * hd);
        // Per query row: (its sequence's first row, its position); per row for the
        // backward: (first row, sequence length).
        let (mut qmeta, mut rowmeta) = (Vec::new(), Vec::new());
        let mut s = 0;
        for &m in lens {
            for t in 0..m {
                qmeta.extend([s as u32, t as u32]);
                rowmeta.extend([s as u32, m as u32]);
            }
            s += m;
        }
        let (qb, kb, vb, db) = (self.up(q), self.up(k), self.up(v), self.up(dout));
        let (qm, rm) = (self.up_u(&qmeta), self.up_u(&rowmeta));
        let (ob, st, dqb, dkvb) = (
            self.zeros(n * qd),
            self.zeros(2 * n * h),
            self.zeros(n * qd),
            self.zeros(2 * n * kd),
        );
        gpu::attention_fwd(&mut self.ex, &ob, &st, &qb, &kb, &vb, &qm, n, n, h, kvh, hd);
        gpu::attention_bwd(
            &mut self.ex,
            &dqb,
            &dkvb,
            &st,
            &db,
            &qb,
            &kb,
            &vb,
            &ob,
            &rm,
            n,
            h,
            kvh,
            hd,
        );
        self.run();
        let mut dkv = self.get(&dkvb, 2 * n * kd);
        let dv = dkv.split_off(n * kd);
        [self.get(&ob, n * qd), self.get(&dqb, n * qd), dkv, dv]
    }
    fn attention_chunk_fwd(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        nq: usize,
        nk: usize,
        h: usize,
        kvh: usize,
        hd: usize,
    ) -> Vec<f32> {
        // The keys sit at rows BASE.. of a larger cache of unrelated rows (as a slot's
        // would), so a kernel that reads outside its request's rows fails.
        const BASE: usize = 100;
        let (qd, kd) = (h * hd, kvh * hd);
        let rows = BASE + nk + 9;
        let mut rng = ChaCha8Rng::seed_from_u64(0x5107);
        let mut kc = rand_vec(&mut rng, rows * kd, 1.0);
        let mut vc = rand_vec(&mut rng, rows * kd, 1.0);
        kc[BASE * kd..(BASE + nk) * kd].copy_from_slice(k);
        vc[BASE * kd..(BASE + nk) * kd].copy_from_slice(v);
        let qmeta: Vec<u32> = (0..nq)
            .flat_map(|i| [BASE as u32, (nk - nq + i) as u32])
            .collect();
        let (qb, kb, vb, mb) = (self.up(q), self.up(&kc), self.up(&vc), self.up_u(&qmeta));
        let (ob, st) = (self.zeros(nq * qd), self.zeros(nq * h));
        gpu::attention_fwd(
            &mut self.ex,
            &ob,
            &st,
            &qb,
            &kb,
            &vb,
            &mb,
            nq,
            rows,
            h,
            kvh,
            hd,
        );
        self.run();
        self.get(&ob, nq * qd)
    }
    fn swiglu_fwd(&mut self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        let n = gate.len();
        let (gb, ub, ob) = (self.up(gate), self.up(up), self.zeros(n));
        gpu::swiglu_fwd(&mut self.ex, &ob, &gb, &ub, n);
        self.run();
        self.get(&ob, n)
    }
    fn swiglu_bwd(&mut self, dout: &[f32], gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let n = gate.len();
        let (gb, ub, db) = (self.up(gate), self.up(up), self.up(dout));
        let (dgb, dub) = (self.zeros(n), self.zeros(n));
        gpu::swiglu_bwd(&mut self.ex, &dgb, &dub, &db, &gb, &ub, n);
        self.run();
        (self.get(&dgb, n), self.get(&dub, n))
    }
    fn residual_fwd(&mut self, a: &[f32], b: &[f32]) -> Vec<f32> {
        let n = a.len();
        let (ab, bb, sb) = (self.up(a), self.up(b), self.zeros(n));
        gpu::residual_fwd(&mut self.ex, &sb, &ab, &bb, n);
        self.run();
        self.get(&sb, n)
    }
    fn logprob_fwd(&mut self, z: &[f32], t: &[u32], v: usize, temp: f64) -> (Vec<f32>, Vec<f32>) {
        let rows = t.len();
        let (lp, ent, _lse) = self.logprob_fwd_chunked(z, t, v, temp);
        (self.get(&lp, rows), self.get(&ent, rows))
    }
    fn logprob_bwd(&mut self, dlp: &[f32], z: &[f32], t: &[u32], v: usize, temp: f64) -> Vec<f32> {
        let rows = t.len();
        let (_lp, _ent, lse) = self.logprob_fwd_chunked(z, t, v, temp);
        let (tb, db) = (self.up_u(t), self.up(dlp));
        let mut dz = vec![0.0f32; rows * v];
        for c in vocab_chunks(rows, v) {
            let zb = self.up(&chunk_of(z, v, c));
            gpu::logprob_bwd(&mut self.ex, &zb, &db, &lse, &tb, c, temp);
            self.run();
            let part = self.get(&zb, c.rows * c.cols);
            for (r, row) in part.chunks(c.cols).enumerate() {
                let at = (c.row0 + r) * v + c.v0;
                dz[at..at + c.cols].copy_from_slice(row);
            }
        }
        dz
    }
    fn loss(&mut self, x: &LossInputs, kind: LossKind) -> ([f32; 4], Vec<f32>) {
        let n = x.logp.len();
        let fl: Vec<u32> = (0..n)
            .map(|i| {
                gpu::flags::SCORED
                    | if x.has_old[i] { gpu::flags::HAS_OLD } else { 0 }
                    | if x.has_ref[i] { gpu::flags::HAS_REF } else { 0 }
            })
            .collect();
        let l = match kind {
            LossKind::Grpo(c) => gpu::Loss::Grpo {
                eps_low: c.eps_low,
                eps_high: c.eps_high,
                beta: c.beta,
            },
            LossKind::Sft => gpu::Loss::Sft,
        };
        let (lb, ob, rb, ab, wb, eb, fb) = (
            self.up(x.logp),
            self.up(x.old),
            self.up(x.refp),
            self.up(x.adv),
            self.up(x.w),
            self.up(x.ent),
            self.up_u(&fl),
        );
        let (sb, db) = (self.zeros(4), self.zeros(n));
        gpu::grpo_loss_fwd(&mut self.ex, &sb, &lb, &ob, &rb, &ab, &wb, &eb, &fb, n, l);
        gpu::grpo_loss_bwd(&mut self.ex, &db, &lb, &ob, &rb, &ab, &wb, &fb, n, l);
        self.run();
        let s = self.get(&sb, 4);
        ([s[0], s[1], s[2], s[3]], self.get(&db, n))
    }
    fn adamw_step(
        &mut self,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        a: Adam,
        t: u64,
    ) {
        let n = p.len();
        let (pb, gb, mb, vb) = (self.up(p), self.up(g), self.up(m), self.up(v));
        let s = gpu::AdamScalars::new(
            a.grad_scale,
            a.lr,
            a.beta1,
            a.beta2,
            a.eps,
            a.weight_decay,
            t,
        );
        gpu::adamw_step(&mut self.ex, &pb, &gb, &mb, &vb, n, s);
        self.run();
        p.copy_from_slice(&self.get(&pb, n));
        m.copy_from_slice(&self.get(&mb, n));
        v.copy_from_slice(&self.get(&vb, n));
    }
    fn grad_norm_sq(&mut self, parts: &[&[f32]]) -> f32 {
        // One partial per workgroup of every tensor, then one reduction: the trainer's path.
        let groups: usize = parts.iter().map(|g| gpu::grad_norm_groups(g.len())).sum();
        let (pb, total) = (self.zeros(groups.max(1)), self.zeros(1));
        let mut base = 0;
        let bufs: Vec<Buffer> = parts.iter().map(|g| self.up(g)).collect();
        for (g, b) in parts.iter().zip(&bufs) {
            gpu::grad_norm(&mut self.ex, &pb, &total, b, g.len(), base);
            base += gpu::grad_norm_groups(g.len());
        }
        gpu::grad_norm_reduce(&mut self.ex, &total, &pb, base);
        self.run();
        self.get(&total, 1)[0]
    }
    fn max_binding_bytes(&self) -> Option<u64> {
        Some(self.g.device().limits().max_storage_buffer_binding_size)
    }
    fn sample(
        &mut self,
        z: &[f32],
        v: usize,
        p: &SamplingParams,
        us: &[f64],
    ) -> (Vec<u32>, Vec<f32>) {
        let rows = us.len();
        let flat: Vec<f32> = us
            .iter()
            .flat_map(|&u| {
                rolloutpipe_backends::model::sampling::sample_row(
                    p.temperature,
                    p.top_k,
                    p.top_p,
                    u,
                )
            })
            .collect();
        let (zb, rb, tb, lb) = (
            self.up(z),
            self.up(&flat),
            self.zeros(rows),
            self.zeros(rows),
        );
        gpu::sample(&mut self.ex, &tb, &lb, &zb, &rb, rows, v);
        self.run();
        (self.get_u(&tb, rows), self.get(&lb, rows))
    }
}

impl WgpuOps {
    /// The chunked forward over `z[rows, v]` as the fused lm_head runs it, in three
    /// vocabulary chunks (the last one ragged where 3 does not divide `v`) and blocks of
    /// [`CHUNK_ROWS`] rows, so the running state's rescaling and the row offsets are
    /// exercised at every size; returns the `logp`, `entropy` and `lse` buffers.
    fn logprob_fwd_chunked(
        &mut self,
        z: &[f32],
        t: &[u32],
        v: usize,
        temp: f64,
    ) -> (Buffer, Buffer, Buffer) {
        let rows = t.len();
        let tb = self.up_u(t);
        let (lp, ent, lse, st) = (
            self.zeros(rows),
            self.zeros(rows),
            self.zeros(rows),
            self.zeros(4 * rows),
        );
        let out = gpu::LogprobBufs {
            state: &st,
            logp: &lp,
            entropy: &ent,
            lse: &lse,
        };
        for c in vocab_chunks(rows, v) {
            let zb = self.up(&chunk_of(z, v, c));
            gpu::logprob_fwd(&mut self.ex, out, &zb, &tb, c, c.v0 == 0, temp);
        }
        gpu::logprob_fwd_finish(&mut self.ex, out, 0, rows);
        self.run();
        (lp, ent, lse)
    }
}

/// Rows per block of the op-level log-prob tests.
const CHUNK_ROWS: usize = 4;

/// The (row block, vocabulary chunk) launches over `z[rows, v]`, rows outermost.
fn vocab_chunks(rows: usize, v: usize) -> Vec<gpu::VocabChunk> {
    let cols = v.div_ceil(3).max(1);
    let mut out = Vec::new();
    for row0 in (0..rows).step_by(CHUNK_ROWS) {
        for v0 in (0..v).step_by(cols) {
            out.push(gpu::VocabChunk {
                row0,
                rows: CHUNK_ROWS.min(rows - row0),
                v0,
                cols: cols.min(v - v0),
            });
        }
    }
    out
}

/// The block of `z[rows, v]` that chunk `c` covers, as a contiguous `[c.rows, c.cols]`.
fn chunk_of(z: &[f32], v: usize, c: gpu::VocabChunk) -> Vec<f32> {
    (c.row0..c.row0 + c.rows)
        .flat_map(|r| z[r * v + c.v0..r * v + c.v0 + c.cols].iter().copied())
        .collect()
}
