//! The Qwen3 model on a CUDA device: one buffer per parameter tensor (gradients and AdamW
//! moments alike), activations for packed batches, the forward, the chunked lm_head with
//! its fused log-probs, and the backward.
//!
//! Op for op the CPU reference's `cpu::model` and the wgpu backend's `model` (same names,
//! same order, packed rows without padding), so a difference between backends points at
//! one kernel. The `[tokens, vocab]` logits are never stored in training or scoring: the
//! vocabulary is walked in chunks ([`plan::vocab_chunks`]) whose logits are folded into an
//! online log-sum-exp (forward) or turned into `dlogits` and applied at once (backward).
//! Activations are sized for a row capacity and reallocated only when a batch needs more
//! (to the next power of two), so in steady state no call allocates.
//!
//! The products run on the f32 strided GEMM (`matmul_fwd_f32`), the path that matches the
//! CPU reference within the conformance tolerances; the bf16 tensor-core entries have their
//! own launchers (`ops::matmul_fwd_tc`, `ops::matmul_bwd_tc`), checked against bf16-rounded
//! CPU products, and are not wired into the model yet (docs/cuda.md).

use std::collections::HashMap;
use std::sync::Arc;

use super::device::{Cuda, DBuf};
use super::layout::{Packed, logits_len};
use super::ops::{self, AttnShape, LossBufs};
use super::plan::{self, GemmF32};
use crate::config::ModelConfig;
use crate::cpu::model::Layout;
use crate::cpu::ops::RopeTable;
use crate::error::{BackendError, Result};

/// Entry indices (into [`Layout::entries`]) of one layer's tensors.
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct LayerIdx {
    pub input_norm: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    pub q_norm: usize,
    pub k_norm: usize,
    pub post_norm: usize,
    pub gate: usize,
    pub up: usize,
    pub down: usize,
}

/// Parameters and gradient sums on the device.
#[derive(Debug)]
pub struct DeviceModel {
    /// The context.
    pub cuda: Arc<Cuda>,
    /// The configuration.
    pub cfg: ModelConfig,
    /// Tensor names, shapes and flat offsets (shared with the CPU reference).
    pub layout: Layout,
    /// One buffer per layout entry.
    pub params: Vec<DBuf<f32>>,
    /// Gradient sums, one buffer per layout entry.
    pub grads: Vec<DBuf<f32>>,
    /// Entry of `model.embed_tokens.weight`.
    pub embed: usize,
    /// Entry of `lm_head.weight` (the embedding's when tied).
    pub lm_head: usize,
    /// Entry of `model.norm.weight`.
    pub final_norm: usize,
    /// Per layer.
    pub layers: Vec<LayerIdx>,
    /// RoPE tables `[max_pos, head_dim/2]` from the CPU reference's own function.
    pub cos: DBuf<f32>,
    /// See `cos`.
    pub sin: DBuf<f32>,
}

