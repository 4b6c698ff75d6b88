//! Input limits, checked the same way by every backend before any computation: token ids,
//! sequence lengths, training batches and objectives, scoring calls, generation requests
//! and resumed requests. A refusal names what is wrong in one line.

use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::seam::{GenRequest, Objective, ResumeState, Sequence, TrainBatch};

/// Checks token ids against the vocabulary.
pub fn check_tokens(cfg: &ModelConfig, ids: &[u32], what: &str) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        Some(&id) => Err(BackendError::UnknownToken {
            id,
            vocab: cfg.vocab_size,
            what: what.to_string(),
        }),
        None => Ok(()),
    }
}

/// Checks a scored `(prompt, response)` pair: both non-empty, known tokens, within the
/// position limit.
pub fn check_sequence(
    cfg: &ModelConfig,
    prompt: &[u32],
    response: &[u32],
    what: &str,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(BackendError::EmptyBatch(format!("{what}: empty prompt")));
    }
    if response.is_empty() {
        return Err(BackendError::EmptyBatch(format!("{what}: empty response")));
    }
    check_tokens(cfg, prompt, &format!("{what} prompt"))?;
    check_tokens(cfg, response, &format!("{what} response"))?;
    let n = prompt.len() + response.len();
    if n > cfg.max_position_embeddings {
        return Err(BackendError::shape(
            format!("{what} length"),
            format!(
                "at most max_position_embeddings = {}",
                cfg.max_position_embeddings
            ),
            n,
        ));
    }
    Ok(())
}

/// Checks the ids of a `logits` call: at least one, known, within the position limit.
pub fn check_logits_ids(cfg: &ModelConfig, ids: &[u32]) -> Result<()> {
    if ids.is_empty() {
        return Err(BackendError::EmptyBatch("no token ids".into()));
    }
    check_tokens(cfg, ids, "ids")?;
    if ids.len() > cfg.max_position_embeddings {
        return Err(BackendError::shape(
            "ids length",
            cfg.max_position_embeddings,
            ids.len(),
        ));
    }
    Ok(())
}

/// Checks a scoring (`logprobs`) call: at least one valid sequence, a positive temperature.
pub fn check_scoring<'a>(
    cfg: &ModelConfig,
    seqs: impl ExactSizeIterator<Item = (&'a [u32], &'a [u32])>,
    temperature: f64,
) -> Result<()> {
    if seqs.len() == 0 {
        return Err(BackendError::EmptyBatch("no sequences to score".into()));
    }
    if !(temperature.is_finite() && temperature > 0.0) {
        return Err(BackendError::invalid(
            "temperature",
            format!("{temperature} must be positive"),
        ));
    }
    for (i, (p, r)) in seqs.enumerate() {
        check_sequence(cfg, p, r, &format!("sequence {i}"))?;
    }
    Ok(())
}

/// The `(prompt, response)` pairs of scored sequences.
pub fn pairs(seqs: &[Sequence]) -> Vec<(&[u32], &[u32])> {
    seqs.iter()
        .map(|s| (&s.prompt[..], &s.response[..]))
        .collect()
}

/// The `(prompt, response)` pairs of a training batch.
pub fn train_pairs(batch: &TrainBatch) -> Vec<(&[u32], &[u32])> {
    batch
        .sequences
        .iter()
        .map(|s| (&s.prompt[..], &s.response[..]))
        .collect()
}

fn finite_or(x: f64, what: impl FnOnce() -> String) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(BackendError::non_finite(what()))
    }
}

