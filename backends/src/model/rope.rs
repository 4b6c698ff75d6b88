//! RoPE rotation tables, computed once on the host the way transformers computes them in
//! float32; every backend rotates with these values (the device backends upload them).

use super::real::Real;

/// Precomputed RoPE rotation tables `cos, sin : [max_pos, head_dim/2]`, computed in `T` the way
/// transformers does in float32 (`inv_freq = 1/θ^(2i/hd)`, angle `pos·inv_freq`).
#[derive(Debug, Clone)]
pub struct RopeTable<T> {
    /// cos of the angle, `[max_pos, half]`.
    pub cos: Vec<T>,
    /// sin of the angle, `[max_pos, half]`.
    pub sin: Vec<T>,
    /// `head_dim / 2`.
    pub half: usize,
}

impl<T: Real> RopeTable<T> {
    /// Tables for positions `0..max_pos`.
    pub fn new(head_dim: usize, theta: f64, max_pos: usize) -> Self {
        let half = head_dim / 2;
        let inv: Vec<T> = (0..half)
            .map(|i| {
                T::ONE
                    / T::from_f64(theta)
                        .powf(T::from_f64((2 * i) as f64) / T::from_f64(head_dim as f64))
            })
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in &inv {
                let a = T::from_f64(p as f64) * *f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Self { cos, sin, half }
    }

    /// The tables of `cfg`.
    pub fn of(cfg: &crate::config::ModelConfig) -> Self {
        Self::new(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    }
}
