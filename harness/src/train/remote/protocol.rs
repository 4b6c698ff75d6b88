//! What each remote host is sent and answers: the run's messages (`train::msg`) batched per
//! round trip, plus the `Init` that builds a host's worker. Every message is the JSON header
//! of one `wire` frame; weights, moments and reference weights follow as its binary parts.
//!
//! A sender may leave out the keys a host treats as off (an engine's `resumes`, `reference`,
//! `perturb_mux`, and the engine options' `dtype`, `tensor_cores`, `lookahead`).
use rolloutpipe_core::{PolicyVersion, RequestId};
use serde::{Deserialize, Serialize};

use crate::train::config::TrainConfig;
use crate::train::msg::{
    Add, EngineOptions, EngineOut, MicroBatchDone, Moved, OptDone, RefDone, RefPass, Reprefilled,
    Score, TrainCmd, VerifyJob,
};

/// How a remote engine host builds its engine. The published weights are its starting
/// weights; with `reference`, the message's first part is the KL reference weights, for an f32
/// CPU reference model of the engine's own (tail multiplexing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineInit {
    /// Engine index.
    pub engine: u16,
    /// `run.backend`.
    pub backend: String,
    /// How the engine is built.
    #[serde(flatten)]
    pub options: EngineOptions,
    /// The model's `config.json`.
    pub model: serde_json::Value,
    /// Fault injection (`fault.fail_engine_at_request`).
    pub fail_at_request: Option<u64>,
    /// A reference model is sent.
    #[serde(default)]
    pub reference: bool,
    /// `fault.perturb_mux` (tests only).
    #[serde(default)]
    pub perturb_mux: bool,
}

/// Scheduler → engine host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineMsg {
    /// Build the engine from the published weights.
    Init(Box<EngineInit>),
    /// Admissions, resumes and cancels, in order, then one decode iteration when `decode`.
    Step {
        /// Requests to add.
        adds: Vec<Add>,
        /// Migrated requests to resume (after the adds).
        #[serde(default)]
        resumes: Vec<Moved>,
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
    /// Tail multiplexing: a reference pass (answered by [`EngineReply::RefLogprobs`]).
    RefLogprobs(RefPass),
    /// Long-tail migration: export the running request that has generated the most tokens,
    /// if at least `min_generated` (answered by [`EngineReply::Migrated`]).
    Migrate {
        /// Fewest tokens generated for a request to move.
        min_generated: u32,
    },
}

/// Engine host → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum EngineReply {
    /// Built.
    Ready,
    /// What the step produced, and how many requests still run.
    Stepped {
        /// What became of requests, in order.
        outs: Vec<EngineOut>,
        /// Requests still running.
        active: usize,
        /// Resumed requests whose re-prefill this step's decode ran.
        #[serde(default)]
        reprefilled: Vec<Reprefilled>,
    },
    /// The reference pass asked for.
    RefLogprobs(RefDone),
    /// The exported request (`None`: nothing long enough, or the engine failed).
    Migrated {
        /// The request and its state.
        moved: Option<Moved>,
    },
    /// Weights loaded; decode timings since the last sync.
    Synced {
        /// (running requests, seconds) per decode iteration.
        decode: Vec<(u32, f64)>,
    },
    /// The worker hit an error it cannot recover from (the run stops with it).
    Fatal(String),
}

/// How the trainer host builds the trainer. Parts: weights, then the AdamW moments when
/// `adam_step` is set, then the KL reference's weights when `reference`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerInit {
    /// The run's config (objective, optimizer, backend, threads).
    pub config: TrainConfig,
    /// The model's `config.json`.
    pub model: serde_json::Value,
    /// The moments' step count, when moments are sent.
    pub adam_step: Option<u64>,
    /// A reference model is sent.
    pub reference: bool,
}

/// Scheduler → trainer host: `Init`, then the trainer's commands as they are in process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TrainerMsg {
    /// Build the trainer.
    Init(Box<TrainerInit>),
    /// A command (`MicroBatch`, `OptStep`, `Export`).
    #[serde(untagged)]
    Cmd(TrainCmd),
}

/// Trainer host → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TrainerAnswer {
    /// Built.
    Ready,
    /// A micro-batch was accumulated in `secs`.
    MicroBatchDone {
        /// Its sums.
        done: MicroBatchDone,
        /// Seconds on the host.
        secs: f64,
    },
    /// An optimizer step was applied in `secs`.
    OptDone {
        /// What it measured.
        done: OptDone,
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

/// Scheduler → verifier host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VerifierMsg {
    /// Build the task and tokenizer of this config.
    Init {
        /// The run's config.
        config: Box<TrainConfig>,
    },
    /// Score these responses.
    Score(Vec<VerifyJob>),
}

