//! The messages between the scheduler thread and its workers: one vocabulary for every carrier.
//! In process they travel on channels (`workers`); to remote hosts each is the JSON header of
//! a wire frame (`remote::protocol` batches them, `remote::wire` frames them); a one-step-off
//! checkpoint stores its pending groups as [`GroupBatch`]es. Floats that feed training travel
//! as their bit patterns ([`bits`]), so every carrier delivers exactly the values sent.
//!
//! What only exists in process is marked so: the weights a sync loads (`Arc`s of tensors;
//! remote engines read a published blob instead) and the local timestamps the scheduler puts
//! on events as they arrive.
pub mod bits;
pub mod seam;

use std::sync::Arc;
use std::time::Instant;

use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    AccumStats, DType, OptStats, ResumeState, SamplingParams, Sequence, WeightSnapshot, Weights,
};
use rolloutpipe_core::{GroupId, PolicyVersion, RequestId};
use serde::{Deserialize, Serialize};

use crate::tasks::Problem;

/// One generated, scored response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Sample index in its group.
    pub sample: u16,
    /// The attempt that produced it.
    pub attempt: u8,
    /// The weights version that generated it.
    pub version: PolicyVersion,
    /// Response tokens.
    pub tokens: Vec<u32>,
    /// Rollout log-probs of the response tokens.
    #[serde(with = "bits")]
    pub logprobs: Vec<f32>,
    /// Reward (set once the verifier answered).
    #[serde(with = "bits")]
    pub reward: f32,
    /// Verified correct.
    pub correct: bool,
}

/// A complete group handed to the trainer (and kept in a one-step-off checkpoint).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupBatch {
    /// The step it was generated in.
    pub step: u64,
    /// The group.
    pub group: GroupId,
    /// Prompt ids.
    pub prompt: Arc<Vec<u32>>,
    /// Its samples, by sample index.
    pub samples: Vec<Sample>,
    /// The KL reference log-probs of each sample's response, when a rollout engine computed
    /// them (tail multiplexing); the trainer computes the missing ones itself.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "bits")]
    pub ref_logprobs: Option<Vec<Vec<f32>>>,
}

/// A request for an engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Add {
    /// The core's request id.
    pub rid: RequestId,
    /// Prompt ids.
    pub prompt: Arc<Vec<u32>>,
    /// Sampling settings (seed included).
    #[serde(with = "seam::Sampling")]
    pub params: SamplingParams,
}

/// A running request exported by one engine to be resumed by another (long-tail migration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Moved {
    /// The core's request id.
    pub rid: RequestId,
    /// What the source engine exported.
    #[serde(with = "seam::Resume")]
    pub state: ResumeState,
}

/// Tail multiplexing: the KL reference log-probs of a dispatched group's sequences.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefPass {
    /// The step whose group it is.
    pub step: u64,
    /// The group's position in the step's dispatch order.
    pub index: usize,
    /// Its sequences, by sample index.
    #[serde(with = "seam::sequences")]
    pub seqs: Vec<Sequence>,
    /// The sampling temperature the log-probs are taken at.
    #[serde(with = "bits")]
    pub temperature: f32,
}

/// A finished [`RefPass`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefDone {
    /// The step whose group it is.
    pub step: u64,
    /// The group's position in the step's dispatch order.
    pub index: usize,
    /// Per sample, its response tokens' reference log-probs.
    #[serde(with = "bits")]
    pub logprobs: Vec<Vec<f32>>,
}

/// How a rollout engine is built, besides its backend name, model and weights: the
/// `[rollout]` settings that shape an engine (and travel in a remote engine's `Init`; a
/// sender that names none of the optional ones means f32 and off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineOptions {
    /// CPU threads of the engine's backend (`rollout.threads_per_engine`; ignored by GPU
    /// backends).
    pub threads: usize,
    /// Weight storage (`rollout.dtype`).
    #[serde(with = "seam::dtype", default = "seam::dtype::f32")]
    pub dtype: DType,
    /// Forward products on tensor cores (`rollout.tensor_cores`; wgpu only).
    #[serde(default)]
    pub tensor_cores: bool,
    /// Look-ahead decoding (`rollout.lookahead`; wgpu only).
    #[serde(default)]
    pub lookahead: bool,
}

