//! The Qwen3 model on the device: one buffer per parameter tensor (gradients and AdamW
//! moments alike), activations for packed batches, and the forward/backward encoders.
//!
//! Weight storage ([`DeviceModel::weights`]): f32, or for an engine-only model bf16 or f16.
//! A 16-bit model stores its 2-D tensors (embedding, every projection, lm_head: all but
//! ~0.01 % of the values) as 16-bit values packed in pairs, read by the `_as` variants of
//! `embedding_fwd` and `matmul_fwd`, which widen them exactly in registers. Its 1-D tensors
//! (the RMSNorm weights) are rounded to the dtype too but kept as f32 values: the norm
//! kernels read them as f32 in the forward and backward alike, and at Qwen3-0.6B they are
//! 58,368 of 596 M values, so a 16-bit variant of those kernels would save 117 KB. Either way
//! the model computes exactly what an f32 model computes on the same weights rounded to its
//! dtype (the CPU backend's 16-bit store, `cpu::store`, makes the same promise).
//!
//! The structure is the CPU reference's `cpu::model` op for op (same names, same order, same
//! packed rows without padding), so that a difference between the two backends points at
//! one kernel. Activation buffers are sized for a row capacity and only reallocated when a
//! batch needs more rows (to the next power of two), so in steady state a call binds the
//! same buffers and reuses every cached bind group.

use std::collections::HashMap;

use rolloutpipe_kernels::WeightFormat;
use wgpu::Buffer;

use super::gpu::{Exec, Gpu, Readback, Ticket};
use super::lm_head::{self, LmPlan};
use super::ops::{self, Loss};
use crate::config::ModelConfig;
use crate::cpu::model::{Layout, ParamEntry};
use crate::cpu::ops::RopeTable;
use crate::error::{BackendError, Result};
use crate::seam::DType;

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
    /// The configuration.
    pub cfg: ModelConfig,
    /// Tensor names, shapes and flat offsets (shared with the CPU reference).
    pub layout: Layout,
    /// How the 2-D tensors are stored (1-D ones are always f32; see the module docs).
    pub weights: WeightFormat,
    /// One buffer per layout entry.
    pub params: Vec<Buffer>,
    /// Gradient sums, one buffer per layout entry (none for a 16-bit, engine-only model).
    pub grads: Vec<Buffer>,
    /// Entry of `model.embed_tokens.weight`.
    pub embed: usize,
    /// Entry of `lm_head.weight` (the embedding's when tied: both uses add into one tensor).
    pub lm_head: usize,
    /// Entry of `model.norm.weight`.
    pub final_norm: usize,
    /// Per layer.
    pub layers: Vec<LayerIdx>,
    /// RoPE tables `[max_pos, head_dim/2]` from the CPU reference's own function.
    pub cos: Buffer,
    /// See `cos`.
    pub sin: Buffer,
    /// Most bytes one read-back submission of whole tensors stages ([`READ_BATCH_BYTES`];
    /// lowered by `WgpuBackend::cap_read_batch` to test the batching on small models).
    pub read_batch: usize,
}

impl DeviceModel {
    /// Uploads `flat` (the layout's flat parameter buffer), stored as `weights` (rounded to
    /// nearest-even for bf16 and f16; a value beyond f16's range is an error naming its tensor).
    /// Only an f32 model gets gradient buffers.
    pub fn new(
        gpu: &Gpu,
        cfg: &ModelConfig,
        layout: Layout,
        flat: &[f32],
        weights: WeightFormat,
    ) -> Result<Self> {
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
        let params = convert(&layout, flat, weights)?
            .iter()
            .zip(&layout.entries)
            .map(|(words, e)| gpu.upload(&e.name, words))
            .collect();
        let grads = match weights {
            WeightFormat::F32 => layout
                .entries
                .iter()
                .map(|e| gpu.buffer(&format!("grad {}", e.name), e.len))
                .collect(),
            _ => Vec::new(),
        };
        let rope = RopeTable::<f32>::new(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings);
        Ok(Self {
            embed: at(layout.embed)?,
            lm_head: at(layout.lm_head)?,
            final_norm: at(layout.final_norm)?,
            layers,
            cos: gpu.upload("rope cos", &rope.cos),
            sin: gpu.upload("rope sin", &rope.sin),
            weights,
            params,
            grads,
            cfg: cfg.clone(),
            layout,
            read_batch: READ_BATCH_BYTES,
        })
    }

