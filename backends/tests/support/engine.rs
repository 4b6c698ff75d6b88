//! Helpers of the engine-level tests (`seam.rs`, `wgpu_kv.rs`): peaked random weights,
//! sampling settings, and draining an engine.

use std::collections::BTreeMap;

use rolloutpipe_backends::*;

/// Random weights with the matrices ×4, so that sampling is peaked and any numerical
/// difference changes tokens.
pub fn peaked_weights(cfg: &ModelConfig, seed: u64) -> Weights {
    let mut w = Weights::random(cfg, seed).expect("random weights");
    for (name, t) in w.tensors.iter_mut() {
        if !name.ends_with("norm.weight") {
            t.data.iter_mut().for_each(|x| *x *= 4.0);
        }
    }
    w
}

/// Temperature 0.9, top-k 12.
pub fn params(seed: u64, max_new: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 12,
        max_new_tokens: max_new,
        seed,
        ..Default::default()
    }
}

/// Steps until no request is active; every output by request id (each exactly once).
pub fn drain(be: &mut dyn RolloutEngine) -> BTreeMap<u64, GenOutput> {
    let mut out = BTreeMap::new();
    while be.active_requests() > 0 {
        for o in be.decode_step().expect("step") {
            assert!(out.insert(o.id.0, o).is_none(), "a request finished twice");
        }
    }
    out
}
