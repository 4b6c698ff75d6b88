//! RolloutPipe's scheduling core (placeholder until the core lands).
#![no_std]
#![deny(unsafe_code, missing_docs)]