    /// Writes a flat f32 parameter buffer into the tensors, converted to the model's storage
    /// first: a value that does not fit is refused (naming its tensor) before anything is
    /// written.
    pub fn write_params(&self, gpu: &Gpu, flat: &[f32]) -> Result<()> {
        let words = convert(&self.layout, flat, self.weights)?;
        for (w, b) in words.iter().zip(&self.params) {
            gpu.write(b, w);
        }
        Ok(())
    }

    /// The parameters read back and widened to f32 (exact), in the flat layout.
    pub fn read_params(&self, ex: &mut Exec) -> Result<Vec<f32>> {
        let mut flat = vec![0.0f32; self.layout.total];
        let words = |e: &ParamEntry| stored_words(e, self.weights) * 4;
        self.read_each(ex, &self.params, words, |e, back, t| {
            let out = &mut flat[e.offset..e.offset + e.len];
            match (self.weights, half_stored(e, self.weights)) {
                (_, false) => out.copy_from_slice(&back.get::<f32>(t)),
                (f, true) => {
                    let words = back.get::<u32>(t);
                    for (i, o) in out.iter_mut().enumerate() {
                        let bits = (words[i / 2] >> (16 * (i % 2))) as u16;
                        *o = match f {
                            WeightFormat::F16 => half::f16::from_bits(bits).to_f32(),
                            _ => half::bf16::from_bits(bits).to_f32(),
                        };
                    }
                }
            }
        })?;
        Ok(flat)
    }

    /// Reads `bytes(e)` bytes of each entry's buffer back, in submissions that stage at most
    /// `read_batch` bytes (or the device's `max_buffer_size`, if smaller) unless one tensor
    /// alone is larger, and hands them to `put` in layout order. One submission for a whole
    /// 0.6B model would need a 2.4 GB staging buffer, above lavapipe's 2 GiB buffer limit.
    fn read_each(
        &self,
        ex: &mut Exec,
        bufs: &[Buffer],
        bytes: impl Fn(&ParamEntry) -> usize,
        mut put: impl FnMut(&ParamEntry, &Readback, Ticket),
    ) -> Result<()> {
        let device = ex.gpu().device().limits().max_buffer_size;
        let cap = self
            .read_batch
            .min(usize::try_from(device).unwrap_or(usize::MAX));
        let mut pending = Vec::new();
        let mut staged = 0;
        for (e, b) in self.layout.entries.iter().zip(bufs) {
            let n = bytes(e);
            if staged > 0 && staged + n > cap {
                let back = ex.submit()?;
                pending.drain(..).for_each(|(e, t)| put(e, &back, t));
                staged = 0;
            }
            pending.push((e, ex.read_back(b, 0, n)));
            staged += n;
        }
        let back = ex.submit()?;
        pending.drain(..).for_each(|(e, t)| put(e, &back, t));
        Ok(())
    }

    /// Bytes of the parameter buffers as allocated.
    pub fn param_bytes(&self) -> u64 {
        self.params.iter().map(Buffer::size).sum()
    }

    /// Reads tensors (parameters or gradients) back into one flat buffer.
    pub fn read_flat(&self, ex: &mut Exec, bufs: &[Buffer]) -> Result<Vec<f32>> {
        let mut flat = vec![0.0f32; self.layout.total];
        self.read_each(
            ex,
            bufs,
            |e| e.len * 4,
            |e, back, t| {
                flat[e.offset..e.offset + e.len].copy_from_slice(&back.get::<f32>(t));
            },
        )?;
        Ok(flat)
    }
}

