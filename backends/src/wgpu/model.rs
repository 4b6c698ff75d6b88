//! The Qwen3 model's storage on the device: one buffer per parameter tensor (gradients and
//! AdamW moments alike), the RoPE tables, and the weights' 16-bit formats.
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
//! The layer loops are the one model's (`crate::model`), run through `model_ops::WgpuOps`,
//! so a difference between this backend and the CPU reference points at one kernel.

use rolloutpipe_kernels::WeightFormat;
use wgpu::Buffer;

use super::gpu::{Exec, Gpu, Readback, Ticket};
use super::ops;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::{Layout, ParamEntry, RopeTable};
use crate::seam::DType;
use crate::seam::tensor::{round_to_bf16, round_to_f16};

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
        let rope = RopeTable::<f32>::of(cfg);
        Ok(Self {
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
            WeightFormat::Bf16 => round_to_bf16(src).iter().map(|x| x.to_bits()).collect(),
            WeightFormat::F16 => {
                let v = round_to_f16(src);
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
