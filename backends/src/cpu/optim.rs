//! The optimizer step (`crate::optim::step`) over the CPU backend's flat buffers: parameters,
//! gradient sums and AdamW moments in the layout's order, each tensor a range of them.
//!
//! Moments are allocated at the first step; that step writes them without reading them
//! (`adamw_first_step`, same bits), so their pages are touched once.

use super::ops::{adamw_apply, grad_norm};
use crate::error::{BackendError, Result};
use crate::model::AdamScalars;
use crate::optim::{self, AdamState, AdamW, OptStats, Optimize, ParamGroup};

/// Flat parameters, their gradient sums and moments, split into tensors by `groups`.
pub struct Flat<'a> {
    /// Parameters.
    pub params: &'a mut [f32],
    /// Gradient sums.
    pub grads: &'a [f32],
    /// Moments and step count.
    pub state: &'a mut AdamState,
    /// One group per tensor.
    pub groups: &'a [ParamGroup],
}

impl Optimize for Flat<'_> {
    fn groups(&self, _exclude_norms_from_decay: bool) -> Vec<ParamGroup> {
        // Decay was decided when the groups were made.
        self.groups.to_vec()
    }

    fn grad_sumsq(&mut self) -> Result<f64> {
        Ok(grad_norm(self.grads))
    }

    fn steps(&self) -> u64 {
        if self.state.m.len() == self.params.len() {
            self.state.step
        } else {
            0
        }
    }

    fn adamw(&mut self, t: u64, scalars: &[AdamScalars]) -> Result<()> {
        // Fresh moments are all zero and, allocated zeroed, not yet touched.
        let n = self.params.len();
        let fresh = self.state.m.len() != n;
        if fresh {
            self.state.m = vec![0.0; n];
            self.state.v = vec![0.0; n];
        }
        self.state.step = t;
        let st = &mut *self.state;
        for (g, s) in self.groups.iter().zip(scalars) {
            let r = g.offset..g.offset + g.len;
            let (p, gr) = (&mut self.params[r.clone()], &self.grads[r.clone()]);
            adamw_apply(p, gr, &mut st.m[r.clone()], &mut st.v[r], s, fresh);
        }
        Ok(())
    }
}

/// Normalise, clip and apply AdamW to the flat `params` from the gradient sums `grads`, one
/// tensor per group (the groups carry their decay).
pub fn step(
    params: &mut [f32],
    grads: &[f32],
    state: &mut AdamState,
    groups: &[ParamGroup],
    normalizer: f64,
    opt: &AdamW,
) -> Result<OptStats> {
    if params.len() != grads.len() {
        return Err(BackendError::shape(
            "gradient buffer",
            params.len(),
            grads.len(),
        ));
    }
    let mut f = Flat {
        params,
        grads,
        state,
        groups,
    };
    optim::step(&mut f, normalizer, opt)
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
