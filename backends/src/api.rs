//! The policy-backend interface: what rollout engines and the trainer need from any backend.
//!
//! One object-safe trait, [`PolicyBackend`], so the harness can hold `Box<dyn PolicyBackend>`
//! and drive the CPU reference, wgpu or CUDA alike: weights in and out, continuous-batching
//! generation with per-request seeded sampling, log-probs of given sequences, and GRPO (or SFT)
//! training that accumulates unnormalised gradient sums until an optimizer step applies the
//! normaliser (SPEC §2, §6).

use std::fmt;

use crate::config::ModelConfig;
pub use crate::cpu::ops::{GrpoCoefs, SamplingParams};
use crate::error::Result;
use crate::grpo::{Aggregation, token_weight};
pub use crate::optim::{AdamState, AdamW, OptStats};
use crate::weights::Weights;

/// Identifies one generation request within an engine (the caller maps its own request identity,
/// e.g. `(step, group, sample, attempt)`, to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestKey(pub u64);

impl fmt::Display for RequestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A generation request: a prompt and how to sample its continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// Engine-unique id while the request is active.
    pub id: RequestKey,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Sampling settings, including the request's seed.
    pub params: SamplingParams,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was emitted (it is the last token of the output).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenOutput {
    /// The request.
    pub id: RequestKey,
    /// Generated tokens (the stop token included when `finish` is `Stop`).
    pub tokens: Vec<u32>,
    /// Per generated token, its log-prob under the sampling distribution
    /// `log_softmax(logits / T)` (T = 1 for greedy requests).
    pub logprobs: Vec<f32>,
    /// Why generation ended.
    pub finish: FinishReason,
}

/// A prompt and a response whose tokens are scored.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    /// Prompt ids (at least one: the first response token is predicted from the last prompt
    /// position).
    pub prompt: Vec<u32>,
    /// Response ids (at least one).
    pub response: Vec<u32>,
}

/// One trained response.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSequence {
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Response ids; the loss covers these.
    pub response: Vec<u32>,
    /// The response's advantage (applies to all its tokens; unused by SFT).
    pub advantage: f64,
    /// Per-response-token log-probs under the rollout weights `v_k`; `None` uses the current
    /// weights' log-probs, detached (ρ = 1 on the first optimizer step of a rollout).
    pub old_logprobs: Option<Vec<f32>>,
    /// Per-response-token log-probs under the reference model; `None` uses the current weights'
    /// (KL term and its gradient are then zero).
    pub ref_logprobs: Option<Vec<f32>>,
    /// Per-token loss weight from the aggregation (1 for token-mean, 1/len for seq-mean).
    pub weight: f64,
}

impl TrainSequence {
    /// A sequence with the per-token weight of `agg` and no stored log-probs.
    pub fn new(prompt: Vec<u32>, response: Vec<u32>, advantage: f64, agg: Aggregation) -> Self {
        let weight = token_weight(agg, response.len());
        Self {
            prompt,
            response,
            advantage,
            old_logprobs: None,
            ref_logprobs: None,
            weight,
        }
    }
}

/// A micro-batch: the sequences of `m` groups.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrainBatch {
    /// The responses (any order; groups are flattened).
    pub sequences: Vec<TrainSequence>,
}

impl TrainBatch {
    /// Number of response tokens.
    pub fn response_tokens(&self) -> usize {
        self.sequences.iter().map(|s| s.response.len()).sum()
    }
}

/// What `accumulate` optimises.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    /// The GRPO clipped surrogate with k3 KL (SPEC §6); log-probs at `temperature`.
    Grpo {
        /// Lower clip range.
        eps_low: f64,
        /// Upper clip range.
        eps_high: f64,
        /// KL weight.
        beta: f64,
        /// Sampling temperature of the rollout (log-probs are of `logits / temperature`).
        temperature: f64,
    },
    /// Cross-entropy on response tokens (SFT warm start); the loss is `−weight·logp`.
    Sft,
}

impl Default for Objective {
    fn default() -> Self {
        Self::Grpo {
            eps_low: 0.2,
            eps_high: 0.2,
            beta: 0.0,
            temperature: 1.0,
        }
    }
}