impl DeviceModel {
    /// Uploads `flat` (the layout's flat parameter buffer).
    pub fn new(cuda: &Arc<Cuda>, cfg: &ModelConfig, layout: Layout, flat: &[f32]) -> Result<Self> {
        plan::check_head_dim(cfg.head_dim)?;
        let by_offset: HashMap<usize, usize> = layout
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.offset, i))
            .collect();
        let at = |off: usize| {
            by_offset
                .get(&off)
                .copied()
                .ok_or_else(|| BackendError::Device(format!("no tensor at offset {off}")))
        };
        let mut layers = Vec::with_capacity(layout.layers.len());
        for o in &layout.layers {
            layers.push(LayerIdx {
                input_norm: at(o.input_norm)?,
                q: at(o.q)?,
                k: at(o.k)?,
                v: at(o.v)?,
                o: at(o.o)?,
                q_norm: at(o.q_norm)?,
                k_norm: at(o.k_norm)?,
                post_norm: at(o.post_norm)?,
                gate: at(o.gate)?,
                up: at(o.up)?,
                down: at(o.down)?,
            });
        }
        let mut params = Vec::with_capacity(layout.entries.len());
        let mut grads = Vec::with_capacity(layout.entries.len());
        for e in &layout.entries {
            params.push(cuda.upload(&flat[e.offset..e.offset + e.len])?);
            grads.push(cuda.alloc::<f32>(e.len)?);
        }
        let rope = RopeTable::<f32>::new(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings);
        Ok(Self {
            embed: at(layout.embed)?,
            lm_head: at(layout.lm_head)?,
            final_norm: at(layout.final_norm)?,
            layers,
            cos: cuda.upload(&rope.cos)?,
            sin: cuda.upload(&rope.sin)?,
            params,
            grads,
            cfg: cfg.clone(),
            layout,
            cuda: Arc::clone(cuda),
        })
    }

    /// Writes a flat parameter buffer into the tensors.
    pub fn write_params(&self, flat: &[f32]) -> Result<()> {
        for (e, b) in self.layout.entries.iter().zip(&self.params) {
            b.write(0, &flat[e.offset..e.offset + e.len])?;
        }
        Ok(())
    }

    /// Reads tensors (parameters, gradients or moments) back into one flat buffer.
    pub fn read_flat(&self, bufs: &[DBuf<f32>]) -> Result<Vec<f32>> {
        let mut flat = vec![0.0f32; self.layout.total];
        for (e, b) in self.layout.entries.iter().zip(bufs) {
            flat[e.offset..e.offset + e.len].copy_from_slice(&b.read(0, e.len)?);
        }
        Ok(flat)
    }

    /// The attention shape of a launch over `n_q` queries and `n_k` keys.
    pub fn attn(&self, n_q: usize, n_k: usize) -> AttnShape {
        let c = &self.cfg;
        AttnShape {
            n_q,
            n_k,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            hd: c.head_dim,
            scale: plan::attention_scale(c.head_dim),
        }
    }
}

/// Saved activations of one layer (the CPU reference's `LayerActs`).
#[derive(Debug)]
#[allow(missing_docs)]
pub struct LayerActs {
    pub ln1: DBuf<f32>,
    pub ln1_rstd: DBuf<f32>,
    pub q_pre: DBuf<f32>,
    pub q: DBuf<f32>,
    pub q_rstd: DBuf<f32>,
    pub k_pre: DBuf<f32>,
    pub k: DBuf<f32>,
    pub k_rstd: DBuf<f32>,
    pub v: DBuf<f32>,
    pub att_out: DBuf<f32>,
    /// `[lse (n*h), D (n*h)]`.
    pub att_stats: DBuf<f32>,
    pub x_mid: DBuf<f32>,
    pub ln2: DBuf<f32>,
    pub ln2_rstd: DBuf<f32>,
    pub gate: DBuf<f32>,
    pub up: DBuf<f32>,
    pub h: DBuf<f32>,
}

/// Inputs, activations and backward scratch of a packed batch, for up to `cap_n` token
/// rows and `cap_m` scored rows.
#[derive(Debug)]
#[allow(missing_docs)]
pub struct Acts {
    pub cap_n: usize,
    pub cap_m: usize,
    // inputs
    pub ids: DBuf<u32>,
    pub pos: DBuf<u32>,
    pub qmeta: DBuf<u32>,
    pub rows: DBuf<u32>,
    pub targets: DBuf<u32>,
    pub old: DBuf<f32>,
    pub refp: DBuf<f32>,
    pub adv: DBuf<f32>,
    pub wts: DBuf<f32>,
    pub flags: DBuf<u32>,
    // forward
    pub resid: Vec<DBuf<f32>>,
    pub layers: Vec<LayerActs>,
    pub tmp: DBuf<f32>,
    pub lnf: DBuf<f32>,
    pub lnf_rstd: DBuf<f32>,
    pub hsel: DBuf<f32>,
    pub logits: DBuf<f32>,
    pub lp_state: DBuf<f32>,
    pub logp: DBuf<f32>,
    pub entropy: DBuf<f32>,
    pub lse: DBuf<f32>,
    pub loss_stats: DBuf<f32>,
    // backward
    pub dlogp: DBuf<f32>,
    pub dhsel: DBuf<f32>,
    pub dlnf: DBuf<f32>,
    pub dres: DBuf<f32>,
    pub dh: DBuf<f32>,
    pub dgate: DBuf<f32>,
    pub dup: DBuf<f32>,
    pub dln: DBuf<f32>,
    pub datt: DBuf<f32>,
    pub dq: DBuf<f32>,
    pub dk: DBuf<f32>,
    pub dv: DBuf<f32>,
    pub dq_pre: DBuf<f32>,
    pub dk_pre: DBuf<f32>,
}

