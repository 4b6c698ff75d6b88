//! The training objectives as the loss ops take them, and their per-token inputs, built once
//! on the host from a [`TrainBatch`]: one value per response token, in the order of the
//! batch's sequences.

use crate::seam::{Objective, TrainBatch};

/// Per-token flag bits of the loss inputs (the device loss kernels read them as `u32`s).
pub mod flags {
    /// The token is scored (others are skipped).
    pub const SCORED: u32 = 1;
    /// `old_logp` holds a stored value (else the current log-prob, detached: ratio 1).
    pub const HAS_OLD: u32 = 2;
    /// `ref_logp` holds a stored value (else the current log-prob: KL 0).
    pub const HAS_REF: u32 = 4;
}

/// The per-token loss (SPEC §6).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Loss {
    /// Clipped GRPO surrogate with the k3 KL term: with `ρ = exp(logp − old)`,
    /// `w·(−min(ρA, clip(ρ, 1−eps_low, 1+eps_high)·A) + beta·KL)`.
    Grpo {
        /// Lower clip range.
        eps_low: f64,
        /// Upper clip range.
        eps_high: f64,
        /// KL weight.
        beta: f64,
    },
    /// `−w·logp`.
    Sft,
}

impl Loss {
    /// The loss of `obj` and the temperature its log-probs are taken at.
    pub fn of(obj: &Objective) -> (Self, f64) {
        match *obj {
            Objective::Grpo {
                eps_low,
                eps_high,
                beta,
                temperature,
            } => (
                Loss::Grpo {
                    eps_low,
                    eps_high,
                    beta,
                },
                temperature,
            ),
            Objective::Sft => (Loss::Sft, 1.0),
        }
    }
}

/// The four sums of a micro-batch's loss forward.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossSums {
    /// Σ weight·loss.
    pub loss: f64,
    /// Σ KL (unweighted).
    pub kl: f64,
    /// Tokens whose clipped branch is the minimum.
    pub clipped: usize,
    /// Σ entropy.
    pub entropy: f64,
}

impl LossSums {
    /// The sums as the device loss kernels write them: `[Σ w·loss, Σ KL, #clipped,
    /// Σ entropy]` in f32.
    pub fn from_kernel(st: &[f32]) -> Self {
        Self {
            loss: st[0] as f64,
            kl: st[1] as f64,
            clipped: st[2].max(0.0) as usize,
            entropy: st[3] as f64,
        }
    }
}

/// One entry per response token of the batch.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LossInputs {
    /// Old-policy log-probs (0 where the sequence has none).
    pub old: Vec<f32>,
    /// Reference log-probs (0 where the sequence has none).
    pub refp: Vec<f32>,
    /// The sequence's advantage.
    pub adv: Vec<f32>,
    /// The sequence's loss weight.
    pub wts: Vec<f32>,
    /// [`flags`] bits.
    pub flags: Vec<u32>,
}

impl LossInputs {
    /// The inputs of every response token of `batch`; `m` is their total count (capacity).
    pub fn from_batch(batch: &TrainBatch, m: usize) -> Self {
        let mut t = Self {
            old: Vec::with_capacity(m),
            refp: Vec::with_capacity(m),
            adv: Vec::with_capacity(m),
            wts: Vec::with_capacity(m),
            flags: Vec::with_capacity(m),
        };
        for s in &batch.sequences {
            let r = s.response.len();
            let mut f = flags::SCORED;
            match &s.old_logprobs {
                Some(o) => {
                    t.old.extend_from_slice(o);
                    f |= flags::HAS_OLD;
                }
                None => t.old.extend(std::iter::repeat_n(0.0f32, r)),
            }
            match &s.ref_logprobs {
                Some(x) => {
                    t.refp.extend_from_slice(x);
                    f |= flags::HAS_REF;
                }
                None => t.refp.extend(std::iter::repeat_n(0.0f32, r)),
            }
            t.adv.extend(std::iter::repeat_n(s.advantage as f32, r));
            t.wts.extend(std::iter::repeat_n(s.weight as f32, r));
            t.flags.extend(std::iter::repeat_n(f, r));
        }
        t
    }
}