/// Bytes one read-back submission stages at most (see `DeviceModel::read_each`).
pub const READ_BATCH_BYTES: usize = 256 << 20;

/// The storage format of a [`DType`].
pub fn weight_format(dtype: DType) -> WeightFormat {
    match dtype {
        DType::F32 => WeightFormat::F32,
        DType::Bf16 => WeightFormat::Bf16,
        DType::F16 => WeightFormat::F16,
    }
}

/// Whether entry `e` is stored in 16 bits under `weights` (2-D tensors of a 16-bit model).
pub fn half_stored(e: &ParamEntry, weights: WeightFormat) -> bool {
    weights != WeightFormat::F32 && e.shape.len() == 2
}

/// 4-byte words of entry `e`'s buffer under `weights`.
pub fn stored_words(e: &ParamEntry, weights: WeightFormat) -> usize {
    if half_stored(e, weights) {
        e.len.div_ceil(2)
    } else {
        e.len
    }
}

/// Bytes of the parameter buffers of `layout` stored as `weights`: what [`DeviceModel::new`]
/// allocates (a buffer holds at least one word), computable without a device.
pub fn param_buffer_bytes(layout: &Layout, weights: WeightFormat) -> u64 {
    layout
        .entries
        .iter()
        .map(|e| stored_words(e, weights).max(1) as u64 * 4)
        .sum()
}

/// The refusal of a tensor with a value past f16's range, wherever it is rounded (here on the
/// host, or on the device by a same-device sync's `weight_cast`).
pub fn f16_overflow(tensor: &str) -> BackendError {
    BackendError::invalid(
        "weight dtype",
        format!("{tensor}: a value does not fit in f16 (|x| <= 65504); use BF16"),
    )
}

/// `flat` converted per tensor to the words each parameter buffer holds under `weights`:
/// f32 bits, or 16-bit values rounded to nearest-even and packed in pairs (`ops::pack_half`);
/// 1-D tensors of a 16-bit model are rounded, then widened back to f32. A value past f16's
/// range is an error naming its tensor.
fn convert(layout: &Layout, flat: &[f32], weights: WeightFormat) -> Result<Vec<Vec<u32>>> {
    if flat.len() != layout.total {
        return Err(BackendError::shape("parameters", layout.total, flat.len()));
    }
    let mut out = Vec::with_capacity(layout.entries.len());
    for e in &layout.entries {
        let src = &flat[e.offset..e.offset + e.len];
        let bits: Vec<u16> = match weights {
            WeightFormat::F32 => {
                out.push(src.iter().map(|x| x.to_bits()).collect());
                continue;
            }
            WeightFormat::Bf16 => crate::cpu::store::round_to_bf16(src)
                .iter()
                .map(|x| x.to_bits())
                .collect(),
            WeightFormat::F16 => {
                let v = crate::cpu::store::round_to_f16(src);
                if v.iter().any(|x| !x.is_finite()) {
                    return Err(f16_overflow(&e.name));
                }
                v.iter().map(|x| x.to_bits()).collect()
            }
        };
        if half_stored(e, weights) {
            out.push(ops::pack_half(&bits));
        } else {
            let widen = |b: u16| match weights {
                WeightFormat::F16 => half::f16::from_bits(b).to_f32(),
                _ => half::bf16::from_bits(b).to_f32(),
            };
            out.push(bits.iter().map(|&b| widen(b).to_bits()).collect());
        }
    }
    Ok(out)
}

/// Saved activations of one layer (the CPU reference's `LayerActs`).
#[derive(Debug)]
#[allow(missing_docs)]
pub struct LayerActs {
    pub ln1: Buffer,
    pub ln1_rstd: Buffer,
    pub q_pre: Buffer,
    pub q: Buffer,
    pub q_rstd: Buffer,
    pub k_pre: Buffer,
    pub k: Buffer,
    pub k_rstd: Buffer,
    pub v: Buffer,
    pub att_out: Buffer,
    /// `[lse (n·h), delta (n·h)]`.
    pub att_stats: Buffer,
    pub x_mid: Buffer,
    pub ln2: Buffer,
    pub ln2_rstd: Buffer,
    pub gate: Buffer,
    pub up: Buffer,
    pub h: Buffer,
}