/// Checks a training micro-batch and objective before any computation.
pub fn validate_train_batch(cfg: &ModelConfig, batch: &TrainBatch, obj: &Objective) -> Result<()> {
    if batch.sequences.is_empty() {
        return Err(BackendError::EmptyBatch(
            "training batch has no sequences".into(),
        ));
    }
    if let Objective::Grpo {
        eps_low,
        eps_high,
        beta,
        temperature,
    } = *obj
    {
        for (what, x) in [("eps_low", eps_low), ("eps_high", eps_high), ("beta", beta)] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(BackendError::invalid(
                    what,
                    format!("{x} is not a finite number ≥ 0"),
                ));
            }
        }
        if eps_low >= 1.0 {
            return Err(BackendError::invalid(
                "eps_low",
                format!("{eps_low} must be below 1"),
            ));
        }
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(BackendError::invalid(
                "temperature",
                format!("{temperature} must be positive"),
            ));
        }
    }
    for (i, s) in batch.sequences.iter().enumerate() {
        let what = format!("sequence {i}");
        check_sequence(cfg, &s.prompt, &s.response, &what)?;
        finite_or(s.advantage, || format!("{what} advantage"))?;
        finite_or(s.weight, || format!("{what} loss weight"))?;
        if s.weight < 0.0 {
            return Err(BackendError::invalid(
                format!("{what} loss weight"),
                "negative",
            ));
        }
        for (name, lp) in [
            ("old_logprobs", &s.old_logprobs),
            ("ref_logprobs", &s.ref_logprobs),
        ] {
            if let Some(lp) = lp {
                if lp.len() != s.response.len() {
                    return Err(BackendError::shape(
                        format!("{what} {name}"),
                        s.response.len(),
                        lp.len(),
                    ));
                }
                if let Some(j) = lp.iter().position(|x| !x.is_finite() || *x > 1e-3) {
                    return Err(if lp[j].is_finite() {
                        // a log-prob above 0 (beyond rounding) means the caller passed something else
                        BackendError::invalid(
                            format!("{what} {name}[{j}]"),
                            format!("{} is a positive log-prob", lp[j]),
                        )
                    } else {
                        BackendError::non_finite(format!("{what} {name}[{j}]"))
                    });
                }
            }
        }
    }
    Ok(())
}

/// Checks a generation request (every backend refuses the same requests the same way).
pub fn validate_request(cfg: &ModelConfig, req: &GenRequest) -> Result<()> {
    let p = &req.params;
    let what = format!("request {}", req.id);
    if req.prompt.is_empty() {
        return Err(BackendError::EmptyBatch(format!("{what}: empty prompt")));
    }
    check_tokens(cfg, &req.prompt, &format!("{what} prompt"))?;
    check_tokens(cfg, &p.stop_tokens, &format!("{what} stop_tokens"))?;
    if !(p.temperature.is_finite() && p.temperature >= 0.0) {
        return Err(BackendError::invalid(
            "temperature",
            format!("{} is not finite and ≥ 0", p.temperature),
        ));
    }
    if !(p.top_p.is_finite() && p.top_p > 0.0 && p.top_p <= 1.0) {
        return Err(BackendError::invalid(
            "top_p",
            format!("{} is not in (0, 1]", p.top_p),
        ));
    }
    if p.max_new_tokens == 0 {
        return Err(BackendError::invalid(
            "max_new_tokens",
            "must be at least 1",
        ));
    }
    let total = req.prompt.len() + p.max_new_tokens;
    if total > cfg.max_position_embeddings {
        return Err(BackendError::shape(
            format!("{what} prompt + max_new_tokens"),
            format!(
                "at most max_position_embeddings = {}",
                cfg.max_position_embeddings
            ),
            total,
        ));
    }
    Ok(())
}

/// Checks an exported state before it is resumed: a valid request that generated at least one
/// token, one log-prob per token, and neither a stop token nor the length cap reached yet.
pub fn validate_resume(cfg: &ModelConfig, st: &ResumeState) -> Result<()> {
    validate_request(cfg, &st.request)?;
    let (what, p) = (
        format!("resumed request {}", st.request.id),
        &st.request.params,
    );
    check_tokens(cfg, &st.tokens, &format!("{what} tokens"))?;
    if st.tokens.is_empty() || st.tokens.len() >= p.max_new_tokens {
        return Err(BackendError::shape(
            format!("{what} tokens"),
            format!("1..{} (max_new_tokens)", p.max_new_tokens),
            st.tokens.len(),
        ));
    }
    if st.logprobs.len() != st.tokens.len() {
        return Err(BackendError::shape(
            format!("{what} logprobs"),
            st.tokens.len(),
            st.logprobs.len(),
        ));
    }
    if st.tokens.iter().any(|t| p.stop_tokens.contains(t)) {
        return Err(BackendError::invalid(
            what,
            "its tokens hold a stop token: it had finished",
        ));
    }
    Ok(())
}

/// Weights cannot change under active requests: their KV caches hold the old weights (one
/// weight version per rollout). Shared by the engine's load and the trainer's import, since
/// one object may hold both roles.
pub fn refuse_while_generating(active: usize) -> Result<()> {
    if active > 0 {
        return Err(BackendError::invalid(
            "weights",
            format!("{active} requests are active; their KV caches hold the old weights"),
        ));
    }
    Ok(())
}

/// Refuses a training call on a model whose weights are stored in 16 bits for generation.
pub fn trainable(stored: crate::seam::DType, what: &str) -> Result<()> {
    if stored != crate::seam::DType::F32 {
        return Err(BackendError::invalid(
            what,
            format!(
                "this backend stores its weights in {stored} for generation only; train on an f32 backend"
            ),
        ));
    }
    Ok(())
}
