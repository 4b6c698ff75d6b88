//! RolloutPipe's scheduling core: the group state machine, admission (FIFO or frontier-group
//! dispatch), dispatch to the trainer (pipelined or sync), over-sampling, filtering and aborts of
//! one GRPO-style RL step — sans-IO, `no_std`, allocation-free.
//!
//! # Goals
//! - **Sans-IO.** The caller reports what happened (`on_*` events) and asks what to do next
//!   (`poll_*` decisions). Time is a [`Tick`] passed in; the core never reads a clock, spawns,
//!   locks or blocks. The same code drives a discrete-event simulator, a real trainer, and tests.
//! - **Allocation-free.** Storage is provided by the caller ([`Scheduler::new`] over slices, as
//!   smoltcp takes socket storage) or fixed at compile time ([`SchedulerStorage`]); a step of
//!   65,536 groups × 16 samples fits. Per-event cost is O(1) in the number of groups: O(G) for
//!   whole-group operations (ending or extending a group), a frontier admission reads a
//!   four-level bitset of groups with pending requests, and the frontier's bound is re-walked
//!   (O(frontier)) only when a group completes or prompts are drawn. Measured: 50–80 ns per
//!   request lifecycle from B = 64 to 65,536 groups (`benches/core.rs`).
//! - **Panic-free and strict.** Every event validates fully first; an illegal one returns a small
//!   `Copy` error and changes nothing. Duplicate, unknown, stale-attempt, other-step and
//!   wrong-version completions are rejected (on-policy guard).
//! - **One implementation, several policies.** Slime's baseline is `Fifo` + `Sync`; CGP is
//!   `Pipelined` dispatch; RolloutPipe is `Frontier` + `Pipelined`. Admission policies are pure
//!   functions of a read-only [`View`], so new ones implement [`Admit`] without touching the state
//!   machine; allocation policies (how many samples a scored group gets: VIGOR, Pilot-Commit)
//!   implement [`Allocate`] the same way, with [`FixedG`] (GRPO's fixed G) the default.
//! - **Nothing lost silently.** [`Counters`] prove `drawn = trained + filtered + aborted + in
//!   progress` after every event; [`Scheduler::audit`] re-derives every count from storage.
//!
//! # Anti-goals
//! - No I/O, threads, async, timers or clocks: wrap the core in your runtime.
//! - No engine, verifier or trainer: it decides, you execute.
//! - No tokens or tensors: it keeps per-sample rewards and token counts, not responses.
//! - No cross-step state (one-step-off asynchrony is the caller's composition of two steps'
//!   bookkeeping), no persistence of in-flight state.
//!
//! # Protocol
//! 1. [`Scheduler::begin_step`] with a [`Plan`] (B groups of G samples, micro-batch m, k_opt
//!    optimizer steps, slots, policies).
//! 2. Loop: [`poll_draw`](Scheduler::poll_draw) → draw that many prompts →
//!    [`on_prompts_drawn`](Scheduler::on_prompts_drawn); while a slot is free,
//!    [`poll_admit`](Scheduler::poll_admit) → start the request; on completion
//!    [`on_request_finished`](Scheduler::on_request_finished) (or `on_request_generated` then
//!    `on_reward`), on failure [`on_request_failed`](Scheduler::on_request_failed);
//!    [`poll_abort`](Scheduler::poll_abort) → abort → [`on_abort_acked`](Scheduler::on_abort_acked);
//!    [`poll_dispatch`](Scheduler::poll_dispatch) → give the group to the trainer;
//!    [`poll_micro_batch`](Scheduler::poll_micro_batch) → train it →
//!    [`on_micro_batch_consumed`](Scheduler::on_micro_batch_consumed);
//!    [`poll_optimizer_step`](Scheduler::poll_optimizer_step) → apply it →
//!    [`on_optimizer_step_done`](Scheduler::on_optimizer_step_done).
//!    Events that do not burn an attempt: [`on_admission_refused`](Scheduler::on_admission_refused)
//!    and [`on_request_preempted`](Scheduler::on_request_preempted) (preempted or migrated);
//!    [`set_slots`](Scheduler::set_slots) when engines come or go.
//!    With `Plan::hold_scored`, [`poll_allocation`](Scheduler::poll_allocation) (or
//!    [`poll_allocation_with`](Scheduler::poll_allocation_with) and an [`Allocate`] policy)
//!    decides each scored group: commit, extend by n, or skip.
//! 3. [`poll_step_done`](Scheduler::poll_step_done) returns the [`StepSummary`]; begin the next.
//!
//! **Liveness.** The polls alone say everything the driver must do: a driver that answers every
//! decision (and whose engines eventually finish, fail or ack what they were given) reaches
//! `poll_step_done` without consulting any other accessor. Two contracts make that true:
//! `begin_step` refuses request storage smaller than `max_groups × G`, so every draw `poll_draw`
//! asks for is accepted; and an optimizer step that becomes due without a micro-batch (a batch
//! that turns final and short after its last micro-batch was consumed) is still announced by
//! `poll_optimizer_step`. `tests/liveness.rs` and the state-machine test check this.
//!
//! Rewards stay in the core until the next step begins: read them with
//! [`Scheduler::group_rewards`] when a group is dispatched to compute its advantages.
//!
//! # Example: one tiny step, end to end
//! ```
//! use rolloutpipe_core::*;
//!
//! let mut storage = SchedulerStorage::<8, 32>::new();
//! let mut s = storage.scheduler();
//! let mut plan = Plan::new(2, 2); // B = 2 trainable groups of G = 2 samples
//! plan.slots = 2;
//! plan.admission = AdmissionPolicy::Frontier { width: 0, expected_filter_ppm: 0, fallback: SubmitOrder::GroupMajor };
//! s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan)?;
//!
//! let mut trained = Vec::new();
//! let mut t = 0;
//! while s.poll_step_done().is_none() {
//!     t += 1;
//!     let now = Tick(t);
//!     if let Some(n) = s.poll_draw(now) {
//!         s.on_prompts_drawn(now, n)?;
//!     }
//!     // Pretend every admitted request finishes at once. Group 0 answers identically
//!     // (zero variance: filtered, so a third prompt gets drawn); the others disagree.
//!     while let Some(a) = s.poll_admit(now) {
//!         let reward = if a.request.group == GroupId(0) { 1.0 } else { a.request.sample as f32 };
//!         s.on_request_finished(now, a.request, a.version, 100, reward)?;
//!     }
//!     while let Some(r) = s.poll_abort(now) {
//!         s.on_abort_acked(now, r)?;
//!     }
//!     while let Some(d) = s.poll_dispatch(now) {
//!         let rewards: Vec<f32> = s.group_rewards(d.group).unwrap().flatten().collect();
//!         assert_eq!(rewards, [0.0, 1.0]);
//!         trained.push(d.group);
//!     }
//!     while s.poll_micro_batch(now).is_some() {
//!         s.on_micro_batch_consumed(now)?;
//!     }
//!     if s.poll_optimizer_step(now).is_some() {
//!         s.on_optimizer_step_done(now)?;
//!     }
//! }
//! let summary = s.poll_step_done().unwrap();
//! assert_eq!(trained, [GroupId(1), GroupId(2)]);
//! assert_eq!((summary.counters.trained, summary.counters.filtered_zero_variance), (2, 1));
//! assert!(summary.counters.is_conserved());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Features (all off by default, additive)
//! - `std`: nothing yet beyond `std::error::Error` through `core::error::Error`; reserved.
//! - `serde`: `Serialize`/`Deserialize` for the plain value types (plan, ids, states, counters,
//!   summaries, decisions).
//! - `log` / `defmt`: a trace line `step N gI: A => B` for every group state change.
#![no_std]
#![deny(unsafe_code, missing_docs)]

mod allocate;
mod allocators;
mod error;
mod owned;
mod policy;
mod scheduler;
mod state;
mod storage;
mod types;

pub use allocate::{Allocate, Allocated, Allocation, FixedG, RewardStats};
pub use allocators::{AllocParamError, Param, PilotCommit, Vigor};
pub use error::{
    AdmitError, BeginError, DrawError, ExtendError, RequestError, SlotsError, TrainError,
};
pub use owned::{Attached, OwnedScheduler};
pub use policy::{Admit, Incomplete, Queue, View};
pub use scheduler::{
    Admission, AuditError, Completion, Dispatch, Failure, GroupInfo, MicroBatch, OptimizerStep,
    Scheduler,
};
pub use state::{
    Counters, FilterReason, GroupState, RequestState, SkipReason, StepPhase, StepSummary,
};
pub use storage::{GroupSlot, RequestSlot, SchedulerStorage};
pub use types::{
    AdmissionPolicy, DispatchPolicy, EngineId, GroupId, MicroBatchUnit, Plan, PlanError,
    PolicyVersion, RequestId, RequestRef, StepId, SubmitOrder, Tick,
};

/// The workspace README's Rust examples, compiled and run as doctests of this crate.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
