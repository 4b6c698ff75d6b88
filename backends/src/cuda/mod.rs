//! The CUDA backend: the CPU reference's Qwen3 model and GRPO training as hand-written PTX
//! kernels (`kernels/ptx/`, `rolloutpipe-kernels`) launched through `cudarc`, with the
//! driver loaded at run time (no CUDA toolkit needed to build).
//!
//! - [`abi`], [`plan`], [`layout`]: the kernels' parameter lists, launch geometry, GEMM
//!   strides, scalar packing, vocabulary chunks, activation sizes and KV-slot growth; pure
//!   host code, compiled and unit-tested without the `cuda` feature;
//! - `device` (feature `cuda`): the context, its stream, modules loaded once from the PTX
//!   strings, cached functions, buffers and the one checked launch path;
//! - `ops`: one launcher per PTX entry; `model`: parameters and gradients on the device;
//!   `model_ops`: the model's operations (`crate::model::ops::Ops`) as launches, chunked
//!   lm_head included; `decode`: the one engine's steps over a slot KV cache with on-device
//!   sampling.
//!
//! Status: **compiled and unit-tested on the host, never executed on a GPU** (no device was
//! available when it was written); `scripts/device/cuda.sh` runs the conformance suite
//! against the CPU reference and the benchmarks on one (docs/cuda.md).
//!
//! What crosses back to the host per call is what the wgpu backend returns: sampled tokens
//! and log-probs (`decode_step`), per-token log-probs (`logprobs`), four loss sums plus one
//! gradient sum of squares (`accumulate`), one sum of squares (`optimizer_step`).
//!
//! Seam v2 on this backend: two backends opened on one [`Cuda`] context share its device,
//! and weight sync between them is a device-to-device copy ([`SyncPath::SameDevice`]);
//! groups run as independent requests (a slot cache shares no pages); `submit_step` runs the
//! step and `poll_step` returns it.

pub mod abi;
pub mod layout;
pub mod plan;

#[cfg(feature = "cuda")]
pub mod decode;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod model;
#[cfg(feature = "cuda")]
pub mod model_ops;
#[cfg(feature = "cuda")]
pub mod ops;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
pub use backend::CudaBackend;
#[cfg(feature = "cuda")]
pub use device::{Cuda, DBuf, unavailable_reason};

/// Why `--backend cuda` cannot run here, or `None` when it can: a build without the `cuda`
/// feature says so; with it, the driver library, its version and a device are checked
/// without creating a context (creating one panics inside cudarc when no driver loads).
pub fn availability() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        device::unavailable_reason()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Some("this build has no CUDA support (rebuild with `--features cuda`)".into())
    }
}
