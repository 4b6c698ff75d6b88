//! The backend-neutral op runner (issue 12): one method per model op, on host f32 tensors.
//!
//! A backend joins the op-level conformance suite by implementing [`OpRunner`] (upload,
//! launch its kernel, read back) and instantiating `op_suite!` in `conformance.rs`; the
//! tests in `op_tests.rs` are written once against this trait and compare every result with
//! the CPU reference (`cpu::ops`) called directly.
//!
//! Why here and not in `rolloutpipe_backends::seam`: the seam is the model-level contract
//! (engine, trainer, weight sync) that the harness depends on. These op signatures mirror
//! kernel layouts (packed attention, accumulating gradients, the loss's four sums) which
//! each backend is free to change; freezing them in the public API would make every kernel
//! refactor an API break. Only the tests need one shape for all backends.
//!
//! Conventions: row-major layouts as in `cpu::ops`; `*_bwd` methods **accumulate** into the
//! gradient slices they are given (as the model's backward does), so the tests pass
//! non-zero initial gradients to catch a kernel that overwrites instead of adding.

use rolloutpipe_backends::SamplingParams;
use rolloutpipe_backends::cpu::ops as cpu;

/// The per-token inputs of the policy loss.
///
/// `old` and `refp` hold resolved values: where `has_old[t]` (`has_ref[t]`) is false, the
/// entry equals `logp[t]`, as the CPU model fills it; a backend may instead read the flags.
pub struct LossInputs<'a> {
    pub logp: &'a [f32],
    pub old: &'a [f32],
    pub refp: &'a [f32],
    pub has_old: &'a [bool],
    pub has_ref: &'a [bool],
    /// Sequence advantage of each token.
    pub adv: &'a [f32],
    /// Per-token loss weight (the aggregation's normaliser).
    pub w: &'a [f32],
    /// Per-token entropy (only summed, for the stats).
    pub ent: &'a [f32],
}

/// The objective.
#[derive(Debug, Clone, Copy)]
pub enum LossKind {
    Grpo(cpu::GrpoCoefs),
    /// `−w·logp`.
    Sft,
}

/// AdamW hyper-parameters of one step (`torch.optim.AdamW` semantics, see `cpu::adamw_step`).
#[derive(Debug, Clone, Copy)]
pub struct Adam {
    pub grad_scale: f32,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// One method per op; every argument and result lives on the host.
#[allow(clippy::too_many_arguments)]
pub trait OpRunner {
    /// `out[i] = table[ids[i]]`, `[n, dim]`.
    fn embedding_fwd(&mut self, table: &[f32], ids: &[u32], vocab: usize, dim: usize) -> Vec<f32>;
    /// `dtable[ids[i]] += dout[i]`.
    fn embedding_bwd(&mut self, dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize);
    /// `(out, rstd)`.
    fn rmsnorm_fwd(&mut self, x: &[f32], w: &[f32], dim: usize, eps: f64) -> (Vec<f32>, Vec<f32>);
    /// Accumulates into `dx` and `dw`.
    fn rmsnorm_bwd(
        &mut self,
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        rstd: &[f32],
        dim: usize,
    );
    /// `y = x·wᵀ`, `x: [n, din]`, `w: [dout, din]`.
    fn matmul_fwd(&mut self, x: &[f32], w: &[f32], n: usize, din: usize, dout: usize) -> Vec<f32>;
    /// Accumulates into `dx` and `dw`.
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
    );
    /// Rotates `x: [rows, heads, hd]` in place at positions `pos` (`< table` rows).
    fn rope_fwd(&mut self, x: &mut [f32], pos: &[u32], heads: usize, table: &cpu::RopeTable<f32>);
    /// The inverse rotation (the backward), in place.
    fn rope_bwd(&mut self, dx: &mut [f32], pos: &[u32], heads: usize, table: &cpu::RopeTable<f32>);
    /// Causal attention over packed sequences of lengths `lens` (rows of q, k, v, dout are the
    /// sequences one after another), forward and backward: `(out, dq, dk, dv)`, gradients
    /// fresh (not accumulated).
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
    ) -> [Vec<f32>; 4];
    /// Forward of `nq` new queries, the last `nq` positions of one request whose `nk` keys
    /// are given (a decode chunk against its cache).
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
    ) -> Vec<f32>;
    fn swiglu_fwd(&mut self, gate: &[f32], up: &[f32]) -> Vec<f32>;
    /// `(dgate, dup)`, fresh.
    fn swiglu_bwd(&mut self, dout: &[f32], gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>);
    fn residual_fwd(&mut self, a: &[f32], b: &[f32]) -> Vec<f32>;
    /// `(logp of target, entropy)` per row of `z: [rows, v]` at temperature `temp`.
    fn logprob_fwd(&mut self, z: &[f32], t: &[u32], v: usize, temp: f64) -> (Vec<f32>, Vec<f32>);
    /// `dz` (fresh) from `dlogp`.
    fn logprob_bwd(&mut self, dlp: &[f32], z: &[f32], t: &[u32], v: usize, temp: f64) -> Vec<f32>;
    /// `([Σ w·loss, Σ KL, #clipped, Σ entropy], dloss/dlogp)`.
    fn loss(&mut self, x: &LossInputs, kind: LossKind) -> ([f32; 4], Vec<f32>);
    /// One AdamW step `t` (1-based) in place on `p`, `m`, `v`.
    fn adamw_step(
        &mut self,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        a: Adam,
        t: u64,
    );
    /// Σ g² over all the tensors `parts` (the global gradient norm's square).
    fn grad_norm_sq(&mut self, parts: &[&[f32]]) -> f32;
    /// The largest buffer one kernel may bind, in bytes (`None`: no such limit); the
    /// production-shape run says which ops a device cannot hold at that shape.
    fn max_binding_bytes(&self) -> Option<u64> {
        None
    }
    /// One draw per row of `z: [rows, v]` with uniform `us[r]`: `(tokens, their logp)`.
    fn sample(
        &mut self,
        z: &[f32],
        v: usize,
        p: &SamplingParams,
        us: &[f64],
    ) -> (Vec<u32>, Vec<f32>);
}

