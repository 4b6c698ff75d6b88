//! Fuzz drivers for `rolloutpipe-core`. The event driver lives in `events.rs` so that the core's
//! stable test suite can include the very same file (`#[path]`) and replay the corpus.
#![deny(missing_docs)]

#[path = "events.rs"]
pub mod events;