/// Verifier host → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VerifierReply {
    /// Built.
    Ready,
    /// The scores, in job order.
    Scored(Vec<Score>),
    /// The worker hit an error it cannot recover from.
    Fatal(String),
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rolloutpipe_backends::{DType, GenRequest, RequestKey, ResumeState, SamplingParams};
    use rolloutpipe_core::{GroupId, StepId};

    use super::super::wire::{decode, encode};
    use super::*;

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
            adds: vec![Add {
                rid: rid(3, 1),
                prompt: Arc::new(vec![5, 6, 7]),
                params: SamplingParams {
                    temperature: 0.7,
                    top_p: 0.9,
                    seed: u64::MAX,
                    ..SamplingParams::default()
                },
            }],
            resumes: vec![Moved {
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
            }],
            cancels: vec![rid(4, 0)],
            decode: true,
        };
        let blob = [1u8, 2, 3, 255];
        let bytes = encode(&msg, &[&blob, &[]]);
        let (back, parts): (EngineMsg, _) = decode(&bytes).unwrap();
        assert_eq!(back, msg);
        assert_eq!(parts, vec![&blob[..], &[][..]]);
        // A Step from a sender that sends no resumes still decodes.
        let old = br#"{"Step":{"adds":[],"cancels":[],"decode":false}}"#;
        let old: serde_json::Value = serde_json::from_slice(old).unwrap();
        let (m, _): (EngineMsg, _) = decode(&encode(&old, &[])).unwrap();
        assert!(matches!(m, EngineMsg::Step { resumes, .. } if resumes.is_empty()));
        // The trainer's commands travel as they are in process.
        for cmd in [TrainCmd::OptStep, TrainCmd::Export { optimizer: true }] {
            let (back, _): (TrainerMsg, _) =
                decode(&encode(&TrainerMsg::Cmd(cmd.clone()), &[])).unwrap();
            assert_eq!(back, TrainerMsg::Cmd(cmd));
        }
        let head = serde_json::to_string(&TrainerMsg::Cmd(TrainCmd::OptStep)).unwrap();
        assert_eq!(head, "\"OptStep\"");
    }

    #[test]
    fn engine_init_carries_tensor_cores_and_lookahead_and_older_senders_mean_off() {
        let init = EngineMsg::Init(Box::new(EngineInit {
            engine: 1,
            backend: "wgpu".into(),
            options: EngineOptions {
                threads: 2,
                dtype: DType::Bf16,
                tensor_cores: true,
                lookahead: true,
            },
            model: serde_json::json!({"hidden_size": 32}),
            fail_at_request: None,
            reference: false,
            perturb_mux: false,
        }));
        let (back, _): (EngineMsg, _) = decode(&encode(&init, &[])).unwrap();
        assert_eq!(back, init);
        // An Init from a sender that names neither the keys nor the dtype decodes as off and
        // f32.
        let old = br#"{"Init":{"engine":0,"backend":"wgpu","threads":1,"model":{},"fail_at_request":null}}"#;
        let old: serde_json::Value = serde_json::from_slice(old).unwrap();
        let (m, _): (EngineMsg, _) = decode(&encode(&old, &[])).unwrap();
        let EngineMsg::Init(init) = m else {
            panic!("{m:?}")
        };
        let EngineOptions {
            tensor_cores,
            lookahead,
            dtype,
            ..
        } = init.options;
        assert!(!tensor_cores && !lookahead);
        assert_eq!(dtype, DType::F32);
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
        let out = EngineReply::Stepped {
            outs: vec![EngineOut::Generated {
                rid: rid(1, 2),
                version: PolicyVersion(9),
                tokens: vec![1, 2, 3, 4, 5],
                logprobs: lps.clone(),
            }],
            active: 0,
            reprefilled: Vec::new(),
        };
        let (back, _): (EngineReply, _) = decode(&encode(&out, &[])).unwrap();
        let EngineReply::Stepped { outs, .. } = back else {
            panic!("{back:?}")
        };
        let EngineOut::Generated { logprobs, .. } = &outs[0] else {
            panic!("{outs:?}")
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(logprobs), bits(&lps));
    }
}
