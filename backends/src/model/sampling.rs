//! The sampling rules every backend shares, so that a request's tokens depend only on its
//! seed and the weights: one ChaCha8 stream per request (seeded by its `seed`, one 53-bit
//! uniform per sampled token), the finish rule, and the hand-over of a running request to
//! another engine (long-tail migration).

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::Rng;

use crate::error::BackendError;
use crate::seam::{FinishReason, GenRequest, RequestKey, ResumeState, SamplingParams};

/// 53-bit uniform in [0, 1): one draw per sampled token.
pub fn uniform(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Whether a request ends after emitting `tok` as its `generated`-th token: a stop token ends
/// it (and is kept), else reaching `max_new_tokens` does.
pub fn finish_reason(params: &SamplingParams, tok: u32, generated: usize) -> Option<FinishReason> {
    if params.stop_tokens.contains(&tok) {
        Some(FinishReason::Stop)
    } else if generated >= params.max_new_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// `export_request`'s refusal of a request that has no token to move yet.
pub fn not_started(id: RequestKey) -> BackendError {
    BackendError::invalid(
        "export_request",
        format!("request {id} has not generated a token yet; cancel and re-add it instead"),
    )
}

/// An exported request's state (`prompt` as it was asked), with its stream's position in `rng`.
pub fn exported(
    id: RequestKey,
    prompt: Vec<u32>,
    params: SamplingParams,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    rng: &ChaCha8Rng,
) -> ResumeState {
    ResumeState {
        request: GenRequest { id, prompt, params },
        tokens,
        logprobs,
        stream_words: rng.get_word_pos(),
    }
}

/// One row of a device `sample` kernel: inverse temperature (0 = greedy), top-k (as bits),
/// top-p and the uniform draw rounded down to f32 (so that it stays below 1).
pub fn sample_row(temperature: f32, top_k: usize, top_p: f32, u: f64) -> [f32; 4] {
    let inv = if temperature > 0.0 {
        ((1.0 / temperature as f64) as f32).max(f32::MIN_POSITIVE)
    } else {
        0.0
    };
    let mut uf = u as f32;
    if uf as f64 > u {
        uf = f32::from_bits(uf.to_bits().saturating_sub(1));
    }
    let k = top_k.min(u32::MAX as usize) as u32;
    [inv, f32::from_bits(k), top_p, uf]
}
