//! The trainer pool's cost model: micro-batch time grows with its tokens.
//!
//! A micro-batch runs the old-policy log-prob pass(es) and forward+backward with recompute over
//! every prompt and response token of its groups, spread over the pool's GPUs (data parallel),
//! plus a fixed overhead. The optimizer step and the weight sync are constants.
use super::config::TrainerConfig;
use super::engine::{Ns, secs_to_ns};

/// Costs of the trainer's operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainerModel {
    per_token_s: f64,
    logprob_per_token_s: f64,
    overhead_s: f64,
    optimizer_s: f64,
    sync_s: f64,
}

impl TrainerModel {
    /// From the config.
    pub fn from_config(c: &TrainerConfig) -> Self {
        let gpus = f64::from(c.gpus);
        let logprob_per_token_s =
            f64::from(c.logprob_passes) / (c.logprob_tok_per_s_per_gpu * gpus);
        let per_token_s = 1.0 / (c.fwd_bwd_tok_per_s_per_gpu * gpus) + logprob_per_token_s;
        Self {
            per_token_s,
            logprob_per_token_s,
            overhead_s: c.micro_batch_overhead_s,
            optimizer_s: c.optimizer_step_s,
            sync_s: c.weight_sync_s,
        }
    }

    /// One micro-batch over `tokens` prompt+response tokens.
    pub fn micro_batch_ns(&self, tokens: u64) -> Ns {
        secs_to_ns(self.overhead_s + self.per_token_s * tokens as f64)
    }

    /// One micro-batch over `tokens` tokens of which `precomputed` already have their log-prob
    /// passes (multiplexed onto rollout engines): only forward-backward runs for those.
    pub fn micro_batch_ns_split(&self, tokens: u64, precomputed: u64) -> Ns {
        let precomputed = precomputed.min(tokens);
        secs_to_ns(
            self.overhead_s + self.per_token_s * tokens as f64
                - self.logprob_per_token_s * precomputed as f64,
        )
    }

    /// One optimizer step.
    pub fn optimizer_ns(&self) -> Ns {
        secs_to_ns(self.optimizer_s)
    }

    /// Weight sync to the engines.
    pub fn sync_ns(&self) -> Ns {
        secs_to_ns(self.sync_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::config::SimConfig;

    #[test]
    fn micro_batch_time_is_linear_in_tokens() {
        let c = SimConfig::defaults().unwrap().trainer;
        let m = TrainerModel::from_config(&c);
        // 2 GPUs: 36k tok/s fwd+bwd and 120k tok/s log-prob -> 72,000 tokens = 2.0 + 0.6 s + 0.1 s.
        assert!(m.micro_batch_ns(72_000).abs_diff(2_700_000_000) <= 2);
        assert_eq!(m.micro_batch_ns(0), secs_to_ns(0.1));
        assert_eq!(m.optimizer_ns(), secs_to_ns(0.3));
        // Precomputed log-probs leave forward-backward only: 2.0 + 0.1 s.
        assert!(
            m.micro_batch_ns_split(72_000, 72_000)
                .abs_diff(2_100_000_000)
                <= 2
        );
        assert_eq!(m.micro_batch_ns_split(72_000, 0), m.micro_batch_ns(72_000));
    }
}
