//! The message format between the scheduler's proxies (`remote::Forwarding`) and the remote
//! hosts: one frame per message, a JSON header (serde_json) followed by binary parts.
//!
//! ```text
//! b"RPW1" | u32 LE: parts n | n × u64 LE: part lengths | part 0: JSON header | parts 1..n
//! ```
//!
//! Control messages are small JSON values; weights and AdamW moments travel as safetensors
//! blobs (the layout the trainer exports and checkpoints use), so nothing bulky goes through
//! JSON. Floats that feed training (log-probs, rewards) are carried as their bit patterns, so a
//! remote run trains on exactly the values an in-process one would. Decoding never panics: a
//! short, oversized or malformed frame is a [`WireError`].
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, GenRequest, OptStats, RequestKey, ResumeState, SamplingParams, Tensor, Weights,
};
use rolloutpipe_core::{GroupId, PolicyVersion, RequestId};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use super::config::TrainConfig;
use super::workers::{GroupBatch, Sample};
use crate::tasks::Problem;

const MAGIC: &[u8; 4] = b"RPW1";
/// More parts than any message has; a frame claiming more is refused before allocating.
const MAX_PARTS: u32 = 16;

/// Why a frame could not be read.
#[derive(Debug)]
pub enum WireError {
    /// Too short for what it claims, or does not start with the magic.
    Frame(&'static str),
    /// The JSON header does not parse as the expected message.
    Header(serde_json::Error),
    /// A part the message needs is missing.
    Missing(&'static str),
    /// A safetensors part does not load.
    Blob {
        /// Which part.
        what: &'static str,
        /// Why.
        why: String,
    },
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Frame(why) => write!(f, "not a RolloutPipe wire frame: {why}"),
            WireError::Header(e) => write!(f, "bad message header: {e}"),
            WireError::Missing(what) => write!(f, "message is missing its {what} part"),
            WireError::Blob { what, why } => write!(f, "bad {what} blob: {why}"),
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Header(e) => Some(e),
            _ => None,
        }
    }
}

impl From<serde_json::Error> for WireError {
    fn from(e: serde_json::Error) -> Self {
        WireError::Header(e)
    }
}

/// `EngineMsg::Init`'s dtype when a sender predates it.
fn f32_name() -> String {
    "f32".into()
}

/// Frames `header` (as JSON) and `parts`.
pub fn encode<T: Serialize>(header: &T, parts: &[&[u8]]) -> Vec<u8> {
    // Serialising our own message types cannot fail (no maps with non-string keys, no
    // non-finite floats: those travel as bits).
    let head = serde_json::to_vec(header).unwrap_or_default();
    let n = 1 + parts.len();
    let total = 8 + 8 * n + head.len() + parts.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
    }
    out.extend_from_slice(&head);
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

/// Reads a frame: its header as `T` and its binary parts (borrowed from `bytes`).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<(T, Vec<&[u8]>), WireError> {
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(WireError::Frame("no RPW1 magic"));
    }
    let n = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    if n == 0 || n > MAX_PARTS {
        return Err(WireError::Frame("part count out of range"));
    }
    let table_end = 8 + 8 * n as usize;
    let table = bytes
        .get(8..table_end)
        .ok_or(WireError::Frame("truncated part table"))?;
    let mut parts = Vec::with_capacity(n as usize);
    let mut at = table_end;
    for len in table.chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(len);
        let len = usize::try_from(u64::from_le_bytes(b))
            .map_err(|_| WireError::Frame("part length out of range"))?;
        let end = at
            .checked_add(len)
            .ok_or(WireError::Frame("part length out of range"))?;
        parts.push(
            bytes
                .get(at..end)
                .ok_or(WireError::Frame("truncated part"))?,
        );
        at = end;
    }
    if at != bytes.len() {
        return Err(WireError::Frame("trailing bytes after the last part"));
    }
    let header = serde_json::from_slice(parts[0])?;
    parts.remove(0);
    Ok((header, parts))
}

/// Weights as a safetensors blob.
pub fn weights_blob(w: &Weights) -> anyhow::Result<Vec<u8>> {
    Ok(w.to_safetensors_bytes()?)
}

