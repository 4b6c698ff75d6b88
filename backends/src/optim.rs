//! AdamW with `torch.optim.AdamW` semantics and global-norm clipping (SPEC §6).
//!
//! The step divides the accumulated gradient sums by the step's normaliser, measures the global
//! norm of that scaled gradient, clips it with torch's `clip_grad_norm_` rule
//! `min(1, max_norm / (norm + 1e-6))`, and applies AdamW; the normaliser and clip factor are
//! folded into one scale so the raw sums are never rewritten (they stay readable for tests and
//! `--save-grads`).

use crate::cpu::ops::{adamw_first_step, adamw_step, grad_norm};
use crate::error::{BackendError, Result};

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

/// Normalise, clip and apply AdamW to the flat `params` from the gradient sums `grads`.
///
/// Errors (changing nothing) on a non-positive or non-finite normaliser and on a non-finite
/// gradient norm, so a diverged micro-batch cannot poison the weights.
pub fn step(
    params: &mut [f32],
    grads: &[f32],
    state: &mut AdamState,
    groups: &[ParamGroup],
    normalizer: f64,
    opt: &AdamW,
) -> Result<OptStats> {
    opt.validate()?;
    if !(normalizer.is_finite() && normalizer > 0.0) {
        return Err(BackendError::invalid(
            "normalizer",
            format!("{normalizer} is not a positive finite number"),
        ));
    }
    if params.len() != grads.len() {
        return Err(BackendError::shape(
            "gradient buffer",
            params.len(),
            grads.len(),
        ));
    }
    let norm = grad_norm(grads).sqrt() / normalizer;
    if !norm.is_finite() {
        return Err(BackendError::non_finite("gradient (global norm)"));
    }
    let clip = match opt.max_grad_norm {
        Some(c) => (c / (norm + 1e-6)).min(1.0),
        None => 1.0,
    };
    // Fresh moments are all zero and, allocated zeroed, not yet touched: the first step
    // writes them without reading them (`adamw_first_step`, same bits).
    let fresh = state.m.len() != params.len();
    if fresh {
        state.m = vec![0.0; params.len()];
        state.v = vec![0.0; params.len()];
        state.step = 0;
    }
    state.step += 1;
    let scale = (clip / normalizer) as f32;
    let update = if fresh { adamw_first_step } else { adamw_step };
    for g in groups {
        let r = g.offset..g.offset + g.len;
        let wd = if g.decay { opt.weight_decay } else { 0.0 };
        update(
            &mut params[r.clone()],
            &grads[r.clone()],
            &mut state.m[r.clone()],
            &mut state.v[r],
            scale,
            opt.lr,
            opt.beta1,
            opt.beta2,
            opt.eps,
            wd,
            state.step,
        );
    }
    Ok(OptStats {
        grad_norm: norm,
        clip_scale: clip,
        step: state.step,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_scales_to_max_norm_and_decay_mask_holds() {
        // grads sum [6, 8] over normaliser 2 -> scaled [3, 4], norm 5; clip to 1 -> [0.6, 0.8].
        let mut p = vec![1.0f32, 1.0, 1.0];
        let g = vec![6.0f32, 8.0, 0.0];
        let groups = [
            ParamGroup {
                offset: 0,
                len: 2,
                decay: true,
            },
            ParamGroup {
                offset: 2,
                len: 1,
                decay: false,
            },
        ];
        let opt = AdamW {
            lr: 0.1,
            weight_decay: 0.5,
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let mut st = AdamState::default();
        let s = step(&mut p, &g, &mut st, &groups, 2.0, &opt).unwrap();
        assert!((s.grad_norm - 5.0).abs() < 1e-12);
        assert!((s.clip_scale - 1.0 / (5.0 + 1e-6)).abs() < 1e-12);
        // first Adam step: each coordinate moves by lr·sign(g) after decay 1 − 0.05
        assert!((p[0] - (0.95 - 0.1)).abs() < 1e-6);
        assert!((p[1] - (0.95 - 0.1)).abs() < 1e-6);
        assert_eq!(p[2], 1.0, "zero gradient and no decay leaves it unchanged");
        // moments saw the clipped gradient 0.6, 0.8
        assert!((st.m[0] - 0.06).abs() < 1e-6 && (st.m[1] - 0.08).abs() < 1e-6);
        assert_eq!(st.step, 1);
    }

    #[test]
    fn bad_normaliser_or_gradient_changes_nothing() {
        let mut p = vec![1.0f32];
        let groups = [ParamGroup {
            offset: 0,
            len: 1,
            decay: true,
        }];
        let mut st = AdamState::default();
        let opt = AdamW::default();
        for n in [0.0, -1.0, f64::NAN] {
            assert!(step(&mut p, &[1.0], &mut st, &groups, n, &opt).is_err());
        }
        assert!(matches!(
            step(&mut p, &[f32::INFINITY], &mut st, &groups, 1.0, &opt),
            Err(BackendError::NonFinite { .. })
        ));
        let bad = AdamW {
            beta1: 1.0,
            ..Default::default()
        };
        assert!(step(&mut p, &[1.0], &mut st, &groups, 1.0, &bad).is_err());
        assert_eq!(p, vec![1.0]);
        assert_eq!(st.step, 0);
    }
}
