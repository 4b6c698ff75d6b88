//! The small wgpu engine the engine-level wgpu tests share: GQA 2:1 with 32-wide heads, two
//! layers, peaked weights, and a prompt of two whole KV pages and 5 positions.
use std::sync::Arc;

use rolloutpipe_backends::wgpu::kv::PAGE;
use rolloutpipe_backends::wgpu::{Gpu, WgpuBackend};
use rolloutpipe_backends::*;

use super::device;
use super::engine::peaked_weights;

/// The model, its weights for `seed` and the adapter; `None` where the machine has none.
pub fn setup(seed: u64) -> Option<(ModelConfig, Weights, Arc<Gpu>)> {
    let g = device::gpu()?;
    let cfg = ModelConfig {
        vocab_size: 96,
        hidden_size: 64,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        max_position_embeddings: 256,
        ..ModelConfig::tiny()
    };
    let w = peaked_weights(&cfg, seed);
    Some((cfg, w, g))
}

pub fn engine(cfg: &ModelConfig, w: &Weights, g: &Arc<Gpu>) -> WgpuBackend {
    WgpuBackend::with_gpu(Arc::clone(g), cfg, w).expect("wgpu backend")
}

/// A prompt of two whole pages and 5 positions: a group shares 32 of them.
pub fn prompt() -> Vec<u32> {
    (0..2 * PAGE as u32 + 5).map(|t| (t * 7 + 3) % 96).collect()
}