/// Sums over the response tokens of the accumulated micro-batches (divide by `tokens` or by the
/// normaliser to report means).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AccumStats {
    /// Σ weight·loss over tokens (the quantity whose gradient was accumulated).
    pub loss_sum: f64,
    /// Number of response tokens.
    pub tokens: usize,
    /// Number of sequences.
    pub sequences: usize,
    /// Σ k3 KL over tokens (unweighted).
    pub kl_sum: f64,
    /// Σ entropy of the sampling distribution over tokens.
    pub entropy_sum: f64,
    /// Tokens whose clipped branch was active (zero surrogate gradient).
    pub clipped: usize,
}

impl AccumStats {
    /// Fraction of tokens clipped.
    pub fn clip_fraction(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.clipped as f64 / self.tokens as f64
        }
    }

    /// Adds another micro-batch's sums.
    pub fn merge(&mut self, o: &AccumStats) {
        self.loss_sum += o.loss_sum;
        self.tokens += o.tokens;
        self.sequences += o.sequences;
        self.kl_sum += o.kl_sum;
        self.entropy_sum += o.entropy_sum;
        self.clipped += o.clipped;
    }
}

/// A policy backend: a Qwen3 model that generates, scores and trains.
pub trait PolicyBackend: Send {
    /// Short backend name (`"cpu"`, `"wgpu"`, ...).
    fn name(&self) -> &'static str;
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// A copy of the current weights (for weight sync and saving).
    fn export_weights(&self) -> Result<Weights>;
    /// Replaces the weights (validated against the config). Refused while requests are active,
    /// since their KV caches belong to the old weights (one weight version per rollout). The
    /// optimizer state and gradient sums are kept: restoring a checkpoint restores them too.
    fn import_weights(&mut self, w: &Weights) -> Result<()>;
    /// Queues a request; it is prefilled at the next `decode_step`.
    fn add_request(&mut self, req: GenRequest) -> Result<()>;
    /// Aborts an active request and frees its KV cache.
    fn cancel_request(&mut self, id: RequestKey) -> Result<()>;
    /// One engine step: prefills the newly added requests and generates one token for every
    /// active request; returns the requests that finished in this step.
    fn decode_step(&mut self) -> Result<Vec<GenOutput>>;
    /// Requests added and not yet finished or cancelled.
    fn active_requests(&self) -> usize;
    /// Per response token of each sequence, `log_softmax(logits / temperature)` at that token.
    fn logprobs(&mut self, seqs: &[Sequence], temperature: f32) -> Result<Vec<Vec<f32>>>;
    /// Logits at every position of one sequence, `[ids.len(), vocab]` row-major (inspection and
    /// parity checks).
    fn logits(&mut self, ids: &[u32]) -> Result<Vec<f32>>;
    /// Clears the gradient sums.
    fn zero_grad(&mut self);
    /// Forward and backward of `obj` on a micro-batch, adding the unnormalised gradient of
    /// Σ weight·loss to the gradient sums.
    fn accumulate(&mut self, batch: &TrainBatch, obj: &Objective) -> Result<AccumStats>;
    /// Divides the gradient sums by `normalizer`, clips, applies AdamW; returns the pre-clip
    /// norm. The sums are left as they were (call `zero_grad` before the next step).
    fn optimizer_step(&mut self, normalizer: f64, opt: &AdamW) -> Result<OptStats>;
    /// The raw gradient sums under the parameters' names (before normalising and clipping).
    fn gradients(&self) -> Result<Weights>;
    /// The AdamW moments and step count, in the flat parameter layout every backend shares, for
    /// checkpoints (a fresh optimizer has empty moments).
    fn export_optimizer_state(&self) -> Result<AdamState>;
    /// Restores a state from any backend's [`PolicyBackend::export_optimizer_state`] (empty
    /// moments mean a fresh optimizer); a state of another model's size is a shape error.
    fn import_optimizer_state(&mut self, state: AdamState) -> Result<()>;
}