/// Inputs, activations and backward scratch of a packed batch, for up to `cap_n` token
/// rows and `cap_m` scored rows.
#[derive(Debug)]
#[allow(missing_docs)]
pub struct Acts {
    pub cap_n: usize,
    pub cap_m: usize,
    // inputs
    pub ids: Buffer,
    pub pos: Buffer,
    pub qmeta: Buffer,
    pub rowmeta: Buffer,
    pub rows: Buffer,
    pub targets: Buffer,
    pub old: Buffer,
    pub refp: Buffer,
    pub adv: Buffer,
    pub wts: Buffer,
    pub flags: Buffer,
    // forward
    pub resid: Vec<Buffer>,
    pub layers: Vec<LayerActs>,
    pub tmp: Buffer,
    pub lnf: Buffer,
    pub lnf_rstd: Buffer,
    pub hsel: Buffer,
    pub logp: Buffer,
    pub entropy: Buffer,
    /// Log-sum-exp of each scored row's logits (saved for the backward).
    pub lse: Buffer,
    /// The fused lm_head's running log-sum-exp state, `[rows, 4]`.
    pub lm_state: Buffer,
    /// One vocabulary chunk's logits (and, in the backward, their gradient) for one block of
    /// scored rows: [`LmPlan::scratch_len`] values, instead of `[rows × vocab]`.
    pub lm_scratch: Buffer,
    /// How the fused lm_head splits the vocabulary and the rows for `lm_scratch`.
    pub lm: LmPlan,
    pub loss_stats: Buffer,
    // backward
    pub dlogp: Buffer,
    pub dhsel: Buffer,
    pub dlnf: Buffer,
    pub dres: Buffer,
    pub dh: Buffer,
    pub dgate: Buffer,
    pub dup: Buffer,
    pub dln: Buffer,
    pub datt: Buffer,
    pub dq: Buffer,
    pub dkv: Buffer,
    pub dv: Buffer,
    pub dq_pre: Buffer,
    pub dk_pre: Buffer,
    /// Partial column sums of `rmsnorm_bwd`'s `dw` (its largest call's).
    pub dw_part: Buffer,
    /// [`ops::ScatterIndex`] of `ids` (the embedding gradient's rows).
    pub ids_starts: Buffer,
    pub ids_pairs: Buffer,
    /// [`ops::ScatterIndex`] of `rows` (the selected rows' gradient scatter).
    pub rows_starts: Buffer,
    pub rows_pairs: Buffer,
}