/// Weights from a safetensors blob.
pub fn weights_from(blob: &[u8], what: &'static str) -> Result<Weights, WireError> {
    Weights::from_safetensors_bytes(blob, what).map_err(|e| WireError::Blob {
        what,
        why: e.to_string(),
    })
}

/// AdamW moments as a safetensors blob (`adam.m`, `adam.v`; the step count goes in the header,
/// since f32 cannot hold every u64).
pub fn adam_blob(a: &AdamState) -> anyhow::Result<Vec<u8>> {
    let mut o = Weights::default();
    o.tensors
        .insert("adam.m".into(), Tensor::new(vec![a.m.len()], a.m.clone())?);
    o.tensors
        .insert("adam.v".into(), Tensor::new(vec![a.v.len()], a.v.clone())?);
    Ok(o.to_safetensors_bytes()?)
}

/// AdamW moments from [`adam_blob`]'s blob and the step count.
pub fn adam_from(blob: &[u8], step: u64) -> Result<AdamState, WireError> {
    let o = weights_from(blob, "optimizer")?;
    let get = |k: &str| {
        o.get(k)
            .map(|t| t.data.clone())
            .map_err(|e| WireError::Blob {
                what: "optimizer",
                why: e.to_string(),
            })
    };
    Ok(AdamState {
        m: get("adam.m")?,
        v: get("adam.v")?,
        step,
    })
}

/// `f32`s as their bit patterns (exact through JSON, NaN included).
mod f32_bits {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        v.iter()
            .map(|x| x.to_bits())
            .collect::<Vec<u32>>()
            .serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        Ok(Vec::<u32>::deserialize(d)?
            .into_iter()
            .map(f32::from_bits)
            .collect())
    }
}

/// One `f32` as its bit pattern.
mod f32_bit {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        v.to_bits().serialize(s)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        Ok(f32::from_bits(u32::deserialize(d)?))
    }
}

/// [`SamplingParams`] on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireSampling {
    #[serde(with = "f32_bit")]
    temperature: f32,
    top_k: usize,
    #[serde(with = "f32_bit")]
    top_p: f32,
    max_new_tokens: usize,
    stop_tokens: Vec<u32>,
    seed: u64,
}

impl From<&SamplingParams> for WireSampling {
    fn from(p: &SamplingParams) -> Self {
        WireSampling {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            max_new_tokens: p.max_new_tokens,
            stop_tokens: p.stop_tokens.clone(),
            seed: p.seed,
        }
    }
}

impl From<WireSampling> for SamplingParams {
    fn from(p: WireSampling) -> Self {
        SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            max_new_tokens: p.max_new_tokens,
            stop_tokens: p.stop_tokens,
            seed: p.seed,
        }
    }
}

/// A request for an engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireAdd {
    /// The core's request id.
    pub rid: RequestId,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// Sampling settings (seed included).
    pub params: WireSampling,
}

/// One sequence's log-probs, bit-exact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireLogprobs(#[serde(with = "f32_bits")] pub Vec<f32>);

/// A migrated request's state (long-tail migration): exported by one engine host, resumed by
/// another; see [`ResumeState`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireResume {
    /// The core's request id.
    pub rid: RequestId,
    /// The engine-level request key.
    pub key: u64,
    /// Prompt ids, as the request was asked.
    pub prompt: Vec<u32>,
    /// Sampling settings (seed included).
    pub params: WireSampling,
    /// Tokens generated before the move.
    pub tokens: Vec<u32>,
    /// Their log-probs.
    #[serde(with = "f32_bits")]
    pub logprobs: Vec<f32>,
    /// Position of the request's random stream, in 32-bit words.
    pub stream_words: u128,
}

impl WireResume {
    /// The wire form of request `rid`'s exported state.
    pub fn new(rid: RequestId, st: ResumeState) -> Self {
        WireResume {
            rid,
            key: st.request.id.0,
            params: (&st.request.params).into(),
            prompt: st.request.prompt,
            tokens: st.tokens,
            logprobs: st.logprobs,
            stream_words: st.stream_words,
        }
    }