impl Acts {
    /// Buffers for `cap_n` rows and `cap_m` scored rows.
    pub fn new(cu: &Arc<Cuda>, c: &ModelConfig, cap_n: usize, cap_m: usize) -> Result<Self> {
        let (n, m) = (cap_n, cap_m);
        let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (h, kvh) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let b = |len: usize| cu.alloc::<f32>(len);
        let u = |len: usize| cu.alloc::<u32>(len);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for _ in 0..c.num_hidden_layers {
            layers.push(LayerActs {
                ln1: b(n * d)?,
                ln1_rstd: b(n)?,
                q_pre: b(n * qd)?,
                q: b(n * qd)?,
                q_rstd: b(n * h)?,
                k_pre: b(n * kd)?,
                k: b(n * kd)?,
                k_rstd: b(n * kvh)?,
                v: b(n * kd)?,
                att_out: b(n * qd)?,
                att_stats: b(2 * n * h)?,
                x_mid: b(n * d)?,
                ln2: b(n * d)?,
                ln2_rstd: b(n)?,
                gate: b(n * f)?,
                up: b(n * f)?,
                h: b(n * f)?,
            });
        }
        Ok(Self {
            cap_n,
            cap_m,
            ids: u(n)?,
            pos: u(n)?,
            qmeta: u(2 * n)?,
            rows: u(m)?,
            targets: u(m)?,
            old: b(m)?,
            refp: b(m)?,
            adv: b(m)?,
            wts: b(m)?,
            flags: u(m)?,
            resid: (0..=c.num_hidden_layers)
                .map(|_| b(n * d))
                .collect::<Result<_>>()?,
            layers,
            tmp: b(n * d)?,
            lnf: b(n * d)?,
            lnf_rstd: b(n)?,
            hsel: b(m * d)?,
            logits: b(logits_len(m, v))?,
            lp_state: b(4 * m)?,
            logp: b(m)?,
            entropy: b(m)?,
            lse: b(m)?,
            loss_stats: b(4)?,
            dlogp: b(m)?,
            dhsel: b(m * d)?,
            dlnf: b(n * d)?,
            dres: b(n * d)?,
            dh: b(n * f)?,
            dgate: b(n * f)?,
            dup: b(n * f)?,
            dln: b(n * d)?,
            datt: b(n * qd)?,
            dq: b(n * qd)?,
            dk: b(n * kd)?,
            dv: b(n * kd)?,
            dq_pre: b(n * qd)?,
            dk_pre: b(n * kd)?,
        })
    }
}

/// Makes sure `acts` holds at least `n` rows and `m` scored rows (capacities grow to the
/// next power of two, so a run reallocates O(log n) times, then reuses).
pub fn ensure_acts(
    cu: &Arc<Cuda>,
    c: &ModelConfig,
    acts: &mut Option<Acts>,
    n: usize,
    m: usize,
) -> Result<()> {
    let fits = acts.as_ref().is_some_and(|a| a.cap_n >= n && a.cap_m >= m);
    if !fits {
        *acts = None; // free before allocating the larger set
        *acts = Some(Acts::new(
            cu,
            c,
            plan::capacity(n, 64),
            plan::capacity(m, 64),
        )?);
    }
    Ok(())
}

