//! Weights for the 16-bit storage tests (`cpu_half.rs`, `wgpu_half.rs`): peaked random weights
//! and the same rounded to a 16-bit dtype.

use half::{bf16, f16};
use rolloutpipe_backends::{DType, ModelConfig, Weights};

/// `x` rounded to `dtype` and widened back.
pub fn round(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::Bf16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::F32 => x,
    }
}

/// Peaked random weights (scaled 6×, so sampling is sensitive to any numerical difference; norm
/// weights moved away from 1) rounded to `dtype`, and the same weights not rounded:
/// `(rounded, raw)`.
pub fn weights_in(cfg: &ModelConfig, seed: u64, dtype: DType) -> (Weights, Weights) {
    let mut w = Weights::random(cfg, seed).unwrap();
    for (name, t) in w.tensors.iter_mut() {
        if name.ends_with("norm.weight") {
            t.data
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += 0.013 * (i % 7) as f32);
        } else {
            t.data.iter_mut().for_each(|x| *x *= 6.0);
        }
    }
    let mut r = w.clone();
    for t in r.tensors.values_mut() {
        t.data.iter_mut().for_each(|x| *x = round(*x, dtype));
    }
    (r, w)
}