impl Acts {
    /// Buffers for `cap_n` rows and `cap_m` scored rows, the lm_head's scratch for `lm`.
    pub fn new(gpu: &Gpu, c: &ModelConfig, cap_n: usize, cap_m: usize, lm: LmPlan) -> Self {
        let (n, m) = (cap_n, cap_m);
        let (d, f) = (c.hidden_size, c.intermediate_size);
        let (h, kvh) = (c.num_attention_heads, c.num_key_value_heads);
        let (qd, kd) = (c.q_dim(), c.kv_dim());
        let b = |name: &str, len: usize| gpu.buffer(name, len);
        let layers = (0..c.num_hidden_layers)
            .map(|l| {
                let b = |name: &str, len: usize| gpu.buffer(&format!("layer {l} {name}"), len);
                LayerActs {
                    ln1: b("ln1", n * d),
                    ln1_rstd: b("ln1_rstd", n),
                    q_pre: b("q_pre", n * qd),
                    q: b("q", n * qd),
                    q_rstd: b("q_rstd", n * h),
                    k_pre: b("k_pre", n * kd),
                    k: b("k", n * kd),
                    k_rstd: b("k_rstd", n * kvh),
                    v: b("v", n * kd),
                    att_out: b("att_out", n * qd),
                    att_stats: b("att_stats", 2 * n * h),
                    x_mid: b("x_mid", n * d),
                    ln2: b("ln2", n * d),
                    ln2_rstd: b("ln2_rstd", n),
                    gate: b("gate", n * f),
                    up: b("up", n * f),
                    h: b("h", n * f),
                }
            })
            .collect();
        Self {
            cap_n,
            cap_m,
            ids: b("ids", n),
            pos: b("pos", n),
            qmeta: b("qmeta", 2 * n),
            rowmeta: b("rowmeta", 2 * n),
            rows: b("rows", m),
            targets: b("targets", m),
            old: b("old logp", m),
            refp: b("ref logp", m),
            adv: b("advantages", m),
            wts: b("token weights", m),
            flags: b("token flags", m),
            resid: (0..=c.num_hidden_layers)
                .map(|l| b(&format!("resid {l}"), n * d))
                .collect(),
            layers,
            tmp: b("tmp", n * d),
            lnf: b("lnf", n * d),
            lnf_rstd: b("lnf_rstd", n),
            hsel: b("hsel", m * d),
            logp: b("logp", m),
            entropy: b("entropy", m),
            lse: b("lse", m),
            lm_state: b("lm_head state", 4 * m),
            lm_scratch: b("lm_head chunk", lm.scratch_len(m)),
            lm,
            loss_stats: b("loss stats", 4),
            dlogp: b("dlogp", m),
            dhsel: b("dhsel", m * d),
            dlnf: b("dlnf", n * d),
            dres: b("dres", n * d),
            dh: b("dh", n * f),
            dgate: b("dgate", n * f),
            dup: b("dup", n * f),
            dln: b("dln", n * d),
            datt: b("datt", n * qd),
            dq: b("dq", n * qd),
            dkv: b("dkv", 2 * n * kd),
            dv: b("dv", n * kd),
            dq_pre: b("dq_pre", n * qd),
            dk_pre: b("dk_pre", n * kd),
            dw_part: b(
                "rmsnorm dw partials",
                ops::rmsnorm_dw_scratch(n, d)
                    .max(ops::rmsnorm_dw_scratch(n * h, c.head_dim))
                    .max(ops::rmsnorm_dw_scratch(n * kvh, c.head_dim)),
            ),
            ids_starts: b("ids scatter starts", ops::ScatterIndex::starts_len(n)),
            ids_pairs: b("ids scatter pairs", ops::ScatterIndex::pairs_len(n)),
            rows_starts: b("rows scatter starts", ops::ScatterIndex::starts_len(m)),
            rows_pairs: b("rows scatter pairs", ops::ScatterIndex::pairs_len(m)),
        }
    }
}

/// A packed batch as the kernels see it (the CPU reference's `PackedBatch`, plus the
/// per-row attention metadata).
#[derive(Debug, Default, Clone)]
pub struct Packed {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Position of each row in its sequence.
    pub pos: Vec<u32>,
    /// `(start, pos)` per row: the key rows it attends.
    pub qmeta: Vec<u32>,
    /// `(start, len)` per row: its sequence.
    pub rowmeta: Vec<u32>,
    /// Rows whose logits are computed.
    pub rows: Vec<u32>,
    /// The token each selected row predicts.
    pub targets: Vec<u32>,
}

impl Packed {
    /// Packs `(prompt, response)` pairs; the selected rows predict every response token.
    pub fn scored(seqs: &[(&[u32], &[u32])]) -> Self {
        let mut b = Self::default();
        for (prompt, response) in seqs {
            let start = b.ids.len();
            b.ids.extend_from_slice(prompt);
            b.ids.extend_from_slice(response);
            let n = prompt.len() + response.len();
            for t in 0..n {
                b.pos.push(t as u32);
                b.qmeta.extend([start as u32, t as u32]);
                b.rowmeta.extend([start as u32, n as u32]);
            }
            for (t, tok) in response.iter().enumerate() {
                b.rows.push((start + prompt.len() + t - 1) as u32);
                b.targets.push(*tok);
            }
        }
        b
    }

