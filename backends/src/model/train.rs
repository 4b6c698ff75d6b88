//! The trainer's calls, written once: scoring (`logprobs`), inspection (`logits`), a GRPO or
//! SFT micro-batch (`accumulate`) and the optimizer step, each checked the same way on every
//! backend before anything runs.

use super::acts::{ActsOf, load};
use super::batch::Packed;
use super::check::{check_logits_ids, check_scoring, train_pairs, validate_train_batch};
use super::forward::{backward, forward};
use super::layout::ParamIds;
use super::loss::{Loss, LossInputs};
use super::ops::{LogProbs, Ops};
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::seam::{AccumStats, Objective, TrainBatch};

/// A model on one backend: its shape and the tensors its loops read.
#[derive(Debug, Clone, Copy)]
pub struct Net<'a> {
    /// The configuration.
    pub cfg: &'a ModelConfig,
    /// The tensors.
    pub ids: &'a ParamIds,
}

impl Net<'_> {
    /// Loads `b` (and its loss inputs) and runs the forward to the log-probs of its targets at
    /// `temperature`, kept with every activation the backward needs.
    pub fn score<'a, O: Ops>(
        &self,
        o: &mut O,
        acts: &'a mut Option<ActsOf<O>>,
        b: &Packed,
        loss: Option<&LossInputs>,
        temperature: f64,
    ) -> Result<&'a mut ActsOf<O>> {
        let c = self.cfg;
        let (n, m) = (b.n(), b.m());
        let a = load(o, c, acts, b, loss)?;
        forward(o, c, self.ids, a, n, m)?;
        let out = LogProbs {
            logp: &mut a.logp,
            entropy: &mut a.entropy,
            lse: &mut a.lse,
        };
        let (d, v) = (c.hidden_size, c.vocab_size);
        o.lm_head_logprob_fwd(
            out,
            &a.hsel,
            self.ids.lm_head,
            &a.targets,
            m,
            d,
            v,
            temperature,
        )?;
        Ok(a)
    }

    /// Per response token log-probs of `seqs` at `temperature` (checked first).
    pub fn logprobs<O: Ops>(
        &self,
        o: &mut O,
        acts: &mut Option<ActsOf<O>>,
        seqs: &[(&[u32], &[u32])],
        temperature: f64,
    ) -> Result<Vec<Vec<f32>>> {
        check_scoring(self.cfg, seqs.iter().copied(), temperature)?;
        let b = Packed::scored(seqs);
        let a = self.score(o, acts, &b, None, temperature)?;
        let lp = o.read(&a.logp, b.m())?;
        let mut out = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for (_, r) in seqs {
            out.push(lp[at..at + r.len()].to_vec());
            at += r.len();
        }
        Ok(out)
    }

    /// The logits `[ids.len(), vocab]` of one sequence at every position (inspection).
    pub fn logits<O: Ops>(
        &self,
        o: &mut O,
        acts: &mut Option<ActsOf<O>>,
        ids: &[u32],
    ) -> Result<Vec<f32>> {
        let c = self.cfg;
        check_logits_ids(c, ids)?;
        let b = Packed::all_positions(ids);
        let n = b.n();
        let a = load(o, c, acts, &b, None)?;
        forward(o, c, self.ids, a, n, n)?;
        o.lm_head_logits(&a.hsel, self.ids.lm_head, n, c.hidden_size, c.vocab_size)
    }

    /// The forward of `obj` on a micro-batch (checked first), its loss sums, and with
    /// `backward` the gradient of Σ weight·loss added into the backend's sums. A non-finite
    /// loss is an error before the backward, leaving the sums untouched.
    pub fn accumulate<O: Ops>(
        &self,
        o: &mut O,
        acts: &mut Option<ActsOf<O>>,
        batch: &TrainBatch,
        obj: &Objective,
        backward_too: bool,
    ) -> Result<AccumStats> {
        validate_train_batch(self.cfg, batch, obj)?;
        let (loss, temperature) = Loss::of(obj);
        let b = Packed::scored(&train_pairs(batch));
        let (n, m) = (b.n(), b.m());
        let inputs = LossInputs::from_batch(batch, m);
        let a = self.score(o, acts, &b, Some(&inputs), temperature)?;
        let lb = a
            .loss
            .as_ref()
            .ok_or_else(|| BackendError::Device("loss inputs missing".into()))?;
        let sums = o.loss_fwd(&a.logp, &a.entropy, lb, m, loss)?;
        let stats = AccumStats {
            loss_sum: sums.loss,
            tokens: m,
            sequences: batch.sequences.len(),
            kl_sum: sums.kl,
            entropy_sum: sums.entropy,
            clipped: sums.clipped,
        };
        if !stats.loss_sum.is_finite() {
            return Err(BackendError::non_finite("loss of the micro-batch"));
        }
        if backward_too {
            o.loss_bwd(&mut a.dlogp, &a.logp, lb, m, loss)?;
            backward(o, self.cfg, self.ids, a, n, m, temperature)?;
        }
        Ok(stats)
    }
}