/// The CPU reference behind the trait. Its instance of the suite checks this adapter (the
/// packing, accumulation and sums the trait adds) against the direct `cpu::ops` calls; the
/// ops themselves are proven against transformers by the golden and finite-difference tests.
pub struct CpuOps;

impl CpuOps {
    pub fn new() -> Option<Self> {
        Some(CpuOps)
    }
}

#[allow(clippy::too_many_arguments)]
impl OpRunner for CpuOps {
    fn embedding_fwd(&mut self, table: &[f32], ids: &[u32], _vocab: usize, dim: usize) -> Vec<f32> {
        let mut out = vec![0.0; ids.len() * dim];
        cpu::embedding_fwd(&mut out, ids, table, dim);
        out
    }
    fn embedding_bwd(&mut self, dtable: &mut [f32], dout: &[f32], ids: &[u32], dim: usize) {
        cpu::embedding_bwd(dtable, dout, ids, dim);
    }
    fn rmsnorm_fwd(&mut self, x: &[f32], w: &[f32], dim: usize, eps: f64) -> (Vec<f32>, Vec<f32>) {
        let (mut out, mut rstd) = (vec![0.0; x.len()], vec![0.0; x.len() / dim]);
        cpu::rmsnorm_fwd(&mut out, &mut rstd, x, w, dim, eps);
        (out, rstd)
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
        cpu::rmsnorm_bwd(dx, dw, dout, x, w, rstd, dim);
    }
    fn matmul_fwd(&mut self, x: &[f32], w: &[f32], n: usize, din: usize, dout: usize) -> Vec<f32> {
        let mut y = vec![0.0; n * dout];
        cpu::matmul_fwd(&mut y, x, w, n, din, dout);
        y
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
        cpu::matmul_bwd(Some(dx), dw, dy, x, w, n, din, dout);
    }
    fn rope_fwd(&mut self, x: &mut [f32], pos: &[u32], heads: usize, table: &cpu::RopeTable<f32>) {
        cpu::rope_fwd(x, pos, heads, table);
    }
    fn rope_bwd(&mut self, dx: &mut [f32], pos: &[u32], heads: usize, table: &cpu::RopeTable<f32>) {
        cpu::rope_bwd(dx, pos, heads, table);
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
        let mut out = vec![0.0; n * qd];
        let mut dq = vec![0.0; n * qd];
        let (mut dk, mut dv) = (vec![0.0; n * kd], vec![0.0; n * kd]);
        let mut s = 0;
        for &m in lens {
            let mut att = vec![0.0; h * m * m];
            let (qs, ks) = (s * qd..(s + m) * qd, s * kd..(s + m) * kd);
            cpu::attention_fwd(
                &mut out[qs.clone()],
                &mut att,
                &q[qs.clone()],
                &k[ks.clone()],
                &v[ks.clone()],
                m,
                m,
                h,
                kvh,
                hd,
            );
            let mut scratch = vec![0.0; m];
            cpu::attention_bwd(
                &mut dq[qs.clone()],
                &mut dk[ks.clone()],
                &mut dv[ks.clone()],
                &mut scratch,
                &dout[qs.clone()],
                &att,
                &q[qs],
                &k[ks.clone()],
                &v[ks],
                m,
                m,
                h,
                kvh,
                hd,
            );
            s += m;
        }
        [out, dq, dk, dv]
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
        let mut out = vec![0.0; nq * h * hd];
        let mut att = vec![0.0; h * nq * nk];
        cpu::attention_fwd(&mut out, &mut att, q, k, v, nq, nk, h, kvh, hd);
        out
    }
    fn swiglu_fwd(&mut self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; gate.len()];
        cpu::swiglu_fwd(&mut out, gate, up);
        out
    }
    fn swiglu_bwd(&mut self, dout: &[f32], gate: &[f32], up: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (mut dg, mut du) = (vec![0.0; gate.len()], vec![0.0; gate.len()]);
        cpu::swiglu_bwd(&mut dg, &mut du, dout, gate, up);
        (dg, du)
    }
    fn residual_fwd(&mut self, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; a.len()];
        cpu::residual_fwd(&mut out, a, b);
        out
    }
    fn logprob_fwd(&mut self, z: &[f32], t: &[u32], v: usize, temp: f64) -> (Vec<f32>, Vec<f32>) {
        let rows = t.len();
        let (mut lp, mut ent, mut lse) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        cpu::logprob_fwd(&mut lp, &mut ent, &mut lse, z, t, v, temp);
        (lp, ent)
    }
    fn logprob_bwd(&mut self, dlp: &[f32], z: &[f32], t: &[u32], v: usize, temp: f64) -> Vec<f32> {
        // The backward reads the forward's log-sum-exp, as the model saves it.
        let rows = t.len();
        let (mut lp, mut ent, mut lse) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        cpu::logprob_fwd(&mut lp, &mut ent, &mut lse, z, t, v, temp);
        let mut dz = vec![0.0; rows * v];
        cpu::logprob_bwd(&mut dz, dlp, z, t, &lse, v, temp);
        dz
    }
    fn loss(&mut self, x: &LossInputs, kind: LossKind) -> ([f32; 4], Vec<f32>) {
        let n = x.logp.len();
        // The CPU model reads resolved values only; hold the inputs to that contract so a
        // test cannot pass flags that disagree with them.
        assert!(
            (0..n).all(|i| (x.has_old[i] || x.old[i] == x.logp[i])
                && (x.has_ref[i] || x.refp[i] == x.logp[i])),
            "LossInputs: old/refp must equal logp where has_old/has_ref is false"
        );
        let ent = x.ent.iter().map(|e| *e as f64).sum::<f64>() as f32;
        match kind {
            LossKind::Grpo(c) => {
                let (mut loss, mut kl, mut clipped) =
                    (vec![0.0f32; n], vec![0.0f32; n], vec![false; n]);
                cpu::grpo_loss_fwd(
                    &mut loss,
                    &mut kl,
                    &mut clipped,
                    x.logp,
                    x.old,
                    x.refp,
                    x.adv,
                    x.w,
                    c,
                );
                let mut dlp = vec![0.0f32; n];
                cpu::grpo_loss_bwd(&mut dlp, x.logp, x.old, x.refp, x.adv, x.w, c);
                let sums = [
                    loss.iter().map(|x| *x as f64).sum::<f64>() as f32,
                    kl.iter().map(|x| *x as f64).sum::<f64>() as f32,
                    clipped.iter().filter(|c| **c).count() as f32,
                    ent,
                ];
                (sums, dlp)
            }
            LossKind::Sft => {
                let loss = -(0..n).map(|i| (x.w[i] * x.logp[i]) as f64).sum::<f64>() as f32;
                ([loss, 0.0, 0.0, ent], x.w.iter().map(|w| -w).collect())
            }
        }
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
        cpu::adamw_step(
            p,
            g,
            m,
            v,
            a.grad_scale,
            a.lr,
            a.beta1,
            a.beta2,
            a.eps,
            a.weight_decay,
            t,
        );
    }
    fn grad_norm_sq(&mut self, parts: &[&[f32]]) -> f32 {
        parts.iter().map(|g| cpu::grad_norm(g)).sum::<f64>() as f32
    }
    fn sample(
        &mut self,
        z: &[f32],
        v: usize,
        p: &SamplingParams,
        us: &[f64],
    ) -> (Vec<u32>, Vec<f32>) {
        let mut scratch = Vec::new();
        us.iter()
            .enumerate()
            .map(|(r, &u)| cpu::sample(&z[r * v..(r + 1) * v], p, u, &mut scratch))
            .unzip()
    }
}