/// Writes a packed batch's index arrays.
pub fn upload_packed(a: &Acts, b: &Packed) -> Result<()> {
    a.ids.write(0, &b.ids)?;
    a.pos.write(0, &b.pos)?;
    a.qmeta.write(0, &b.qmeta)?;
    a.rows.write(0, &b.rows)?;
    a.targets.write(0, &b.targets)
}

/// The forward over `n` rows up to the final norm and the gather of the `m` scored rows
/// (`hsel`); the lm_head runs per vocabulary chunk in [`logprobs`] / [`backward`].
pub fn forward(md: &DeviceModel, a: &Acts, n: usize, m: usize) -> Result<()> {
    let cu = &*md.cuda;
    let c = &md.cfg;
    let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (qd, kd) = (c.q_dim(), c.kv_dim());
    let eps = c.rms_norm_eps;
    let maxp = c.max_position_embeddings;
    let p = &md.params;
    ops::embedding_fwd(cu, &a.resid[0], &p[md.embed], &a.ids, n, d, v)?;
    for (l, li) in md.layers.iter().enumerate() {
        let la = &a.layers[l];
        let x_in = &a.resid[l];
        ops::rmsnorm_fwd(
            cu,
            &la.ln1,
            &la.ln1_rstd,
            x_in,
            &p[li.input_norm],
            n,
            d,
            eps,
        )?;
        ops::matmul_fwd(cu, &la.q_pre, &la.ln1, &p[li.q], n, d, qd)?;
        ops::matmul_fwd(cu, &la.k_pre, &la.ln1, &p[li.k], n, d, kd)?;
        ops::matmul_fwd(cu, &la.v, &la.ln1, &p[li.v], n, d, kd)?;
        ops::rmsnorm_fwd(
            cu,
            &la.q,
            &la.q_rstd,
            &la.q_pre,
            &p[li.q_norm],
            n * h,
            hd,
            eps,
        )?;
        ops::rmsnorm_fwd(
            cu,
            &la.k,
            &la.k_rstd,
            &la.k_pre,
            &p[li.k_norm],
            n * kvh,
            hd,
            eps,
        )?;
        ops::rope(cu, true, &la.q, &a.pos, &md.cos, &md.sin, n, h, hd, maxp)?;
        ops::rope(cu, true, &la.k, &a.pos, &md.cos, &md.sin, n, kvh, hd, maxp)?;
        ops::attention_fwd(
            cu,
            &la.att_out,
            &la.att_stats,
            &la.q,
            &la.k,
            &la.v,
            &a.qmeta,
            md.attn(n, n),
        )?;
        ops::matmul_fwd(cu, &a.tmp, &la.att_out, &p[li.o], n, qd, d)?;
        ops::residual_fwd(cu, &la.x_mid, x_in, &a.tmp, n * d)?;
        ops::rmsnorm_fwd(
            cu,
            &la.ln2,
            &la.ln2_rstd,
            &la.x_mid,
            &p[li.post_norm],
            n,
            d,
            eps,
        )?;
        ops::matmul_fwd(cu, &la.gate, &la.ln2, &p[li.gate], n, d, f)?;
        ops::matmul_fwd(cu, &la.up, &la.ln2, &p[li.up], n, d, f)?;
        ops::swiglu_fwd(cu, &la.h, &la.gate, &la.up, n * f)?;
        ops::matmul_fwd(cu, &a.tmp, &la.h, &p[li.down], n, f, d)?;
        ops::residual_fwd(cu, &a.resid[l + 1], &la.x_mid, &a.tmp, n * d)?;
    }
    let nl = md.layers.len();
    ops::rmsnorm_fwd(
        cu,
        &a.lnf,
        &a.lnf_rstd,
        &a.resid[nl],
        &p[md.final_norm],
        n,
        d,
        eps,
    )?;
    // Row gather through the embedding kernel: hsel[i] = lnf[rows[i]].
    ops::embedding_fwd(cu, &a.hsel, &a.lnf, &a.rows, m, d, n)
}