    /// The request id and the state to resume.
    pub fn into_state(self) -> (RequestId, ResumeState) {
        let st = ResumeState {
            request: GenRequest {
                id: RequestKey(self.key),
                prompt: self.prompt,
                params: self.params.into(),
            },
            tokens: self.tokens,
            logprobs: self.logprobs,
            stream_words: self.stream_words,
        };
        (self.rid, st)
    }
}

/// Scheduler → engine host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineMsg {
    /// Build the engine from the published weights.
    Init {
        /// Engine index.
        engine: u16,
        /// `run.backend`.
        backend: String,
        /// CPU threads.
        threads: usize,
        /// `rollout.dtype`: the engine's weight storage (absent = f32).
        #[serde(default = "f32_name")]
        dtype: String,
        /// The model's `config.json`.
        model: serde_json::Value,
        /// Fault injection (`fault.fail_engine_at_request`).
        fail_at_request: Option<u64>,
        /// Tail multiplexing: the reference weights follow as the message's first part, for
        /// an f32 CPU reference model of the engine's own (absent: none).
        #[serde(default)]
        reference: bool,
        /// `fault.perturb_mux` (tests only).
        #[serde(default)]
        perturb_mux: bool,
        /// `rollout.tensor_cores`: the engine's forward products on tensor cores (wgpu only;
        /// absent = off, as from a sender that predates it).
        #[serde(default)]
        tensor_cores: bool,
        /// `rollout.lookahead`: the engine decodes a step ahead (wgpu only; absent = off, as
        /// from a sender that predates it).
        #[serde(default)]
        lookahead: bool,
    },
    /// Admissions, resumes and cancels, in order, then one decode iteration when `decode`.
    Step {
        /// Requests to add.
        adds: Vec<WireAdd>,
        /// Migrated requests to resume (after the adds; absent: none).
        #[serde(default)]
        resumes: Vec<WireResume>,
        /// Requests to cancel (after the adds and resumes).
        cancels: Vec<RequestId>,
        /// Run one decode iteration.
        decode: bool,
    },
    /// Load the published weights as this version.
    Sync {
        /// The version.
        version: PolicyVersion,
    },
    /// Tail multiplexing: the reference log-probs of one group's sequences at `temperature`,
    /// from the engine's reference model (answered by [`EngineReply::RefLogprobs`]).
    RefLogprobs {
        /// Per sample, (prompt, response).
        seqs: Vec<(Vec<u32>, Vec<u32>)>,
        /// The sampling temperature.
        #[serde(with = "f32_bit")]
        temperature: f32,
    },
    /// Long-tail migration: export the running request that has generated the most tokens,
    /// if at least `min_generated` (answered by [`EngineReply::Migrated`]).
    Migrate {
        /// Fewest tokens generated for a request to move.
        min_generated: u32,
    },
}

/// What an engine reported, on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WireOut {
    /// A finished response.
    Generated {
        /// Request.
        rid: RequestId,
        /// The weights version that generated it.
        version: PolicyVersion,
        /// Response tokens.
        tokens: Vec<u32>,
        /// Their log-probs.
        #[serde(with = "f32_bits")]
        logprobs: Vec<f32>,
    },
    /// A cancel took effect.
    Aborted(RequestId),
    /// Requests lost to an (injected) engine failure.
    Lost(Vec<RequestId>),
}

/// Engine host → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineReply {
    /// Built.
    Ready,
    /// What the step produced, and how many requests still run.
    Stepped {
        /// Reports, in order.
        outs: Vec<WireOut>,
        /// Requests still running.
        active: usize,
        /// Resumed requests whose re-prefill this step's decode ran: (request, tokens
        /// generated before the move, the iteration's seconds).
        #[serde(default)]
        reprefilled: Vec<(RequestId, u32, f64)>,
    },
    /// The reference log-probs asked for, per sample.
    RefLogprobs {
        /// Per sample, its response tokens' log-probs.
        logprobs: Vec<WireLogprobs>,
    },
    /// The exported request (`None`: nothing long enough, or the engine failed).
    Migrated {
        /// Its state.
        moved: Option<WireResume>,
    },
    /// Weights loaded; decode timings since the last sync.
    Synced {
        /// (running requests, seconds) per decode iteration.
        decode: Vec<(u32, f64)>,
    },
    /// The worker hit an error it cannot recover from (the run stops with it).
    Fatal(String),
}

