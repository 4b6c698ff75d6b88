//! The CUDA backend behind [`OpRunner`]: upload, launch the PTX kernel through the
//! backend's own launchers (`cuda::ops`), read back. Compiled with `--features cuda`; on a
//! machine without a driver or device every test prints `SKIP` and passes, unless
//! `ROLLOUTPIPE_REQUIRE_CUDA=1` (set by `scripts/device/cuda.sh`) makes that a failure.
//!
//! Two shapes the kernels do not take directly are adapted here, visibly:
//! - head dims below 32 (the suite's `hd = 4`) run zero-padded to the next supported head
//!   dim with the original scale passed separately (padding adds exact zeros to every dot
//!   product, and the padded output and gradient columns are dropped);
//! - the log-probs run over the vocabulary in several chunks, as the model's fused lm_head
//!   does, so the online log-sum-exp merge is exercised even at small vocabularies.

use rolloutpipe_backends::SamplingParams;
use rolloutpipe_backends::cpu::ops::RopeTable;
use rolloutpipe_backends::cuda::ops::{self as cu, AttnShape, LossBufs};
use rolloutpipe_backends::cuda::plan::{self, AdamScalars, flags};
use std::sync::Arc;

use rolloutpipe_backends::cuda::{Cuda, DBuf};

use super::ops::{Adam, LossInputs, LossKind, OpRunner};

pub use super::cuda_device::cuda;

pub struct CudaOps {
    c: Arc<Cuda>,
}

impl CudaOps {
    pub fn new() -> Option<Self> {
        Some(CudaOps { c: cuda()? })
    }
    fn up(&self, d: &[f32]) -> DBuf<f32> {
        self.c.upload(d).expect("upload")
    }
    fn up_u(&self, d: &[u32]) -> DBuf<u32> {
        self.c.upload(d).expect("upload")
    }
    fn zeros(&self, n: usize) -> DBuf<f32> {
        self.c.alloc::<f32>(n).expect("alloc")
    }
    fn get(&self, b: &DBuf<f32>, n: usize) -> Vec<f32> {
        b.read(0, n).expect("readback")
    }
    fn rope(&mut self, x: &mut [f32], pos: &[u32], heads: usize, t: &RopeTable<f32>, fwd: bool) {
        let (rows, hd) = (pos.len(), 2 * t.half);
        let maxp = t.cos.len() / t.half;
        let (xb, pb, cb, sb) = (self.up(x), self.up_u(pos), self.up(&t.cos), self.up(&t.sin));
        cu::rope(&self.c, fwd, &xb, &pb, &cb, &sb, rows, heads, hd, maxp).expect("rope");
        x.copy_from_slice(&self.get(&xb, x.len()));
    }
}

/// `[rows, heads, hd]` -> `[rows, heads, hdp]` with zero columns (or back, dropping them).
fn repad(x: &[f32], rows_heads: usize, from: usize, to: usize) -> Vec<f32> {
    let mut out = vec![0.0; rows_heads * to];
    let w = from.min(to);
    for i in 0..rows_heads {
        out[i * to..i * to + w].copy_from_slice(&x[i * from..i * from + w]);
    }
    out
}

