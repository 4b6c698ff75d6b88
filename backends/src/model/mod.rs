//! The Qwen3 model, written once for every backend.
//!
//! The layer loops exist here and nowhere else: the training forward and its backward
//! ([`forward`]) and the decode step ([`decode`]), generic over the operations trait
//! [`ops::Ops`] that each backend implements with its kernels. The trainer's calls
//! ([`train`]) and the activations they keep ([`acts`]) are written once too.
//!
//! What else a backend does not own: the parameter layout ([`layout`]), the packed batch
//! ([`batch`]), the RoPE tables ([`rope`]), the input limits ([`check`]), the sampling rules
//! ([`sampling`]), the loss and its per-token inputs ([`loss`]) and the AdamW scalars
//! ([`adam`]). A backend brings its operations and buffers; no backend module imports
//! another backend's.

pub mod acts;
pub mod adam;
pub mod batch;
pub mod check;
pub mod decode;
pub mod forward;
pub mod layout;
pub mod loss;
pub mod ops;
pub mod real;
pub mod rope;
pub mod sampling;
pub mod train;

pub use adam::AdamScalars;
pub use batch::Packed;
pub use layout::{LayerParams, Layout, ParamEntry, ParamId, ParamIds};
pub use loss::{Loss, LossInputs, LossSums};
pub use real::Real;
pub use rope::RopeTable;

/// Vocabulary rows per chunk of the fused lm_head (the output projection with the log-probs,
/// which never holds a `[rows × vocab]` tensor): large enough that each chunk's product is an
/// efficient GEMM, small enough that `rows × chunk` scratch stays a few MB.
pub const VOCAB_CHUNK: usize = 8192;