/// One sample of a group, on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireSample {
    sample: u16,
    attempt: u8,
    version: u64,
    tokens: Vec<u32>,
    #[serde(with = "f32_bits")]
    logprobs: Vec<f32>,
    #[serde(with = "f32_bit")]
    reward: f32,
    correct: bool,
}

/// A group for the trainer, on the wire (also the checkpoint's saved form of a pending batch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireGroup {
    step: u64,
    group: u32,
    prompt: Vec<u32>,
    samples: Vec<WireSample>,
    /// Tail multiplexing: the reference log-probs an engine computed, per sample (absent: the
    /// trainer computes them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ref_logprobs: Option<Vec<WireLogprobs>>,
}

impl From<&GroupBatch> for WireGroup {
    fn from(g: &GroupBatch) -> Self {
        WireGroup {
            step: g.step,
            group: g.group.0,
            prompt: g.prompt.to_vec(),
            samples: g
                .samples
                .iter()
                .map(|s| WireSample {
                    sample: s.sample,
                    attempt: s.attempt,
                    version: s.version.0,
                    tokens: s.tokens.clone(),
                    logprobs: s.logprobs.clone(),
                    reward: s.reward,
                    correct: s.correct,
                })
                .collect(),
            ref_logprobs: (g.ref_logprobs.as_ref())
                .map(|l| l.iter().cloned().map(WireLogprobs).collect()),
        }
    }
}

impl From<WireGroup> for GroupBatch {
    fn from(g: WireGroup) -> Self {
        GroupBatch {
            step: g.step,
            group: GroupId(g.group),
            prompt: Arc::new(g.prompt),
            samples: g
                .samples
                .into_iter()
                .map(|s| Sample {
                    sample: s.sample,
                    attempt: s.attempt,
                    version: PolicyVersion(s.version),
                    tokens: s.tokens,
                    logprobs: s.logprobs,
                    reward: s.reward,
                    correct: s.correct,
                })
                .collect(),
            ref_logprobs: (g.ref_logprobs).map(|l| l.into_iter().map(|l| l.0).collect()),
        }
    }
}

/// Scheduler → trainer host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TrainerMsg {
    /// Build the trainer. Parts: weights, then the AdamW moments when `adam_step` is set, then
    /// the KL reference's weights when `reference`.
    Init {
        /// The run's config (objective, optimizer, backend, threads).
        config: Box<TrainConfig>,
        /// The model's `config.json`.
        model: serde_json::Value,
        /// The moments' step count, when moments are sent.
        adam_step: Option<u64>,
        /// A reference model is sent.
        reference: bool,
    },
    /// Accumulate one micro-batch.
    MicroBatch(Vec<WireGroup>),
    /// Apply the optimizer step.
    OptStep,
    /// Export the weights (and the moments when `optimizer`).
    Export {
        /// Include the moments.
        optimizer: bool,
    },
}

/// [`AccumStats`] on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WireAccum {
    loss_sum: f64,
    tokens: usize,
    sequences: usize,
    kl_sum: f64,
    entropy_sum: f64,
    clipped: usize,
}

impl From<&AccumStats> for WireAccum {
    fn from(a: &AccumStats) -> Self {
        WireAccum {
            loss_sum: a.loss_sum,
            tokens: a.tokens,
            sequences: a.sequences,
            kl_sum: a.kl_sum,
            entropy_sum: a.entropy_sum,
            clipped: a.clipped,
        }
    }
}

impl From<WireAccum> for AccumStats {
    fn from(a: WireAccum) -> Self {
        AccumStats {
            loss_sum: a.loss_sum,
            tokens: a.tokens,
            sequences: a.sequences,
            kl_sum: a.kl_sum,
            entropy_sum: a.entropy_sum,
            clipped: a.clipped,
        }
    }
}

