//! The plain data every backend and the harness exchange: requests, outputs, sequences,
//! training batches and objectives. Nothing here depends on a backend.

use std::fmt;

use crate::grpo::{Aggregation, token_weight};

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

/// How one request samples its continuation.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy argmax (its log-probs are then of the temperature-1
    /// distribution).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Generation stops after this many new tokens (finish reason `Length`).
    pub max_new_tokens: usize,
    /// Generation stops after emitting any of these (finish reason `Stop`; the token is kept).
    pub stop_tokens: Vec<u32>,
    /// Seed of the request's own random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 64,
            stop_tokens: Vec::new(),
            seed: 0,
        }
    }
}

/// A GRPO group: G samples of one prompt. An engine prefills the prompt once and shares its
/// KV prefix across the samples; each sample then decodes with its own id and sampling
/// settings (seed included), exactly as if it had been added alone.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRequest {
    /// The shared prompt (at least one token).
    pub prompt: Vec<u32>,
    /// One `(id, params)` per sample (at least one).
    pub samples: Vec<(RequestKey, SamplingParams)>,
}

impl GroupRequest {
    /// The group as independent requests (what an engine without prefix sharing runs).
    pub fn into_requests(self) -> Vec<GenRequest> {
        let prompt = self.prompt;
        self.samples
            .into_iter()
            .map(|(id, params)| GenRequest {
                id,
                prompt: prompt.clone(),
                params,
            })
            .collect()
    }
}

impl GenRequest {
    /// KV positions the request can occupy: its prompt and its generated tokens.
    pub fn kv_tokens(&self) -> usize {
        self.prompt.len() + self.params.max_new_tokens
    }
}

/// A running request's state, handed from one engine to another (long-tail migration): what
/// it was asked, what it generated so far and where its random stream stands. An engine with
/// the same weights that resumes it prefills prompt + generated tokens again and continues the
/// same seeded stream, so on a batch-invariant backend (the CPU's f32 kernels) its output is
/// bit-identical to the uninterrupted run's.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumeState {
    /// The request as it was added (its id, prompt and sampling settings, seed included).
    pub request: GenRequest,
    /// Tokens generated so far (at least one; none reached a stop token or the length cap).
    pub tokens: Vec<u32>,
    /// Their log-probs.
    pub logprobs: Vec<f32>,
    /// Position of the request's ChaCha8 stream (seeded by `params.seed`), in 32-bit words.
    pub stream_words: u128,
}

impl ResumeState {
    /// Tokens the resuming engine prefills: the prompt and the tokens generated so far.
    pub fn reprefill_tokens(&self) -> usize {
        self.request.prompt.len() + self.tokens.len()
    }
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