#[allow(clippy::too_many_arguments)]
impl OpRunner for CudaOps {
    fn embedding_fwd(&mut self, table: &[f32], ids: &[u32], vocab: usize, dim: usize) -> Vec<f32> {
        let n = ids.len();
        let (tb, ib, ob) = (self.up(table), self.up_u(ids), self.zeros(n * dim));
        cu::embedding_fwd(&self.c, &ob, &tb, &ib, n, dim, vocab).expect("embedding_fwd");
        self.get(&ob, n * dim)
    }
    fn embedding_bwd(&mut self, dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize) {
        let (n, vocab) = (ids.len(), dtable.len() / dim);
        let (gb, db, ib) = (self.up(dtable), self.up(dout), self.up_u(ids));
        cu::embedding_bwd(&self.c, &gb, &db, &ib, n, dim, vocab).expect("embedding_bwd");
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
        cu::rmsnorm_fwd(&self.c, &ob, &rb, &xb, &wb, rows, dim, eps).expect("rmsnorm_fwd");
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
        let (dxb, dwb) = (self.up(dx), self.up(dw));
        let (db, xb, wb, rb) = (self.up(dout), self.up(x), self.up(w), self.up(rstd));
        cu::rmsnorm_bwd(&self.c, &dxb, &dwb, &db, &xb, &wb, &rb, rows, dim).expect("rmsnorm_bwd");
        dx.copy_from_slice(&self.get(&dxb, dx.len()));
        dw.copy_from_slice(&self.get(&dwb, dw.len()));
    }
    fn matmul_fwd(&mut self, x: &[f32], w: &[f32], n: usize, din: usize, dout: usize) -> Vec<f32> {
        let (xb, wb, yb) = (self.up(x), self.up(w), self.zeros(n * dout));
        cu::matmul_fwd(&self.c, &yb, &xb, &wb, n, din, dout).expect("matmul_fwd");
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
        let (dxb, dwb, dyb, xb, wb) = (
            self.up(dx),
            self.up(dw),
            self.up(dy),
            self.up(x),
            self.up(w),
        );
        cu::matmul_bwd(&self.c, Some(&dxb), &dwb, &dyb, &xb, &wb, n, din, dout)
            .expect("matmul_bwd");
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
        let hdp = plan::padded_head_dim(hd).expect("head dim <= 128");
        let mut qmeta = Vec::with_capacity(2 * n);
        let mut s = 0u32;
        for &m in lens {
            for t in 0..m as u32 {
                qmeta.extend([s, t]);
            }
            s += m as u32;
        }
        let (qb, kb, vb, db) = (
            self.up(&repad(q, n * h, hd, hdp)),
            self.up(&repad(k, n * kvh, hd, hdp)),
            self.up(&repad(v, n * kvh, hd, hdp)),
            self.up(&repad(dout, n * h, hd, hdp)),
        );
        let mb = self.up_u(&qmeta);
        let (ob, sb) = (self.zeros(n * h * hdp), self.zeros(2 * n * h));
        let (dqb, dkb, dvb) = (
            self.zeros(n * h * hdp),
            self.zeros(n * kvh * hdp),
            self.zeros(n * kvh * hdp),
        );
        let shape = AttnShape {
            n_q: n,
            n_k: n,
            heads: h,
            kv_heads: kvh,
            hd: hdp,
            scale: plan::attention_scale(hd),
        };
        cu::attention_fwd(&self.c, &ob, &sb, &qb, &kb, &vb, &mb, shape).expect("attention_fwd");
        cu::attention_bwd(
            &self.c, &dqb, &dkb, &dvb, &sb, &db, &ob, &qb, &kb, &vb, &mb, shape,
        )
        .expect("attention_bwd");
        [
            repad(&self.get(&ob, n * h * hdp), n * h, hdp, hd),
            repad(&self.get(&dqb, n * h * hdp), n * h, hdp, hd),
            repad(&self.get(&dkb, n * kvh * hdp), n * kvh, hdp, hd),
            repad(&self.get(&dvb, n * kvh * hdp), n * kvh, hdp, hd),
        ]
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
        // The keys sit at rows 3.. of a larger cache, as in a slot (qmeta base = 3).
        let (base, cache_rows) = (3usize, nk + 8);
        let hdp = plan::padded_head_dim(hd).expect("head dim <= 128");
        let mut kc = vec![0.5f32; cache_rows * kvh * hdp];
        let mut vc = vec![-0.5f32; cache_rows * kvh * hdp];
        let kp = repad(k, nk * kvh, hd, hdp);
        let vp = repad(v, nk * kvh, hd, hdp);
        kc[base * kvh * hdp..(base + nk) * kvh * hdp].copy_from_slice(&kp);
        vc[base * kvh * hdp..(base + nk) * kvh * hdp].copy_from_slice(&vp);
        let qmeta: Vec<u32> = (0..nq)
            .flat_map(|i| [base as u32, (nk - nq + i) as u32])
            .collect();
        let (qb, kb, vb, mb) = (
            self.up(&repad(q, nq * h, hd, hdp)),
            self.up(&kc),
            self.up(&vc),
            self.up_u(&qmeta),
        );
        let (ob, sb) = (self.zeros(nq * h * hdp), self.zeros(2 * nq * h));
        let shape = AttnShape {
            n_q: nq,
            n_k: cache_rows,
            heads: h,
            kv_heads: kvh,
            hd: hdp,
            scale: plan::attention_scale(hd),
        };
        cu::attention_fwd(&self.c, &ob, &sb, &qb, &kb, &vb, &mb, shape).expect("attention_fwd");
        repad(&self.get(&ob, nq * h * hdp), nq * h, hdp, hd)
    }
    fn swiglu_fwd(&mut self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        let n = gate.len();
        let (gb, ub, ob) = (self.up(gate), self.up(up), self.zeros(n));
        cu::swiglu_fwd(&self.c, &ob, &gb, &ub, n).expect("swiglu_fwd");
        self.get(&ob, n)
    }
    fn swiglu_bwd(&mut self, dout: &[f32], gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let n = gate.len();
        let (db, gb, ub) = (self.up(dout), self.up(gate), self.up(up));
        let (dgb, dub) = (self.zeros(n), self.zeros(n));
        cu::swiglu_bwd(&self.c, &dgb, &dub, &db, &gb, &ub, n).expect("swiglu_bwd");
        (self.get(&dgb, n), self.get(&dub, n))
    }
    fn residual_fwd(&mut self, a: &[f32], b: &[f32]) -> Vec<f32> {
        let n = a.len();
        let (ab, bb, ob) = (self.up(a), self.up(b), self.zeros(n));
        cu::residual_fwd(&self.c, &ob, &ab, &bb, n).expect("residual_fwd");
        self.get(&ob, n)
    }
    fn logprob_fwd(&mut self, z: &[f32], t: &[u32], v: usize, temp: f64) -> (Vec<f32>, Vec<f32>) {
        let rows = t.len();
        let (lp, ent, _lse) = self.logprob_fwd_chunked(z, t, v, temp);
        (self.get(&lp, rows), self.get(&ent, rows))
    }
    fn logprob_bwd(&mut self, dlp: &[f32], z: &[f32], t: &[u32], v: usize, temp: f64) -> Vec<f32> {
        let rows = t.len();
        let (_lp, _ent, lse) = self.logprob_fwd_chunked(z, t, v, temp);
        let (db, tb) = (self.up(dlp), self.up_u(t));
        let mut dz = vec![0.0f32; rows * v];
        for (v0, len) in chunks_of(rows, v) {
            let zb = self.up(&chunk_cols(z, rows, v, v0, len));
            let bf = self.c.alloc::<u16>(rows * len).expect("alloc");
            cu::logprob_bwd_chunk(&self.c, &zb, Some(&bf), &db, &lse, &tb, rows, len, v0, temp)
                .expect("logprob_bwd");
            let part = self.get(&zb, rows * len);
            // The bf16 copy the tensor-core backward reads: the f32 result rounded to nearest
            // even, bit for bit.
            let bits = bf.read(0, rows * len).expect("readback");
            for (x, b) in part.iter().zip(&bits) {
                assert_eq!(
                    half::bf16::from_f32(*x).to_bits(),
                    *b,
                    "logprob_bwd bf16 copy of {x}"
                );
            }
            for r in 0..rows {
                dz[r * v + v0..r * v + v0 + len].copy_from_slice(&part[r * len..(r + 1) * len]);
            }
        }
        dz
    }
    fn loss(&mut self, x: &LossInputs, kind: LossKind) -> ([f32; 4], Vec<f32>) {
        let n = x.logp.len();
        let fl: Vec<u32> = (0..n)
            .map(|i| {
                flags::SCORED
                    | if x.has_old[i] { flags::HAS_OLD } else { 0 }
                    | if x.has_ref[i] { flags::HAS_REF } else { 0 }
            })
            .collect();
        let (lb, ob, rb, ab, wb, eb) = (
            self.up(x.logp),
            self.up(x.old),
            self.up(x.refp),
            self.up(x.adv),
            self.up(x.w),
            self.up(x.ent),
        );
        let fb = self.up_u(&fl);
        let (sb, gb) = (self.zeros(4), self.zeros(n));
        let grpo = match kind {
            LossKind::Grpo(c) => rolloutpipe_backends::model::Loss::Grpo {
                eps_low: c.eps_low,
                eps_high: c.eps_high,
                beta: c.beta,
            },
            LossKind::Sft => rolloutpipe_backends::model::Loss::Sft,
        };
        let bufs = LossBufs {
            logp: &lb,
            old: &ob,
            refp: &rb,
            adv: &ab,
            w: &wb,
            flags: &fb,
        };
        cu::grpo_loss_fwd(&self.c, &sb, bufs, &eb, n, grpo).expect("grpo_loss_fwd");
        cu::grpo_loss_bwd(&self.c, &gb, bufs, n, grpo).expect("grpo_loss_bwd");
        let s = self.get(&sb, 4);
        ([s[0], s[1], s[2], s[3]], self.get(&gb, n))
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
        let s = AdamScalars::new(
            a.grad_scale,
            a.lr,
            a.beta1,
            a.beta2,
            a.eps,
            a.weight_decay,
            t,
        );
        cu::adamw_step(&self.c, &pb, &gb, &mb, &vb, n, s).expect("adamw_step");
        p.copy_from_slice(&self.get(&pb, n));
        m.copy_from_slice(&self.get(&mb, n));
        v.copy_from_slice(&self.get(&vb, n));
    }
    fn grad_norm_sq(&mut self, parts: &[&[f32]]) -> f32 {
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        let (bases, total) = plan::grad_norm_bases(&lens);
        let partials = self.c.alloc::<f64>(total).expect("alloc");
        let out = self.c.alloc::<f64>(1).expect("alloc");
        let bufs: Vec<DBuf<f32>> = parts.iter().map(|p| self.up(p)).collect();
        for ((b, &n), &base) in bufs.iter().zip(&lens).zip(&bases) {
            cu::grad_norm(&self.c, &partials, b, n, base).expect("grad_norm");
        }
        cu::grad_norm_reduce(&self.c, &out, &partials, total).expect("grad_norm_reduce");
        out.read(0, 1).expect("readback")[0] as f32
    }
    fn sample(
        &mut self,
        z: &[f32],
        v: usize,
        p: &SamplingParams,
        us: &[f64],
    ) -> (Vec<u32>, Vec<f32>) {
        let rows = us.len();
        let rowp: Vec<f32> = us
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
        let (zb, rb) = (self.up(z), self.up(&rowp));
        let (tb, lb) = (self.c.alloc::<u32>(rows).expect("alloc"), self.zeros(rows));
        cu::sample(&self.c, &tb, &lb, &zb, &rb, rows, v).expect("sample");
        (tb.read(0, rows).expect("readback"), self.get(&lb, rows))
    }
}