    /// One sequence with logits at every position (targets are unused zeros).
    pub fn all_positions(ids: &[u32]) -> Self {
        let n = ids.len();
        Self {
            ids: ids.to_vec(),
            pos: (0..n as u32).collect(),
            qmeta: (0..n as u32).flat_map(|t| [0, t]).collect(),
            rowmeta: (0..n).flat_map(|_| [0, n as u32]).collect(),
            rows: (0..n as u32).collect(),
            targets: vec![0; n],
        }
    }
}

/// Makes sure `acts` holds at least `n` rows and `m` scored rows; on reallocation the
/// recorder's cached bind groups (which bind the old buffers) are dropped.
pub fn ensure_acts(
    gpu: &Gpu,
    ex: &mut Exec,
    c: &ModelConfig,
    acts: &mut Option<Acts>,
    n: usize,
    m: usize,
) {
    // A changed binding limit (`WgpuBackend::cap_storage_binding`) changes the lm_head plan.
    let lm = LmPlan::new(ex.binding_limit());
    let fits = acts
        .as_ref()
        .is_some_and(|a| a.cap_n >= n && a.cap_m >= m && a.lm == lm);
    if !fits {
        let cap_n = n.next_power_of_two().max(64);
        let cap_m = m.next_power_of_two().max(64);
        *acts = None;
        ex.forget_bind_groups();
        *acts = Some(Acts::new(gpu, c, cap_n, cap_m, lm));
    }
}

/// Writes a packed batch's index arrays.
pub fn upload_packed(gpu: &Gpu, a: &Acts, b: &Packed) {
    gpu.write(&a.ids, &b.ids);
    gpu.write(&a.pos, &b.pos);
    gpu.write(&a.qmeta, &b.qmeta);
    gpu.write(&a.rowmeta, &b.rowmeta);
    gpu.write(&a.rows, &b.rows);
    gpu.write(&a.targets, &b.targets);
}

