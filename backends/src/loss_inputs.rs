//! The per-token inputs of the device loss kernels (WGSL `grpo_loss_fwd.wgsl`, PTX
//! `grpo_loss_fwd.ptx`), built once on the host from a [`TrainBatch`]: one value per response
//! token, in the order of the batch's sequences.
use crate::seam::TrainBatch;

/// Per-token flag bits of the loss kernels.
pub mod flags {
    /// The token is scored (others are skipped).
    pub const SCORED: u32 = 1;
    /// `old_logp` holds a stored value (else the current log-prob, detached: ratio 1).
    pub const HAS_OLD: u32 = 2;
    /// `ref_logp` holds a stored value (else the current log-prob: KL 0).
    pub const HAS_REF: u32 = 4;
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
