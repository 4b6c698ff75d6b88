//! Support code of the conformance suite: checks, the backend-neutral op runner and its
//! per-backend implementations, and the op tests written once against it.

pub mod check;
#[cfg(feature = "cuda")]
pub mod cuda_device;
#[cfg(feature = "wgpu")]
pub mod device;
pub mod op_shapes;
pub mod op_tests;
pub mod ops;
#[cfg(feature = "cuda")]
pub mod ops_cuda;
#[cfg(feature = "wgpu")]
pub mod ops_wgpu;