/// Scheduler → engine.
#[derive(Debug)]
pub enum EngineCmd {
    /// Start generating a request.
    Add(Add),
    /// Abort a request.
    Cancel(RequestId),
    /// Continue an exported request here: re-prefill, then the same seeded stream.
    Resume(Box<Moved>),
    /// Replace the weights (between steps, nothing in flight) as this version. In process
    /// only: a remote engine is sent the version and reads the published weights.
    Sync {
        /// A snapshot made for this engine's `SyncTarget` (in-process engines), or `None` for
        /// an engine that converts `master` itself (a remote host).
        snap: Option<Arc<WeightSnapshot>>,
        /// The trainer's f32 master weights.
        master: Arc<Weights>,
        /// Their version.
        version: PolicyVersion,
    },
    /// Tail multiplexing: a reference pass with the engine's reference model.
    RefLogprobs(RefPass),
    /// Long-tail migration (`rollout.migrate`): export the running request that has generated
    /// the most tokens, if at least `min_generated` ([`Event::Migrated`] answers either way).
    Migrate {
        /// The fewest tokens a request must have generated to move.
        min_generated: u32,
    },
    /// Stop the thread.
    Shutdown,
}

/// What became of an engine's request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineOut {
    /// It finished generating.
    Generated {
        /// Request.
        rid: RequestId,
        /// The engine's weights version.
        version: PolicyVersion,
        /// Response tokens.
        tokens: Vec<u32>,
        /// Their log-probs.
        #[serde(with = "bits")]
        logprobs: Vec<f32>,
    },
    /// A cancel took effect.
    Aborted(RequestId),
    /// The engine failed (an injected fault): these requests will never finish, and are
    /// retried as failures.
    Lost(Vec<RequestId>),
    /// The engine is gone (its process or connection went away), not the requests: they are
    /// re-admitted elsewhere with the same attempt (`on_request_preempted`).
    Preempted(Vec<RequestId>),
}

/// A resumed request whose re-prefill an engine iteration ran.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Reprefilled {
    /// Request.
    pub rid: RequestId,
    /// Tokens it had generated before the move (re-prefilled with its prompt).
    pub tokens: u32,
    /// The iteration's seconds.
    pub secs: f64,
}

/// A response to score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyJob {
    /// Request.
    pub rid: RequestId,
    /// The problem.
    pub problem: Arc<Problem>,
    /// Response tokens.
    pub tokens: Vec<u32>,
}

/// A verifier's answer to a [`VerifyJob`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Request.
    pub rid: RequestId,
    /// Reward.
    #[serde(with = "bits")]
    pub reward: f32,
    /// Verified correct.
    pub correct: bool,
    /// Seconds spent verifying.
    pub secs: f64,
}

/// Scheduler → trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TrainCmd {
    /// Forward/backward of one micro-batch, accumulating unnormalised gradient sums.
    MicroBatch(Vec<GroupBatch>),
    /// Normalise, clip and apply AdamW over the micro-batches since the last step.
    OptStep,
    /// Send the f32 master weights back, and the optimizer state when `optimizer` is set
    /// (checkpoints only: the moments do not cross the seam every step).
    Export {
        /// Include the AdamW moments.
        optimizer: bool,
    },
    /// Stop the thread (in process only: a remote trainer lives as long as its host).
    #[serde(skip)]
    Shutdown,
}

/// Sums of one accumulated micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MicroBatchDone {
    /// Sums over its tokens.
    #[serde(with = "seam::Accum")]
    pub stats: AccumStats,
    /// Its response tokens.
    pub tokens: usize,
    /// Its prompt + response tokens (what a forward/backward pass processes).
    pub all_tokens: usize,
}

/// What an optimizer step reports.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptDone {
    /// Norm and clip.
    #[serde(with = "seam::Opt")]
    pub stats: OptStats,
    /// Sums over the step's micro-batches.
    #[serde(with = "seam::Accum")]
    pub accum: AccumStats,
    /// The normaliser used.
    pub normalizer: f64,
}

/// What the trainer did.
#[derive(Debug)]
pub enum TrainerReply {
    /// A micro-batch was accumulated.
    MicroBatch(MicroBatchDone),
    /// An optimizer step was applied.
    Opt(OptDone),
    /// The weights, and the moments when they were asked for (in process; the wire carries
    /// them as safetensors parts).
    Exported(Arc<Weights>, Option<AdamState>),
}

