//! The workers of a run: rollout engines, verifiers and the trainer. They only execute: an
//! engine generates the requests it is handed (continuous batching, one decode iteration at a
//! time), a verifier scores responses, the trainer runs the micro-batches and optimizer steps
//! it is told to. Every decision (which request, which group, when to step) is the scheduler
//! thread's, which owns the core. All workers report on one event channel, so that the
//! scheduler waits in exactly one place.
//!
//! Each role's work is one type with a call per unit of work ([`EngineStep`],
//! [`TrainerStep`], [`score`]), shared by the in-process threads here and the remote hosts
//! (`remote`), so a run behaves the same whichever [`transport`] carries its messages.
mod backend;
mod engine;
mod trainer;
pub mod transport;
mod verifier;

pub use backend::{EngineBackend, TrainerBackend, check_backend, make_engine, make_trainer};
pub use engine::{EngineReference, EngineStep, engine_thread};
pub(crate) use engine::{commands, report};
pub use trainer::{TrainerSetup, TrainerStep, trainer_setup, trainer_thread};
pub use verifier::{score, verifier_thread, verify};
