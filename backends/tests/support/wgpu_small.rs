//! The small wgpu engine the engine-level wgpu tests share: GQA 2:1 with 32-wide heads, two
//! layers, peaked weights, and a prompt of two whole KV pages and 5 positions.
#![allow(dead_code)] // each test crate uses a subset
use std::collections::BTreeMap;
use std::sync::Arc;

use rolloutpipe_backends::wgpu::kv::PAGE;
use rolloutpipe_backends::wgpu::{Gpu, WgpuBackend};
use rolloutpipe_backends::*;

use super::device;
use super::engine::{assert_same_outputs, overlap_start, peaked_weights, poll_until_done};

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

/// The submit/poll scenario ([`overlap_start`]) on `be` against `want` (its blocking run):
/// while the first step is in flight `check` runs and a weights load is refused; every step is
/// then collected without blocking, and the outputs are `want`'s, bit for bit.
pub fn overlap_matches(
    be: &mut WgpuBackend,
    want: &BTreeMap<u64, GenOutput>,
    check: impl FnOnce(&WgpuBackend),
) {
    overlap_start(be);
    check(be);
    let snap = be
        .snapshot_weights(SyncTarget {
            device: DeviceId::Host,
            dtype: DType::F32,
        })
        .unwrap();
    assert!(matches!(
        be.load_weights(&snap),
        Err(BackendError::StepInFlight(_))
    ));
    let mut got: BTreeMap<u64, GenOutput> = (poll_until_done(be).into_iter())
        .map(|o| (o.id.0, o))
        .collect();
    // Every later step the same way: submit, host work, poll without blocking.
    while be.active_requests() > 0 {
        be.submit_step().unwrap();
        got.extend(poll_until_done(be).into_iter().map(|o| (o.id.0, o)));
    }
    assert_same_outputs(&got, want);
    assert_eq!(be.poll_step(false).unwrap(), Some(vec![]));
}
