//! Kernel sources of RolloutPipe, embedded as strings (placeholder until the kernels land).
#![no_std]
#![deny(unsafe_code, missing_docs)]
