//! GRPO bookkeeping shared by every backend (SPEC §6): group advantages, per-token loss weights
//! of the aggregation, and the normaliser applied once at the optimizer step.
//!
//! The per-token loss itself is the op pair `grpo_loss_fwd` / `grpo_loss_bwd` in `cpu::ops`.
//! Gradients are accumulated as *unnormalised* sums so that pipelined training (micro-batches as
//! groups complete) and sync training give the same step (SPEC §2): a sequence's per-token weight
//! depends only on itself, and the normaliser only on the whole optimizer step.

use crate::error::{BackendError, Result};
use crate::seam::TrainBatch;

/// How a group's rewards are scaled into advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StdMode {
    /// Divide by the sample standard deviation (ddof = 1, torch's default; TRL, verl, Slime).
    #[default]
    Sample,
    /// Divide by the population standard deviation (ddof = 0).
    Population,
    /// No division, only mean-centering (Dr. GRPO).
    None,
}

/// How per-token losses are averaged over an optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Aggregation {
    /// Mean over all response tokens of the step (DAPO): token weight 1, normaliser = tokens.
    #[default]
    TokenMean,
    /// Mean over each sequence, then over sequences: token weight 1/len, normaliser = sequences.
    SeqMean,
}

/// Advantages `A_j = (r_j − mean) / (std + 1e-6)` of one group's rewards (or `r_j − mean` with
/// [`StdMode::None`]).
///
/// Errors on an empty group, on a non-finite reward, and on a one-sample group with
/// [`StdMode::Sample`] (whose standard deviation is undefined).
pub fn advantages(rewards: &[f64], std: StdMode) -> Result<Vec<f64>> {
    if rewards.is_empty() {
        return Err(BackendError::EmptyBatch("group has no rewards".into()));
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(BackendError::non_finite(format!(
            "reward {i} of the group ({})",
            rewards[i]
        )));
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let ss: f64 = rewards.iter().map(|r| (r - mean) * (r - mean)).sum();
    let denom = match std {
        StdMode::None => 1.0,
        StdMode::Population => (ss / n).sqrt() + 1e-6,
        StdMode::Sample => {
            if rewards.len() < 2 {
                return Err(BackendError::invalid(
                    "std",
                    "sample standard deviation needs at least 2 rewards per group",
                ));
            }
            (ss / (n - 1.0)).sqrt() + 1e-6
        }
    };
    Ok(rewards.iter().map(|r| (r - mean) / denom).collect())
}

/// Per-token loss weight of a response of `len` tokens under `agg`.
pub fn token_weight(agg: Aggregation, len: usize) -> f64 {
    match agg {
        Aggregation::TokenMean => 1.0,
        Aggregation::SeqMean => 1.0 / len.max(1) as f64,
    }
}

/// The normaliser of an optimizer step made of `batches` (all its micro-batches): the number of
/// response tokens (token-mean) or of sequences (seq-mean). Every caller computes it here so
/// that sync and pipelined training divide by the same number.
pub fn normalizer(agg: Aggregation, batches: &[TrainBatch]) -> f64 {
    match agg {
        Aggregation::TokenMean => batches
            .iter()
            .flat_map(|b| &b.sequences)
            .map(|s| s.response.len() as f64)
            .sum(),
        Aggregation::SeqMean => batches.iter().map(|b| b.sequences.len() as f64).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seam::TrainSequence;

    #[test]
    fn advantages_by_mode() {
        let r = [1.0, 0.0, 0.0, 1.0];
        // mean 0.5; sample std = sqrt(1/3), population std = 0.5
        let s = advantages(&r, StdMode::Sample).unwrap();
        assert!((s[0] - 0.5 / ((1.0f64 / 3.0).sqrt() + 1e-6)).abs() < 1e-12);
        let p = advantages(&r, StdMode::Population).unwrap();
        assert!((p[1] + 0.5 / 0.500001).abs() < 1e-12);
        assert_eq!(
            advantages(&r, StdMode::None).unwrap(),
            vec![0.5, -0.5, -0.5, 0.5]
        );
        // equal rewards give zero advantages, not NaN
        assert_eq!(
            advantages(&[1.0, 1.0], StdMode::Sample).unwrap(),
            vec![0.0, 0.0]
        );
    }

    #[test]
    fn advantages_reject_bad_groups() {
        assert!(matches!(
            advantages(&[], StdMode::None),
            Err(BackendError::EmptyBatch(_))
        ));
        assert!(matches!(
            advantages(&[1.0, f64::NAN], StdMode::Sample),
            Err(BackendError::NonFinite { .. })
        ));
        assert!(matches!(
            advantages(&[1.0], StdMode::Sample),
            Err(BackendError::InvalidArgument { .. })
        ));
        assert_eq!(advantages(&[1.0], StdMode::Population).unwrap(), vec![0.0]);
    }

    #[test]
    fn normaliser_and_weights_agree() {
        let seq = |n: usize| TrainSequence::new(vec![1], vec![2; n], 1.0, Aggregation::SeqMean);
        let a = TrainBatch {
            sequences: vec![seq(2), seq(4)],
        };
        let b = TrainBatch {
            sequences: vec![seq(5)],
        };
        assert_eq!(
            normalizer(Aggregation::TokenMean, &[a.clone(), b.clone()]),
            11.0
        );
        assert_eq!(normalizer(Aggregation::SeqMean, &[a.clone(), b]), 3.0);
        // seq-mean weights sum to one per sequence
        for s in &a.sequences {
            assert!((s.weight * s.response.len() as f64 - 1.0).abs() < 1e-15);
        }
        assert_eq!(token_weight(Aggregation::TokenMean, 7), 1.0);
    }

    proptest::proptest! {
        /// Advantages are centred; with a std mode and spread-out rewards their own spread is 1.
        #[test]
        fn advantages_are_centred_and_scaled(rewards in proptest::collection::vec(-100.0f64..100.0, 2..32)) {
            for mode in [StdMode::Sample, StdMode::Population, StdMode::None] {
                let a = advantages(&rewards, mode).unwrap();
                let n = a.len() as f64;
                let mean = a.iter().sum::<f64>() / n;
                proptest::prop_assert!(mean.abs() < 1e-9);
                let ss: f64 = a.iter().map(|x| x * x).sum();
                let spread = match mode {
                    StdMode::Sample => (ss / (n - 1.0)).sqrt(),
                    StdMode::Population => (ss / n).sqrt(),
                    StdMode::None => continue,
                };
                let rs: f64 = rewards.iter().map(|r| (r - rewards.iter().sum::<f64>() / n).powi(2)).sum();
                if rs > 1e-6 {
                    proptest::prop_assert!((spread - 1.0).abs() < 1e-4, "{:?}: {}", mode, spread);
                }
            }
        }
    }
}