impl CudaOps {
    /// The chunked forward: `(logp, entropy, lse)` on the device.
    fn logprob_fwd_chunked(
        &mut self,
        z: &[f32],
        t: &[u32],
        v: usize,
        temp: f64,
    ) -> (DBuf<f32>, DBuf<f32>, DBuf<f32>) {
        let rows = t.len();
        let tb = self.up_u(t);
        let state = self.zeros(4 * rows);
        for (i, (v0, len)) in chunks_of(rows, v).into_iter().enumerate() {
            let zb = self.up(&chunk_cols(z, rows, v, v0, len));
            cu::logprob_fwd_chunk(&self.c, &state, &zb, &tb, rows, len, v0, i == 0, temp)
                .expect("logprob_fwd");
        }
        let (lp, ent, lse) = (self.zeros(rows), self.zeros(rows), self.zeros(rows));
        cu::logprob_fwd_finish(&self.c, &lp, &ent, &lse, &state, rows).expect("logprob_fwd_finish");
        (lp, ent, lse)
    }

    /// The tensor-core product on bf16 operands (for the CUDA-only check).
    pub fn matmul_fwd_bf16(
        &mut self,
        x: &[f32],
        w: &[f32],
        n: usize,
        din: usize,
        dout: usize,
    ) -> Vec<f32> {
        let (xb, wb) = (self.up(x), self.up(w));
        let (xh, wh) = (
            self.c.alloc::<u16>(x.len()).expect("alloc"),
            self.c.alloc::<u16>(w.len()).expect("alloc"),
        );
        cu::cast_bf16(&self.c, &xh, &xb, x.len()).expect("cast");
        cu::cast_bf16(&self.c, &wh, &wb, w.len()).expect("cast");
        let yb = self.zeros(n * dout);
        cu::matmul_fwd_tc(&self.c, &yb, &xh, &wh, n, din, dout).expect("matmul_fwd");
        self.get(&yb, n * dout)
    }