/// One vocabulary chunk's logits `[m, len]` (tokens `v0..v0+len`) into `a.logits`.
fn chunk_logits(md: &DeviceModel, a: &Acts, m: usize, v0: usize, len: usize) -> Result<()> {
    let d = md.cfg.hidden_size;
    let w = &md.params[md.lm_head];
    ops::gemm_f32(
        &md.cuda,
        (&a.logits, 0),
        (&a.hsel, 0),
        (w, v0 * d),
        GemmF32::fwd(m, d, len),
    )
}

/// The vocabulary chunks for `m` scored rows with this activation set's scratch.
pub fn chunks(md: &DeviceModel, a: &Acts, m: usize) -> Vec<(usize, usize)> {
    plan::vocab_chunks(m, md.cfg.vocab_size, a.logits.len())
}

/// `logp`, `entropy` and `lse` of the `m` scored rows at `temperature`, chunk by chunk.
pub fn logprobs(md: &DeviceModel, a: &Acts, m: usize, temperature: f64) -> Result<()> {
    let cu = &*md.cuda;
    for (i, (v0, len)) in chunks(md, a, m).into_iter().enumerate() {
        chunk_logits(md, a, m, v0, len)?;
        ops::logprob_fwd_chunk(
            cu,
            &a.lp_state,
            &a.logits,
            &a.targets,
            m,
            len,
            v0,
            i == 0,
            temperature,
        )?;
    }
    ops::logprob_fwd_finish(cu, &a.logp, &a.entropy, &a.lse, &a.lp_state, m)
}

/// Reads the full logits `[m, vocab]` of the scored rows (inspection only), chunk by chunk.
pub fn read_logits(md: &DeviceModel, a: &Acts, m: usize) -> Result<Vec<f32>> {
    let v = md.cfg.vocab_size;
    let mut out = vec![0.0f32; m * v];
    for (v0, len) in chunks(md, a, m) {
        chunk_logits(md, a, m, v0, len)?;
        let part = a.logits.read(0, m * len)?;
        for r in 0..m {
            out[r * v + v0..r * v + v0 + len].copy_from_slice(&part[r * len..(r + 1) * len]);
        }
    }
    Ok(out)
}