/// Records the forward over `n` rows up to the final hidden states of the `m` selected rows
/// (`hsel`); the lm_head runs fused with the log-probs (`lm_head::logprob_fwd`).
pub fn encode_forward(ex: &mut Exec, md: &DeviceModel, a: &Acts, n: usize, m: usize) {
    let c = &md.cfg;
    let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (qd, kd) = (c.q_dim(), c.kv_dim());
    let eps = c.rms_norm_eps;
    let maxp = c.max_position_embeddings;
    let p = &md.params;
    let wf = md.weights;
    ops::embedding_fwd_as(ex, &a.resid[0], &a.ids, &p[md.embed], wf, n, d, v);
    for (l, li) in md.layers.iter().enumerate() {
        let la = &a.layers[l];
        let x_in = &a.resid[l];
        ops::rmsnorm_fwd(
            ex,
            &la.ln1,
            &la.ln1_rstd,
            x_in,
            &p[li.input_norm],
            n,
            d,
            eps,
        );
        ops::matmul_fwd_as(ex, &la.q_pre, &la.ln1, &p[li.q], wf, n, d, qd, false);
        ops::matmul_fwd_as(ex, &la.k_pre, &la.ln1, &p[li.k], wf, n, d, kd, false);
        ops::matmul_fwd_as(ex, &la.v, &la.ln1, &p[li.v], wf, n, d, kd, false);
        ops::rmsnorm_fwd(
            ex,
            &la.q,
            &la.q_rstd,
            &la.q_pre,
            &p[li.q_norm],
            n * h,
            hd,
            eps,
        );
        ops::rmsnorm_fwd(
            ex,
            &la.k,
            &la.k_rstd,
            &la.k_pre,
            &p[li.k_norm],
            n * kvh,
            hd,
            eps,
        );
        ops::rope_fwd(ex, &la.q, &a.pos, &md.cos, &md.sin, n, h, hd, maxp);
        ops::rope_fwd(ex, &la.k, &a.pos, &md.cos, &md.sin, n, kvh, hd, maxp);
        ops::attention_fwd(
            ex,
            &la.att_out,
            &la.att_stats,
            &la.q,
            &la.k,
            &la.v,
            &a.qmeta,
            n,
            n,
            h,
            kvh,
            hd,
        );
        ops::matmul_fwd_as(ex, &a.tmp, &la.att_out, &p[li.o], wf, n, qd, d, false);
        ops::residual_fwd(ex, &la.x_mid, x_in, &a.tmp, n * d);
        ops::rmsnorm_fwd(
            ex,
            &la.ln2,
            &la.ln2_rstd,
            &la.x_mid,
            &p[li.post_norm],
            n,
            d,
            eps,
        );
        ops::matmul_fwd_as(ex, &la.gate, &la.ln2, &p[li.gate], wf, n, d, f, false);
        ops::matmul_fwd_as(ex, &la.up, &la.ln2, &p[li.up], wf, n, d, f, false);
        ops::swiglu_fwd(ex, &la.h, &la.gate, &la.up, n * f);
        ops::matmul_fwd_as(ex, &a.tmp, &la.h, &p[li.down], wf, n, f, d, false);
        ops::residual_fwd(ex, &a.resid[l + 1], &la.x_mid, &a.tmp, n * d);
    }
    let nl = md.layers.len();
    ops::rmsnorm_fwd(
        ex,
        &a.lnf,
        &a.lnf_rstd,
        &a.resid[nl],
        &p[md.final_norm],
        n,
        d,
        eps,
    );
    // Row gather through the embedding kernel: hsel[i] = lnf[rows[i]].
    ops::embedding_fwd(ex, &a.hsel, &a.rows, &a.lnf, m, d, n);
}