    /// The tensor-core backward on bf16 operands, accumulating into `dx` and `dw`.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_bwd_bf16(
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
        let half = |s: &Self, d: &[f32]| {
            let b = s.up(d);
            let h = s.c.alloc::<u16>(d.len()).expect("alloc");
            cu::cast_bf16(&s.c, &h, &b, d.len()).expect("cast");
            h
        };
        let (dyh, xh, wh) = (half(self, dy), half(self, x), half(self, w));
        let (dxb, dwb) = (self.up(dx), self.up(dw));
        cu::matmul_bwd_tc(&self.c, Some(&dxb), &dwb, &dyh, &xh, &wh, n, din, dout)
            .expect("matmul_bwd");
        dx.copy_from_slice(&self.get(&dxb, dx.len()));
        dw.copy_from_slice(&self.get(&dwb, dw.len()));
    }
}

/// About three vocabulary chunks per call (multiples of 8), so the online merge runs.
fn chunks_of(rows: usize, v: usize) -> Vec<(usize, usize)> {
    let budget = rows * (v.div_ceil(3).div_ceil(8) * 8).max(8);
    plan::vocab_chunks(rows, v, budget)
}

/// Columns `v0..v0+len` of `z[rows, v]` as a contiguous `[rows, len]`.
fn chunk_cols(z: &[f32], rows: usize, v: usize, v0: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * len);
    for r in 0..rows {
        out.extend_from_slice(&z[r * v + v0..r * v + v0 + len]);
    }
    out
}