/// The loss backward and the model backward, adding into the gradient sums.
pub fn backward(
    md: &DeviceModel,
    a: &Acts,
    n: usize,
    m: usize,
    grpo: Option<(f64, f64, f64)>,
    temperature: f64,
) -> Result<()> {
    let cu = &*md.cuda;
    let c = &md.cfg;
    let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (qd, kd) = (c.q_dim(), c.kv_dim());
    let maxp = c.max_position_embeddings;
    let (p, g) = (&md.params, &md.grads);
    let loss = LossBufs {
        logp: &a.logp,
        old: &a.old,
        refp: &a.refp,
        adv: &a.adv,
        w: &a.wts,
        flags: &a.flags,
    };
    ops::grpo_loss_bwd(cu, &a.dlogp, loss, m, grpo)?;
    // The lm_head per chunk: recompute the logits, turn them into dlogits in place, apply.
    a.dhsel.clear()?;
    let w = &p[md.lm_head];
    for (v0, len) in chunks(md, a, m) {
        chunk_logits(md, a, m, v0, len)?;
        ops::logprob_bwd_chunk(
            cu,
            &a.logits,
            None,
            &a.dlogp,
            &a.lse,
            &a.targets,
            m,
            len,
            v0,
            temperature,
        )?;
        ops::gemm_f32(
            cu,
            (&a.dhsel, 0),
            (&a.logits, 0),
            (w, v0 * d),
            GemmF32::bwd_dx(m, d, len),
        )?;
        ops::gemm_f32(
            cu,
            (&g[md.lm_head], v0 * d),
            (&a.logits, 0),
            (&a.hsel, 0),
            GemmF32::bwd_dw(m, d, len),
        )?;
    }
    // Scatter the selected rows' gradients back (rows are distinct).
    a.dlnf.clear()?;
    ops::embedding_bwd(cu, &a.dlnf, &a.dhsel, &a.rows, m, d, n)?;
    let nl = md.layers.len();
    a.dres.clear()?;
    ops::rmsnorm_bwd(
        cu,
        &a.dres,
        &g[md.final_norm],
        &a.dlnf,
        &a.resid[nl],
        &p[md.final_norm],
        &a.lnf_rstd,
        n,
        d,
    )?;
    for l in (0..nl).rev() {
        let li = &md.layers[l];
        let la = &a.layers[l];
        a.dh.clear()?;
        ops::matmul_bwd(
            cu,
            Some(&a.dh),
            &g[li.down],
            &a.dres,
            &la.h,
            &p[li.down],
            n,
            f,
            d,
        )?;
        a.dgate.clear()?;
        a.dup.clear()?;
        ops::swiglu_bwd(cu, &a.dgate, &a.dup, &a.dh, &la.gate, &la.up, n * f)?;
        a.dln.clear()?;
        ops::matmul_bwd(
            cu,
            Some(&a.dln),
            &g[li.gate],
            &a.dgate,
            &la.ln2,
            &p[li.gate],
            n,
            d,
            f,
        )?;
        ops::matmul_bwd(
            cu,
            Some(&a.dln),
            &g[li.up],
            &a.dup,
            &la.ln2,
            &p[li.up],
            n,
            d,
            f,
        )?;
        ops::rmsnorm_bwd(
            cu,
            &a.dres,
            &g[li.post_norm],
            &a.dln,
            &la.x_mid,
            &p[li.post_norm],
            &la.ln2_rstd,
            n,
            d,
        )?;
        a.datt.clear()?;
        ops::matmul_bwd(
            cu,
            Some(&a.datt),
            &g[li.o],
            &a.dres,
            &la.att_out,
            &p[li.o],
            n,
            qd,
            d,
        )?;
        a.dq.clear()?;
        a.dk.clear()?;
        a.dv.clear()?;
        ops::attention_bwd(
            cu,
            &a.dq,
            &a.dk,
            &a.dv,
            &la.att_stats,
            &a.datt,
            &la.att_out,
            &la.q,
            &la.k,
            &la.v,
            &a.qmeta,
            md.attn(n, n),
        )?;
        ops::rope(cu, false, &a.dq, &a.pos, &md.cos, &md.sin, n, h, hd, maxp)?;
        ops::rope(cu, false, &a.dk, &a.pos, &md.cos, &md.sin, n, kvh, hd, maxp)?;
        a.dq_pre.clear()?;
        ops::rmsnorm_bwd(
            cu,
            &a.dq_pre,
            &g[li.q_norm],
            &a.dq,
            &la.q_pre,
            &p[li.q_norm],
            &la.q_rstd,
            n * h,
            hd,
        )?;
        a.dln.clear()?;
        ops::matmul_bwd(
            cu,
            Some(&a.dln),
            &g[li.q],
            &a.dq_pre,
            &la.ln1,
            &p[li.q],
            n,
            d,
            qd,
        )?;
        a.dk_pre.clear()?;
        ops::rmsnorm_bwd(
            cu,
            &a.dk_pre,
            &g[li.k_norm],
            &a.dk,
            &la.k_pre,
            &p[li.k_norm],
            &la.k_rstd,
            n * kvh,
            hd,
        )?;
        ops::matmul_bwd(
            cu,
            Some(&a.dln),
            &g[li.k],
            &a.dk_pre,
            &la.ln1,
            &p[li.k],
            n,
            d,
            kd,
        )?;
        ops::matmul_bwd(
            cu,
            Some(&a.dln),
            &g[li.v],
            &a.dv,
            &la.ln1,
            &p[li.v],
            n,
            d,
            kd,
        )?;
        ops::rmsnorm_bwd(
            cu,
            &a.dres,
            &g[li.input_norm],
            &a.dln,
            &a.resid[l],
            &p[li.input_norm],
            &la.ln1_rstd,
            n,
            d,
        )?;
    }
    ops::embedding_bwd(cu, &g[md.embed], &a.dres, &a.ids, n, d, v)
}
