//! The Qwen3 model's storage on a CUDA device: one buffer per parameter tensor (gradients and
//! AdamW moments alike) and the RoPE tables. The layer loops are the one model's
//! (`crate::model`), run through `model_ops::CudaOps`: the loops this backend runs are the
//! ones the CPU and wgpu backends prove against PyTorch, so only its kernels remain to prove.
//!
//! The products run on the f32 strided GEMM (`matmul_fwd_f32`), the path that matches the
//! CPU reference within the conformance tolerances; the bf16 tensor-core entries have their
//! own launchers (`ops::matmul_fwd_tc`, `ops::matmul_bwd_tc`), checked against bf16-rounded
//! CPU products, and are not wired into the model yet (docs/cuda.md).

use std::sync::Arc;

use super::device::{Cuda, DBuf};
use super::ops::AttnShape;
use super::plan;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::{Layout, RopeTable};

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
    /// RoPE tables `[max_pos, head_dim/2]` from the CPU reference's own function.
    pub cos: DBuf<f32>,
    /// See `cos`.
    pub sin: DBuf<f32>,
}

impl DeviceModel {
    /// Uploads `flat` (the layout's flat parameter buffer).
    pub fn new(cuda: &Arc<Cuda>, cfg: &ModelConfig, layout: Layout, flat: &[f32]) -> Result<Self> {
        plan::check_head_dim(cfg.head_dim)?;
        let mut params = Vec::with_capacity(layout.entries.len());
        let mut grads = Vec::with_capacity(layout.entries.len());
        for e in &layout.entries {
            params.push(cuda.upload(&flat[e.offset..e.offset + e.len])?);
            grads.push(cuda.alloc::<f32>(e.len)?);
        }
        let rope = RopeTable::<f32>::of(cfg);
        Ok(Self {
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
