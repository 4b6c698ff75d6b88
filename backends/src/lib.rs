//! Policy backends of RolloutPipe (placeholder until the CPU reference lands).
#![deny(missing_docs)]
