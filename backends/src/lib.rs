//! Policy backends of RolloutPipe: a Qwen3 model that generates rollouts and trains with GRPO.
//!
//! - [`seam`]: the [`RolloutEngine`] and [`Trainer`] traits every backend implements, weight
//!   sync between them, dtype-tagged tensors, and the request/batch types (seam v2);
//! - [`config`], [`weights`]: Hugging Face `config.json` + `model.safetensors` model directories;
//! - [`model`]: the Qwen3 model written once for every backend: parameter layout, packed
//!   batches, RoPE tables, input limits, sampling rules, the loss and the AdamW scalars;
//! - [`grpo`], [`optim`]: advantages, aggregation and normaliser, AdamW with global-norm clipping
//!   (SPEC §6), shared by all backends;
//! - [`engine`]: the rollout engine written once over a KV store, for every backend;
//! - [`spec`]: [`BackendSpec`], a backend named by value (serde), and the one place that opens
//!   one;
//! - [`cpu`]: the f32 reference backend, plain forward/backward ops that the GPU backends are
//!   checked against;
//! - [`cuda`]: the CUDA backend's launch ABI and planning (always), and with the `cuda`
//!   feature the backend itself (PTX kernels through `cudarc`).
//!
//! ```
//! use rolloutpipe_backends::{CpuBackend, GenRequest, ModelConfig, RolloutEngine, RequestKey,
//!     SamplingParams, Weights};
//! let cfg = ModelConfig::tiny();
//! let mut be = CpuBackend::new(&cfg, &Weights::random(&cfg, 0).unwrap(), 1).unwrap();
//! let params = SamplingParams { max_new_tokens: 3, seed: 7, ..Default::default() };
//! be.add_request(GenRequest { id: RequestKey(1), prompt: vec![1, 2], params }).unwrap();
//! let mut done = Vec::new();
//! while be.active_requests() > 0 {
//!     done.extend(be.decode_step().unwrap());
//! }
//! assert_eq!(done[0].tokens.len(), 3);
//! ```
#![deny(missing_docs)]

pub mod config;
pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod error;
pub mod grpo;
pub mod model;
pub mod optim;
pub mod seam;
pub mod spec;
pub mod weights;

#[cfg(feature = "wgpu")]
pub mod wgpu;

pub use config::ModelConfig;
pub use cpu::CpuBackend;
pub use error::{BackendError, Result};
pub use grpo::{Aggregation, StdMode, advantages, normalizer};
pub use seam::*;
pub use spec::{BackendKind, BackendSpec};
pub use weights::{
    Tensor, Weights, load_model_dir, save_model_dir, write_model_dir, write_safetensors,
};
