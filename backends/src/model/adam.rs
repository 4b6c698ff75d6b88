//! The scalars of one AdamW step with `torch.optim.AdamW` semantics (single-tensor path),
//! computed in f64 as torch computes them in Python floats and rounded once to the f32 that
//! every backend's update reads; [`AdamScalars::apply`] is the per-element update in the
//! order every kernel follows, so all backends agree bit for bit.

/// The f32 scalars of one AdamW step of one tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamScalars {
    /// Normaliser and clip factor folded into one gradient scale.
    pub grad_scale: f32,
    /// `1 − lr·wd`.
    pub decay: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
    /// `1 − β1`.
    pub one_minus_beta1: f32,
    /// `β2`.
    pub beta2: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `√(1 − β2^t)`.
    pub sqrt_bc2: f32,
    /// `eps`.
    pub eps: f32,
}

impl AdamScalars {
    /// The scalars of step `t` (1-based) with weight decay `wd` for this tensor.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        grad_scale: f32,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        wd: f64,
        t: u64,
    ) -> Self {
        let ti = t.min(i32::MAX as u64) as i32;
        Self {
            grad_scale,
            decay: (1.0 - lr * wd) as f32,
            step_size: (lr / (1.0 - beta1.powi(ti))) as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            sqrt_bc2: (1.0 - beta2.powi(ti)).sqrt() as f32,
            eps: eps as f32,
        }
    }

    /// One element: with `g = grad·grad_scale`, `p ← p·(1 − lr·wd)`, `m ← m + (1−β₁)(g − m)`
    /// (torch's `lerp`), `v ← β₂v + (1−β₂)g²`, `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps)`;
    /// updates `p` and returns the new moments.
    #[inline(always)]
    pub fn apply(&self, grad: f32, p: &mut f32, m: f32, v: f32) -> (f32, f32) {
        let g = grad * self.grad_scale;
        *p *= self.decay;
        let m = m + self.one_minus_beta1 * (g - m);
        let v = v * self.beta2 + self.one_minus_beta2 * g * g;
        let denom = v.sqrt() / self.sqrt_bc2 + self.eps;
        *p -= self.step_size * (m / denom);
        (m, v)
    }
}
