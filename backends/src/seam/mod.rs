//! Seam v2: the interfaces between the harness and a backend, and between a trainer and its
//! rollout engines. Every backend (CPU, wgpu, CUDA) imports its types from here and from
//! nowhere else.
//!
//! # Goals
//! - **Two roles, two traits.** A [`RolloutEngine`] generates (continuous batching, seeded
//!   per-request sampling); a [`Trainer`] scores and trains (GRPO or SFT gradient sums, then
//!   AdamW on f32 master weights). A backend implements either or both; both extend
//!   [`BackendInfo`] (name, config, device).
//! - **Weight sync stays on the device when it can.** The trainer makes a [`WeightSnapshot`]
//!   for the engine's [`SyncTarget`]: a device-side copy when both share a device, else host
//!   tensors already in the engine's dtype. The two halves run in different threads if needed;
//!   [`Trainer::sync_to`] runs both.
//! - **Dtypes are explicit.** [`TypedTensor`] carries [`DType`] (f32, bf16, f16): engines may
//!   store bf16/f16 weights, trainers keep f32 master weights and f32 moments.
//! - **Optimizer state only for checkpoints.** Moments never cross the seam in the training
//!   loop; [`Trainer::checkpoint_optimizer`] and [`Trainer::restore_optimizer`] exist for
//!   checkpoints.
//! - **Back-pressure.** An engine has [`EngineLimits`]; a submission that does not fit is
//!   refused with [`BackendError::EngineFull`](crate::BackendError::EngineFull), which hands it
//!   back ([`Rejected`]).
//! - **Groups share their prompt.** [`RolloutEngine::add_group`] prefills the prompt once and
//!   shares its KV prefix across the G samples; each sample's tokens are bit-identical to
//!   what it would have generated alone.
//! - **Submit/poll decoding.** [`RolloutEngine::submit_step`] starts a step,
//!   [`RolloutEngine::poll_step`] collects it; the host prepares step n+1 in between.
//! - **`Result` on every call**, with errors that name what is wrong.
//!
//! # Anti-goals
//! - No scheduling: which request to add, when to step and when to sync is the caller's (the
//!   `rolloutpipe-core` scheduler decides).
//! - No tokenizer, verifier or data: tokens in, tokens and log-probs out.
//! - No full-vocabulary logits in training or scoring: [`Trainer::logits`] exists for
//!   inspection only.
//! - No automatic device placement: a backend is built on a device by its constructor.
//!
//! # Example: train, sync and generate a group
//! ```
//! use rolloutpipe_backends::*;
//! let cfg = ModelConfig::tiny();
//! let w = Weights::random(&cfg, 0)?;
//! let mut trainer = CpuBackend::new(&cfg, &w, 1)?;
//! let mut engine = CpuBackend::new(&cfg, &w, 1)?;
//!
//! // One SFT step on the trainer, then a same-device weight sync (no host round trip).
//! let seq = TrainSequence::new(vec![1, 2], vec![3, 4], 0.0, Aggregation::TokenMean);
//! let batch = TrainBatch { sequences: vec![seq] };
//! trainer.zero_grad()?;
//! let st = trainer.accumulate(&batch, &Objective::Sft)?;
//! trainer.optimizer_step(st.tokens as f64, &AdamW::default())?;
//! assert_eq!(trainer.sync_to(&mut engine)?, SyncPath::SameDevice);
//!
//! // A group of 3 samples of one prompt: one prefill, shared KV prefix.
//! engine.set_limits(EngineLimits { max_requests: 3, max_kv_tokens: 64 })?;
//! let samples = (0..3)
//!     .map(|i| (RequestKey(i), SamplingParams { max_new_tokens: 4, seed: i, ..Default::default() }))
//!     .collect();
//! engine.add_group(GroupRequest { prompt: vec![5, 6, 7], samples })?;
//! // Full: a fourth request is handed back, not queued.
//! let params = SamplingParams { max_new_tokens: 4, ..Default::default() };
//! let extra = GenRequest { id: RequestKey(9), prompt: vec![1], params };
//! match engine.add_request(extra) {
//!     Err(BackendError::EngineFull { rejected, .. }) => assert!(matches!(*rejected, Rejected::Request(_))),
//!     other => panic!("expected EngineFull, got {other:?}"),
//! }
//! // Submit/poll: the host may prepare the next step while this one runs.
//! let mut done = Vec::new();
//! while engine.active_requests() > 0 {
//!     engine.submit_step()?;
//!     done.extend(engine.poll_step(true)?.unwrap_or_default());
//! }
//! assert_eq!(done.len(), 3);
//! # Ok::<(), BackendError>(())
//! ```

pub mod engine;
pub mod sync;
pub mod tensor;
pub mod trainer;
pub mod types;

pub use engine::{EngineLimits, EngineLoad, Rejected, RolloutEngine};
pub use sync::{
    DeviceId, DeviceSnapshot, SnapshotPayload, SyncPath, SyncTarget, WeightSnapshot,
    next_device_number,
};
pub use tensor::{DType, TensorData, TypedTensor};
pub use trainer::Trainer;
pub use types::*;

pub use crate::optim::{AdamState, AdamW, OptStats};

use crate::config::ModelConfig;

/// What every backend role tells about itself.
pub trait BackendInfo: Send {
    /// Short backend name (`"cpu"`, `"wgpu"`, `"cuda"`).
    fn name(&self) -> &'static str;
    /// The model's configuration.
    fn config(&self) -> &ModelConfig;
    /// Where its tensors live.
    fn device(&self) -> DeviceId;
}

/// Both roles in one object: for tools that generate and train the same weights in one place
/// (CLI inspection commands, tests). Training loops hold the roles apart, as
/// `Box<dyn RolloutEngine>` per engine and one `Box<dyn Trainer>`.
pub trait Policy: RolloutEngine + Trainer {}

impl<T: RolloutEngine + Trainer> Policy for T {}
