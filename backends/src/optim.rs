//! AdamW with `torch.optim.AdamW` semantics and global-norm clipping (SPEC §6).
//!
//! The step divides the accumulated gradient sums by the step's normaliser, measures the global
//! norm of that scaled gradient, clips it with torch's `clip_grad_norm_` rule
//! `min(1, max_norm / (norm + 1e-6))`, and applies AdamW; the normaliser and clip factor are
//! folded into one scale so the raw sums are never rewritten (they stay readable for tests and
//! `--save-grads`).

use crate::error::{BackendError, Result};
use crate::model::AdamScalars;

/// Optimizer settings (torch's AdamW defaults, plus clipping and decay options).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the bias-corrected √v.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global-norm clip threshold; `None` disables clipping.
    pub max_grad_norm: Option<f64>,
    /// Exclude RMSNorm weights from weight decay (the HF Trainer convention).
    pub exclude_norms_from_decay: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: Some(1.0),
            exclude_norms_from_decay: false,
        }
    }
}

impl AdamW {
    /// Checks every setting's domain.
    pub fn validate(&self) -> Result<()> {
        let finite_nonneg = [
            ("lr", self.lr),
            ("weight_decay", self.weight_decay),
            ("eps", self.eps),
        ];
        for (what, x) in finite_nonneg {
            if !(x.is_finite() && x >= 0.0) {
                return Err(BackendError::invalid(
                    what,
                    format!("{x} is not a finite number ≥ 0"),
                ));
            }
        }
        for (what, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(BackendError::invalid(what, format!("{b} is not in [0, 1)")));
            }
        }
        if let Some(c) = self.max_grad_norm
            && !(c.is_finite() && c > 0.0)
        {
            return Err(BackendError::invalid(
                "max_grad_norm",
                format!("{c} is not positive"),
            ));
        }
        Ok(())
    }
}

/// Moments of AdamW over the flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdamState {
    /// First moments.
    pub m: Vec<f32>,
    /// Second moments.
    pub v: Vec<f32>,
    /// Steps taken so far.
    pub step: u64,
}

/// What an optimizer step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptStats {
    /// Global L2 norm of the normalised gradient, before clipping.
    pub grad_norm: f64,
    /// Factor the normalised gradient was multiplied by (1 when not clipped).
    pub clip_scale: f64,
    /// The step number just taken (1-based).
    pub step: u64,
}

/// One parameter tensor's place in the flat buffer, and whether it decays.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// Start in the flat buffer.
    pub offset: usize,
    /// Number of values.
    pub len: usize,
    /// Whether weight decay applies.
    pub decay: bool,
}

/// A trainer's parameters, gradient sums and AdamW moments, as the optimizer step sees them.
pub trait Optimize {
    /// One group per tensor, in the order [`Optimize::adamw`] takes their scalars.
    fn groups(&self, exclude_norms_from_decay: bool) -> Vec<ParamGroup>;
    /// Σ g² over every gradient sum, reduced in an order fixed by the shapes.
    fn grad_sumsq(&mut self) -> Result<f64>;
    /// AdamW steps taken so far.
    fn steps(&self) -> u64;
    /// AdamW step `t` of every tensor with its scalars (one per group), in place.
    fn adamw(&mut self, t: u64, scalars: &[AdamScalars]) -> Result<()>;
}

/// Normalise, clip and apply AdamW from the gradient sums: the step every backend takes.
///
/// Errors (changing nothing) on a non-positive or non-finite normaliser and on a non-finite
/// gradient norm, so a diverged micro-batch cannot poison the weights.
pub fn step(o: &mut impl Optimize, normalizer: f64, opt: &AdamW) -> Result<OptStats> {
    opt.validate()?;
    if !(normalizer.is_finite() && normalizer > 0.0) {
        return Err(BackendError::invalid(
            "normalizer",
            format!("{normalizer} is not a positive finite number"),
        ));
    }
    let norm = o.grad_sumsq()?.sqrt() / normalizer;
    if !norm.is_finite() {
        return Err(BackendError::non_finite("gradient (global norm)"));
    }
    let clip = match opt.max_grad_norm {
        Some(c) => (c / (norm + 1e-6)).min(1.0),
        None => 1.0,
    };
    let t = o.steps() + 1;
    let scale = (clip / normalizer) as f32;
    let scalars: Vec<AdamScalars> = o
        .groups(opt.exclude_norms_from_decay)
        .iter()
        .map(|g| {
            let wd = if g.decay { opt.weight_decay } else { 0.0 };
            AdamScalars::new(scale, opt.lr, opt.beta1, opt.beta2, opt.eps, wd, t)
        })
        .collect();
    o.adamw(t, &scalars)?;
    Ok(OptStats {
        grad_norm: norm,
        clip_scale: clip,
        step: t,
    })
}