/// Trainer host → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TrainerAnswer {
    /// Built.
    Ready,
    /// A micro-batch was accumulated in `secs`.
    MicroBatchDone {
        /// Its sums.
        stats: WireAccum,
        /// Response tokens.
        tokens: usize,
        /// Prompt + response tokens.
        all_tokens: usize,
        /// Seconds on the host.
        secs: f64,
    },
    /// An optimizer step was applied in `secs`.
    OptDone {
        /// Pre-clip gradient norm.
        grad_norm: f64,
        /// Clip scale.
        clip_scale: f64,
        /// Optimizer step count.
        step: u64,
        /// Sums over the step's micro-batches.
        accum: WireAccum,
        /// The normaliser.
        normalizer: f64,
        /// Seconds on the host.
        secs: f64,
    },
    /// Parts: the weights, then the moments when `adam_step` is set.
    Exported {
        /// The moments' step count, when moments are sent.
        adam_step: Option<u64>,
    },
    /// The worker hit an error it cannot recover from.
    Fatal(String),
}

impl TrainerAnswer {
    /// The wire form of an optimizer step's report.
    pub fn opt_done(stats: &OptStats, accum: &AccumStats, normalizer: f64, secs: f64) -> Self {
        TrainerAnswer::OptDone {
            grad_norm: stats.grad_norm,
            clip_scale: stats.clip_scale,
            step: stats.step,
            accum: accum.into(),
            normalizer,
            secs,
        }
    }
}

/// A response to score, on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireJob {
    /// Request.
    pub rid: RequestId,
    /// The problem.
    pub problem: Problem,
    /// Response tokens.
    pub tokens: Vec<u32>,
}

/// Scheduler → verifier host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VerifierMsg {
    /// Build the task and tokenizer of this config.
    Init {
        /// The run's config.
        config: Box<TrainConfig>,
    },
    /// Score these responses.
    Score(Vec<WireJob>),
}

/// One score, on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireScore {
    /// Request.
    pub rid: RequestId,
    /// Reward.
    #[serde(with = "f32_bit")]
    pub reward: f32,
    /// Verified correct.
    pub correct: bool,
    /// Seconds spent verifying.
    pub secs: f64,
}