/// Records the loss backward and the model backward of the packed batch `b` (whose forward
/// was recorded last), adding into the gradient sums.
pub fn encode_backward(
    ex: &mut Exec,
    md: &DeviceModel,
    a: &Acts,
    b: &Packed,
    loss: Loss,
    temperature: f64,
) {
    let (n, m) = (b.ids.len(), b.rows.len());
    // The two scatter-adds' positions grouped by destination row (see `ScatterIndex`),
    // written before this submission runs.
    let ids_ix = ops::ScatterIndex::new(&b.ids, md.cfg.vocab_size);
    let rows_ix = ops::ScatterIndex::new(&b.rows, n);
    let gpu = std::sync::Arc::clone(ex.gpu());
    gpu.write(&a.ids_starts, &ids_ix.starts);
    gpu.write(&a.ids_pairs, &ids_ix.pairs);
    gpu.write(&a.rows_starts, &rows_ix.starts);
    gpu.write(&a.rows_pairs, &rows_ix.pairs);
    let c = &md.cfg;
    let (d, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (h, kvh, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let (qd, kd) = (c.q_dim(), c.kv_dim());
    let maxp = c.max_position_embeddings;
    let (p, g) = (&md.params, &md.grads);
    ops::grpo_loss_bwd(
        ex, &a.dlogp, &a.logp, &a.old, &a.refp, &a.adv, &a.wts, &a.flags, m, loss,
    );
    lm_head::logprob_bwd(ex, md, a, m, temperature);
    // Scatter the selected rows' gradients back (rows are distinct, so no write collides).
    ex.clear(&a.dlnf);
    ops::embedding_bwd(
        ex,
        &a.dlnf,
        &a.dhsel,
        &a.rows_starts,
        &a.rows_pairs,
        rows_ix.touched(),
        d,
        n,
    );
    let nl = md.layers.len();
    ops::rmsnorm_bwd(
        ex,
        &a.dres,
        &g[md.final_norm],
        &a.dw_part,
        &a.dlnf,
        &a.resid[nl],
        &p[md.final_norm],
        &a.lnf_rstd,
        n,
        d,
        false,
    );
    for l in (0..nl).rev() {
        let li = &md.layers[l];
        let la = &a.layers[l];
        ops::matmul_bwd(
            ex,
            Some((&a.dh, false)),
            &g[li.down],
            &a.dres,
            &la.h,
            &p[li.down],
            n,
            f,
            d,
        );
        ops::swiglu_bwd(ex, &a.dgate, &a.dup, &a.dh, &la.gate, &la.up, n * f);
        ops::matmul_bwd(
            ex,
            Some((&a.dln, false)),
            &g[li.gate],
            &a.dgate,
            &la.ln2,
            &p[li.gate],
            n,
            d,
            f,
        );
        ops::matmul_bwd(
            ex,
            Some((&a.dln, true)),
            &g[li.up],
            &a.dup,
            &la.ln2,
            &p[li.up],
            n,
            d,
            f,
        );
        ops::rmsnorm_bwd(
            ex,
            &a.dres,
            &g[li.post_norm],
            &a.dw_part,
            &a.dln,
            &la.x_mid,
            &p[li.post_norm],
            &la.ln2_rstd,
            n,
            d,
            true,
        );
        ops::matmul_bwd(
            ex,
            Some((&a.datt, false)),
            &g[li.o],
            &a.dres,
            &la.att_out,
            &p[li.o],
            n,
            qd,
            d,
        );
        ops::attention_bwd(
            ex,
            &a.dq,
            &a.dkv,
            &la.att_stats,
            &a.datt,
            &la.q,
            &la.k,
            &la.v,
            &la.att_out,
            &a.rowmeta,
            n,
            h,
            kvh,
            hd,
        );
        // dk is the first half of dkv; the ops below read only their first rows·width values.
        ops::rope_bwd(ex, &a.dq, &a.pos, &md.cos, &md.sin, n, h, hd, maxp);
        ops::rope_bwd(ex, &a.dkv, &a.pos, &md.cos, &md.sin, n, kvh, hd, maxp);
        ex.copy(&a.dkv, (n * kd * 4) as u64, &a.dv, 0, (n * kd * 4) as u64);
        ops::rmsnorm_bwd(
            ex,
            &a.dq_pre,
            &g[li.q_norm],
            &a.dw_part,
            &a.dq,
            &la.q_pre,
            &p[li.q_norm],
            &la.q_rstd,
            n * h,
            hd,
            false,
        );
        ops::matmul_bwd(
            ex,
            Some((&a.dln, false)),
            &g[li.q],
            &a.dq_pre,
            &la.ln1,
            &p[li.q],
            n,
            d,
            qd,
        );
        ops::rmsnorm_bwd(
            ex,
            &a.dk_pre,
            &g[li.k_norm],
            &a.dw_part,
            &a.dkv,
            &la.k_pre,
            &p[li.k_norm],
            &la.k_rstd,
            n * kvh,
            hd,
            false,
        );
        ops::matmul_bwd(
            ex,
            Some((&a.dln, true)),
            &g[li.k],
            &a.dk_pre,
            &la.ln1,
            &p[li.k],
            n,
            d,
            kd,
        );
        ops::matmul_bwd(
            ex,
            Some((&a.dln, true)),
            &g[li.v],
            &a.dv,
            &la.ln1,
            &p[li.v],
            n,
            d,
            kd,
        );
        ops::rmsnorm_bwd(
            ex,
            &a.dres,
            &g[li.input_norm],
            &a.dw_part,
            &a.dln,
            &a.resid[l],
            &p[li.input_norm],
            &la.ln1_rstd,
            n,
            d,
            true,
        );
    }
    ops::embedding_bwd(
        ex,
        &g[md.embed],
        &a.dres,
        &a.ids_starts,
        &a.ids_pairs,
        ids_ix.touched(),
        d,
        v,
    );
}