/// Everything a worker reports, with the scheduler's local timestamps.
#[derive(Debug)]
pub enum Event {
    /// What became of an engine's request.
    Engine {
        /// Engine.
        engine: u16,
        /// What happened.
        out: EngineOut,
        /// When the engine took the request (a generated one; otherwise the report's time).
        started: Instant,
    },
    /// Weights replaced; decode timings since the last sync: (running requests, seconds).
    Synced {
        /// Engine.
        engine: u16,
        /// Decode iteration samples.
        decode: Vec<(u32, f64)>,
    },
    /// A reward is known.
    Rewarded(Score),
    /// A multiplexed reference pass was lost with its (remote) engine: the trainer computes
    /// the group's pass itself.
    RefLost {
        /// Engine.
        engine: u16,
    },
    /// A multiplexed reference pass finished.
    RefLogprobs {
        /// Engine.
        engine: u16,
        /// The pass.
        done: RefDone,
        /// Start.
        started: Instant,
        /// End.
        ended: Instant,
    },
    /// The answer to [`EngineCmd::Migrate`]: the exported request, or `None` when no running
    /// request had generated enough.
    Migrated {
        /// The source engine.
        engine: u16,
        /// The request and its state.
        moved: Option<Box<Moved>>,
    },
    /// A resumed request's re-prefill ran.
    Resumed {
        /// The target engine.
        engine: u16,
        /// What ran.
        done: Reprefilled,
        /// When the iteration ended.
        ended: Instant,
    },
    /// The trainer finished a command.
    Trainer {
        /// What it did.
        reply: TrainerReply,
        /// Start.
        started: Instant,
        /// End.
        ended: Instant,
    },
    /// A worker hit an error it cannot recover from.
    Fatal(String),
}

#[cfg(test)]
mod tests {
    use rolloutpipe_backends::{GenRequest, RequestKey};
    use rolloutpipe_core::StepId;

    use super::*;

    fn rid(g: u32, s: u16) -> RequestId {
        RequestId {
            step: StepId(2),
            group: GroupId(g),
            sample: s,
            attempt: 1,
        }
    }

    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(v: &T) -> T {
        serde_json::from_str(&serde_json::to_string(v).unwrap()).unwrap()
    }

    /// The types a run sends are the types that arrive, field for field and bit for bit.
    #[test]
    fn messages_cross_json_unchanged() {
        let add = Add {
            rid: rid(3, 1),
            prompt: Arc::new(vec![5, 6, 7]),
            params: SamplingParams {
                temperature: f32::from_bits(0x3f33_3334),
                top_p: 0.9,
                seed: u64::MAX,
                stop_tokens: vec![2],
                ..SamplingParams::default()
            },
        };
        assert_eq!(round_trip(&add), add);
        let moved = Moved {
            rid: rid(5, 2),
            state: ResumeState {
                request: GenRequest {
                    id: RequestKey(77),
                    prompt: vec![1, 2],
                    params: SamplingParams::default(),
                },
                tokens: vec![9, 8, 7],
                logprobs: vec![-0.5, f32::from_bits(0x3f80_0001), -0.0],
                // Past u64: a ChaCha8 stream position is a u128.
                stream_words: (1u128 << 68) + 3,
            },
        };
        assert_eq!(round_trip(&moved), moved);
        let group = GroupBatch {
            step: 4,
            group: GroupId(9),
            prompt: Arc::new(vec![1]),
            samples: vec![Sample {
                sample: 0,
                attempt: 2,
                version: PolicyVersion(3),
                tokens: vec![4, 5],
                logprobs: vec![-1.5, f32::NAN],
                reward: -0.0,
                correct: false,
            }],
            ref_logprobs: Some(vec![vec![-2.0, -0.25]]),
        };
        let back = round_trip(&TrainCmd::MicroBatch(vec![group.clone()]));
        let TrainCmd::MicroBatch(groups) = back else {
            panic!("{back:?}")
        };
        let bits = |g: &GroupBatch| (g.samples[0].logprobs[1].to_bits(), g.samples[0].reward);
        assert_eq!(bits(&groups[0]), bits(&group));
        assert!(groups[0].samples[0].reward.is_sign_negative());
        let pass = RefPass {
            step: 1,
            index: 2,
            seqs: vec![Sequence {
                prompt: vec![1, 2],
                response: vec![3],
            }],
            temperature: 0.7,
        };
        assert_eq!(round_trip(&pass), pass);
        let done = OptDone {
            stats: OptStats {
                grad_norm: 0.5,
                clip_scale: 1.0,
                step: 7,
            },
            accum: AccumStats {
                tokens: 12,
                kl_sum: 0.25,
                ..AccumStats::default()
            },
            normalizer: 12.0,
        };
        assert_eq!(round_trip(&done), done);
    }

    /// A group without multiplexed log-probs leaves the key out, and one without the key
    /// reads as none.
    #[test]
    fn reference_log_probs_are_optional() {
        let g = GroupBatch {
            step: 0,
            group: GroupId(1),
            prompt: Arc::new(vec![1]),
            samples: Vec::new(),
            ref_logprobs: None,
        };
        let json = serde_json::to_string(&g).unwrap();
        assert!(!json.contains("ref_logprobs"), "{json}");
        assert_eq!(round_trip(&g), g);
    }
}