/// Verifier host → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VerifierReply {
    /// Built.
    Ready,
    /// The scores, in job order.
    Scored(Vec<WireScore>),
    /// The worker hit an error it cannot recover from.
    Fatal(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use rolloutpipe_core::StepId;

    fn rid(g: u32, s: u16) -> RequestId {
        RequestId {
            step: StepId(2),
            group: GroupId(g),
            sample: s,
            attempt: 1,
        }
    }

    #[test]
    fn messages_round_trip_with_their_parts() {
        let msg = EngineMsg::Step {
            adds: vec![WireAdd {
                rid: rid(3, 1),
                prompt: vec![5, 6, 7],
                params: WireSampling::from(&SamplingParams {
                    temperature: 0.7,
                    top_p: 0.9,
                    seed: u64::MAX,
                    ..SamplingParams::default()
                }),
            }],
            resumes: vec![WireResume {
                rid: rid(5, 2),
                key: 77,
                prompt: vec![1, 2],
                params: WireSampling::from(&SamplingParams::default()),
                tokens: vec![9, 8, 7],
                logprobs: vec![-0.5, f32::from_bits(0x3f80_0001), -0.0],
                // Past u64: a ChaCha8 stream position is a u128.
                stream_words: (1u128 << 68) + 3,
            }],
            cancels: vec![rid(4, 0)],
            decode: true,
        };
        let blob = [1u8, 2, 3, 255];
        let bytes = encode(&msg, &[&blob, &[]]);
        let (back, parts): (EngineMsg, _) = decode(&bytes).unwrap();
        assert_eq!(back, msg);
        assert_eq!(parts, vec![&blob[..], &[][..]]);
        // A resumed state comes back as it left, and a Step from before resumes existed
        // still decodes.
        let EngineMsg::Step { resumes, .. } = back else {
            panic!("{back:?}")
        };
        let (r, st) = resumes[0].clone().into_state();
        assert_eq!(WireResume::new(r, st), resumes[0]);
        let old = br#"{"Step":{"adds":[],"cancels":[],"decode":false}}"#;
        let old: serde_json::Value = serde_json::from_slice(old).unwrap();
        let (m, _): (EngineMsg, _) = decode(&encode(&old, &[])).unwrap();
        assert!(matches!(m, EngineMsg::Step { resumes, .. } if resumes.is_empty()));
    }

    #[test]
    fn engine_init_carries_tensor_cores_and_lookahead_and_older_senders_mean_off() {
        let init = EngineMsg::Init {
            engine: 1,
            backend: "wgpu".into(),
            threads: 2,
            dtype: "bf16".into(),
            model: serde_json::json!({"hidden_size": 32}),
            fail_at_request: None,
            reference: false,
            perturb_mux: false,
            tensor_cores: true,
            lookahead: true,
        };
        let (back, _): (EngineMsg, _) = decode(&encode(&init, &[])).unwrap();
        assert_eq!(back, init);
        // An Init from a sender that predates the key (and the dtype) decodes as off (and f32).
        let old = br#"{"Init":{"engine":0,"backend":"wgpu","threads":1,"model":{},"fail_at_request":null}}"#;
        let old: serde_json::Value = serde_json::from_slice(old).unwrap();
        let (m, _): (EngineMsg, _) = decode(&encode(&old, &[])).unwrap();
        let EngineMsg::Init {
            tensor_cores,
            lookahead,
            dtype,
            ..
        } = m
        else {
            panic!("{m:?}")
        };
        assert!(!tensor_cores && !lookahead);
        assert_eq!(dtype, "f32");
    }

    #[test]
    fn floats_cross_bit_exact() {
        // Values whose shortest decimal form would not survive an f64 detour, NaN included.
        let lps = vec![
            f32::from_bits(0x3f80_0001),
            -1.0e-38,
            f32::MIN_POSITIVE / 3.0,
            f32::NAN,
            -0.0,
        ];
        let out = WireOut::Generated {
            rid: rid(1, 2),
            version: PolicyVersion(9),
            tokens: vec![1, 2, 3, 4, 5],
            logprobs: lps.clone(),
        };
        let (back, _): (WireOut, _) = decode(&encode(&out, &[])).unwrap();
        let WireOut::Generated { logprobs, .. } = back else {
            panic!("{back:?}")
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&logprobs), bits(&lps));
    }

    #[test]
    fn weights_and_moments_round_trip_as_safetensors() {
        let cfg = rolloutpipe_backends::ModelConfig::tiny();
        let w = Weights::random(&cfg, 7).unwrap();
        let back = weights_from(&weights_blob(&w).unwrap(), "weights").unwrap();
        assert_eq!(back.tensors.len(), w.tensors.len());
        for (name, t) in &w.tensors {
            assert_eq!(back.tensors[name].shape, t.shape, "{name}");
            assert_eq!(back.tensors[name].data, t.data, "{name}");
        }
        let a = AdamState {
            m: vec![0.5, -0.25, 3.0],
            v: vec![1e-8, 2.0, 0.0],
            step: u64::MAX - 1,
        };
        assert_eq!(adam_from(&adam_blob(&a).unwrap(), a.step).unwrap(), a);
    }

    #[test]
    fn bad_frames_are_errors_not_panics() {
        let good = encode(&TrainerMsg::OptStep, &[b"abc"]);
        // Every truncation, and every single-byte corruption of the frame's fixed fields.
        for n in 0..good.len() {
            assert!(decode::<TrainerMsg>(&good[..n]).is_err(), "prefix {n}");
        }
        for i in 0..24 {
            let mut b = good.clone();
            b[i] ^= 0xA5;
            assert!(decode::<TrainerMsg>(&b).is_err(), "byte {i}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            decode::<TrainerMsg>(&long),
            Err(WireError::Frame(_))
        ));
        // A huge length must not allocate or overflow.
        let mut huge = good.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode::<TrainerMsg>(&huge).is_err());
        // A well-framed header of the wrong message type.
        let other = encode(&VerifierMsg::Score(vec![]), &[]);
        assert!(matches!(
            decode::<TrainerMsg>(&other),
            Err(WireError::Header(_))
        ));
        assert!(weights_from(b"not safetensors", "weights").is_err());
        assert!(adam_from(&weights_blob(&Weights::default()).unwrap(), 1).is_err());
    }
}
