//! The state machine, split by concern: `events.rs` (what happened, `on_*`), `decisions.rs`
//! (what to do next, `poll_*`), `audit.rs` (the oracle), and here the state itself, read-only
//! accessors and the few funnels every change goes through: `set_state` for groups, `set_req`
//! for requests (each checked against its transition table), `end_group`, and the frontier
//! cache's incremental upkeep.

mod audit;
mod decisions;
mod events;

pub use audit::AuditError;

use crate::error::{
    AdmitError, BeginError, DrawError, ExtendError, RequestError, SlotsError, TrainError,
};
use crate::policy::{Admit, View};
use crate::state::{Counters, FilterReason, GroupState, RequestState, StepPhase, StepSummary};
use crate::storage::{GroupSlot, Link, List, NIL, RequestSlot};
use crate::types::{
    DispatchPolicy, GroupId, MicroBatchUnit, Plan, PlanError, PolicyVersion, RequestId, RequestRef,
    StepId, SubmitOrder, Tick,
};

/// Reward spread below which a complete group is filtered: population std ≤ 1e-6, compared as
/// variance ≤ 1e-12 because `core` has no `sqrt`.
const ZERO_VARIANCE: f64 = 1e-12;

/// Groups addressable by the four-level pending-groups bitset (64^4).
const MAX_GROUPS: usize = 1 << 24;

/// A decision to start a request in a free slot.
///
/// ```
/// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
/// let mut storage = SchedulerStorage::<2, 4>::new();
/// let mut s = storage.scheduler();
/// s.begin_step(Tick(0), StepId(0), PolicyVersion(7), Plan::new(1, 2)).unwrap();
/// s.on_prompts_drawn(Tick(0), 1).unwrap();
/// let a = s.poll_admit(Tick(0)).unwrap();
/// assert_eq!((a.request.sample, a.version), (0, PolicyVersion(7)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Admission {
    /// The request to start (its id must come back with its completion).
    pub request: RequestId,
    /// The policy version to generate with.
    pub version: PolicyVersion,
}

/// A complete trainable group for the trainer FIFO.
///
/// ```
/// use rolloutpipe_core::{Dispatch, GroupId};
/// let d = Dispatch { group: GroupId(3), seq: 0 };
/// assert_eq!(d.seq, 0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Dispatch {
    /// The group.
    pub group: GroupId,
    /// Its position in the step's dispatch order (0, 1, …); micro-batch `i` is seqs
    /// `i·m .. i·m + len`.
    pub seq: u32,
}

/// A micro-batch the trainer may run: dispatched groups `first_seq .. first_seq + len`.
///
/// ```
/// use rolloutpipe_core::MicroBatch;
/// let mb = MicroBatch { index: 0, first_seq: 0, len: 4, ends_optimizer_step: true };
/// assert_eq!(mb.first_seq + mb.len, 4);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct MicroBatch {
    /// Index within the step.
    pub index: u32,
    /// Dispatch seq of its first group.
    pub first_seq: u32,
    /// Groups in it (m, except a short batch's last micro-batch).
    pub len: u32,
    /// Whether an optimizer step follows it, as far as known now (informative). A batch that
    /// turns out short later can make an already consumed micro-batch the last one; only
    /// `poll_optimizer_step` announces every optimizer step.
    pub ends_optimizer_step: bool,
}

/// An optimizer step the trainer must apply now (from `poll_optimizer_step`).
///
/// ```
/// use rolloutpipe_core::OptimizerStep;
/// assert_eq!(OptimizerStep { index: 1 }.index, 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct OptimizerStep {
    /// Optimizer steps applied before this one in the current step (0, 1, …, k_opt − 1).
    pub index: u32,
}

/// What a completion did.
///
/// ```
/// use rolloutpipe_core::{Completion, GroupState};
/// let c = Completion::Accepted { group_state: GroupState::Materializing };
/// assert_ne!(c, Completion::Discarded);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum Completion {
    /// Recorded; the group is now in this state.
    Accepted {
        /// The group's state after the event.
        group_state: GroupState,
    },
    /// The request's group had ended (its abort was pending, or, for a reward, its response was
    /// dropped); the result is discarded. A late completion frees its slot and
    /// `requests_discarded` counts it; a late reward was counted in `requests_dropped` already.
    Discarded,
}

/// What a failure report did.
///
/// ```
/// use rolloutpipe_core::Failure;
/// assert_eq!(Failure::Retried { attempt: 1 }, Failure::Retried { attempt: 1 });
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum Failure {
    /// Re-queued with this attempt number.
    Retried {
        /// The new attempt.
        attempt: u8,
    },
    /// The last attempt failed; the group is `Filtered(AttemptsExhausted)`.
    GroupFiltered,
    /// The request was being aborted: counted as acknowledged.
    AbortAcked,
}

/// A read-only snapshot of one group.
///
/// ```
/// use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
/// let mut storage = SchedulerStorage::<2, 4>::new();
/// let mut s = storage.scheduler();
/// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
/// s.on_prompts_drawn(Tick(5), 1).unwrap();
/// let g = s.group(GroupId(0)).unwrap();
/// assert_eq!((g.target, g.pending, g.drawn_at), (2, 2, Tick(5)));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GroupInfo {
    /// State.
    pub state: GroupState,
    /// Samples wanted.
    pub target: u16,
    /// Requests waiting for a slot.
    pub pending: u16,
    /// Requests running (not counting ones being aborted).
    pub in_flight: u16,
    /// Responses generated.
    pub generated: u16,
    /// Rewards recorded.
    pub rewarded: u16,
    /// Tokens generated by the recorded responses.
    pub tokens: u64,
    /// Mean of the recorded (finite) rewards.
    pub reward_mean: f64,
    /// Population variance of the recorded (finite) rewards.
    pub reward_var: f64,
    /// When drawn.
    pub drawn_at: Tick,
    /// When it left the incomplete states (materialized, filtered or aborted).
    pub ended_at: Option<Tick>,
    /// Position in the dispatch order, once dispatched.
    pub dispatch_seq: Option<u32>,
}

/// Tiny seeded PRNG (SplitMix64) for the shuffled submission order; the core must not depend on
/// a RNG crate or the platform.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` by multiply-shift (bias < n / 2^64, irrelevant for queue orders).
    fn below(&mut self, n: u32) -> u32 {
        ((self.next() as u128 * n as u128) >> 64) as u32
    }
}

/// The scheduling core over caller-provided storage. See the crate docs for the protocol.
///
/// ```
/// use rolloutpipe_core::{GroupSlot, RequestSlot, Scheduler, StepPhase};
/// let mut groups = vec![GroupSlot::EMPTY; 65_536];
/// let mut requests = vec![RequestSlot::EMPTY; 65_536 * 16];
/// let s = Scheduler::new(&mut groups, &mut requests);
/// assert_eq!(s.capacity(), (65_536, 1 << 20));
/// assert_eq!(s.phase(), StepPhase::Idle);
/// ```
pub struct Scheduler<'a> {
    pub(crate) groups: &'a mut [GroupSlot],
    pub(crate) reqs: &'a mut [RequestSlot],
    group_cap: u32,
    req_cap: u32,
    phase: StepPhase,
    step: StepId,
    version: PolicyVersion,
    plan: Plan,
    began_at: Tick,
    final_at: Option<Tick>,
    done_at: Option<Tick>,
    req_used: u32,
    /// Request slots below `req_used` left empty by relocated groups: reclaimed by `compact`.
    req_holes: u32,
    pub(crate) counters: Counters,
    /// Incomplete groups in draw order.
    pub(crate) incomplete: List,
    /// Pending requests in submission order.
    pub(crate) queue: List,
    /// Requests whose abort has not been polled yet.
    aborts: List,
    /// Trainer FIFO of trainable, undispatched groups (materialization order).
    ready_head: u32,
    ready_tail: u32,
    dispatched: u32,
    released_groups: u32,
    mb_released: u32,
    mb_consumed: u32,
    trained_since_opt: u32,
    /// Groups consumed by the trainer (in dispatch order).
    consumed_groups: u32,
    /// Micro-batch cuts are found by scanning dispatched groups: next seq to scan, and the
    /// units of the scanned, unreleased ones.
    mb_scan: u32,
    mb_acc: u64,
    /// The same cuts replayed on the batch as it fills (materialization = dispatch order), so
    /// the frontier knows the open micro-batch's units: its units so far, and the units of
    /// all filled groups (for the token estimate).
    pub(crate) fill_acc: u64,
    pub(crate) fill_units: u64,
    opt_done: u32,
    /// The due optimizer step was handed out by `poll_optimizer_step`.
    opt_announced: bool,
    /// Slots in use when `set_slots` last shrank below them: the audit's cap until they drain.
    slots_ceiling: u32,
    /// Held groups (scored, awaiting an allocation decision), oldest first.
    pub(crate) held_head: u32,
    held_tail: u32,
    held_len: u32,
    /// Samples this step has created (drawn groups' and extensions'), for `sample_budget`.
    pub(crate) samples_used: u64,
    /// Budget samples reserved for undecided groups' first extensions (the sum of their
    /// `reserve`): `samples_used + reserved ≤ sample_budget` while a budget is set.
    pub(crate) reserved: u64,
    draw_outstanding: u32,
    exhausted: bool,
    pub(crate) is_final: bool,
    short: bool,
    /// Pending-groups bitset, levels 2 and 3 (levels 0 and 1 live in the group slots).
    pending_l2: [u64; 64],
    pending_l3: u64,
    /// The plan policy's frontier, cached between changes of the incomplete list or the batch:
    /// `(len, last group)`; `last == NIL` with `len > 0` means every incomplete group.
    pub(crate) frontier_cache: (u32, u32),
    pub(crate) frontier_dirty: bool,
}

impl<'a> Scheduler<'a> {
    /// A scheduler over caller storage: one group slot per prompt a step may draw, one request
    /// slot per sample (extensions included). At most 2^24 group slots and `u32::MAX - 1`
    /// request slots are used; longer slices are used only up to that length.
    ///
    /// ```
    /// use rolloutpipe_core::{GroupSlot, RequestSlot, Scheduler};
    /// let mut g = [GroupSlot::EMPTY; 8];
    /// let mut r = [RequestSlot::EMPTY; 32];
    /// let s = Scheduler::new(&mut g, &mut r);
    /// assert_eq!(s.capacity(), (8, 32));
    /// ```
    pub const fn new(groups: &'a mut [GroupSlot], requests: &'a mut [RequestSlot]) -> Self {
        let max = (NIL - 1) as usize;
        let group_cap = if groups.len() > MAX_GROUPS {
            MAX_GROUPS as u32
        } else {
            groups.len() as u32
        };
        let req_cap = if requests.len() > max {
            max as u32
        } else {
            requests.len() as u32
        };
        Scheduler {
            groups,
            reqs: requests,
            group_cap,
            req_cap,
            phase: StepPhase::Idle,
            step: StepId(0),
            version: PolicyVersion(0),
            plan: Plan::new(1, 1),
            began_at: Tick(0),
            final_at: None,
            done_at: None,
            req_used: 0,
            req_holes: 0,
            counters: Counters {
                drawn: 0,
                queued: 0,
                generating: 0,
                materializing: 0,
                trainable: 0,
                dispatched: 0,
                trained: 0,
                filtered_zero_variance: 0,
                filtered_non_finite: 0,
                filtered_attempts: 0,
                filtered_skipped: 0,
                aborted: 0,
                requests_admitted: 0,
                requests_generated: 0,
                requests_rewarded: 0,
                requests_failed: 0,
                requests_aborted: 0,
                requests_discarded: 0,
                requests_requeued: 0,
                requests_dropped: 0,
                in_flight: 0,
            },
            incomplete: List::EMPTY,
            queue: List::EMPTY,
            aborts: List::EMPTY,
            ready_head: NIL,
            ready_tail: NIL,
            dispatched: 0,
            released_groups: 0,
            mb_released: 0,
            mb_consumed: 0,
            trained_since_opt: 0,
            consumed_groups: 0,
            mb_scan: 0,
            mb_acc: 0,
            fill_acc: 0,
            fill_units: 0,
            opt_done: 0,
            opt_announced: false,
            slots_ceiling: 0,
            held_head: NIL,
            held_tail: NIL,
            held_len: 0,
            samples_used: 0,
            reserved: 0,
            draw_outstanding: 0,
            exhausted: false,
            is_final: false,
            short: false,
            pending_l2: [0; 64],
            pending_l3: 0,
            frontier_cache: (0, NIL),
            frontier_dirty: true,
        }
    }

    /// The same scheduler over other storage slices: for [`OwnedScheduler`](crate::OwnedScheduler),
    /// which parks its state over empty slices between borrows. The caller guarantees the slices
    /// are the ones the state was built on (or empty, to park it).
    pub(crate) fn rebind<'b>(
        self,
        groups: &'b mut [GroupSlot],
        reqs: &'b mut [RequestSlot],
    ) -> Scheduler<'b> {
        Scheduler {
            groups,
            reqs,
            group_cap: self.group_cap,
            req_cap: self.req_cap,
            phase: self.phase,
            step: self.step,
            version: self.version,
            plan: self.plan,
            began_at: self.began_at,
            final_at: self.final_at,
            done_at: self.done_at,
            req_used: self.req_used,
            req_holes: self.req_holes,
            counters: self.counters,
            incomplete: self.incomplete,
            queue: self.queue,
            aborts: self.aborts,
            ready_head: self.ready_head,
            ready_tail: self.ready_tail,
            dispatched: self.dispatched,
            released_groups: self.released_groups,
            mb_released: self.mb_released,
            mb_consumed: self.mb_consumed,
            trained_since_opt: self.trained_since_opt,
            consumed_groups: self.consumed_groups,
            mb_scan: self.mb_scan,
            mb_acc: self.mb_acc,
            fill_acc: self.fill_acc,
            fill_units: self.fill_units,
            opt_done: self.opt_done,
            opt_announced: self.opt_announced,
            slots_ceiling: self.slots_ceiling,
            held_head: self.held_head,
            held_tail: self.held_tail,
            held_len: self.held_len,
            samples_used: self.samples_used,
            reserved: self.reserved,
            draw_outstanding: self.draw_outstanding,
            exhausted: self.exhausted,
            is_final: self.is_final,
            short: self.short,
            pending_l2: self.pending_l2,
            pending_l3: self.pending_l3,
            frontier_cache: self.frontier_cache,
            frontier_dirty: self.frontier_dirty,
        }
    }

    // ----- read-only accessors --------------------------------------------------------------

    /// A read-only view for admission policies.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert_eq!(storage.scheduler().view().pending_requests(), 0);
    /// ```
    pub fn view(&self) -> View<'_, 'a> {
        View { s: self }
    }

    /// `(group slots, request slots)` usable.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<3, 5>::new();
    /// assert_eq!(storage.scheduler().capacity(), (3, 5));
    /// ```
    pub fn capacity(&self) -> (u32, u32) {
        (self.group_cap, self.req_cap)
    }

    /// Where the step protocol is.
    ///
    /// ```
    /// # use rolloutpipe_core::{SchedulerStorage, StepPhase};
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert_eq!(storage.scheduler().phase(), StepPhase::Idle);
    /// ```
    pub fn phase(&self) -> StepPhase {
        self.phase
    }

    /// The current (or last) step and its version, once a step has begun.
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(4), PolicyVersion(9), Plan::new(1, 2)).unwrap();
    /// assert_eq!(s.step(), Some((StepId(4), PolicyVersion(9))));
    /// ```
    pub fn step(&self) -> Option<(StepId, PolicyVersion)> {
        (self.phase != StepPhase::Idle).then_some((self.step, self.version))
    }

    /// The current (or last) step's plan.
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert_eq!(s.plan().unwrap().group_size, 2);
    /// ```
    pub fn plan(&self) -> Option<&Plan> {
        (self.phase != StepPhase::Idle).then_some(&self.plan)
    }

    /// The step's counters.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(storage.scheduler().counters().is_conserved());
    /// ```
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Requests holding a slot (in flight or being aborted).
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert_eq!(storage.scheduler().slots_in_use(), 0);
    /// ```
    pub fn slots_in_use(&self) -> u32 {
        self.counters.in_flight
    }

    /// Whether the batch is final: B trainable groups, or short with nothing left to draw.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(!storage.scheduler().is_batch_final());
    /// ```
    pub fn is_batch_final(&self) -> bool {
        self.is_final
    }

    /// Whether the trainer must apply an optimizer step before the next micro-batch.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(!storage.scheduler().optimizer_step_due());
    /// ```
    pub fn optimizer_step_due(&self) -> bool {
        self.trained_since_opt > 0
            && (self.trained_since_opt >= self.plan.groups_per_opt_step()
                || (self.is_final && self.counters.trained == self.counters.batch_filled()))
    }

    /// Optimizer steps applied in this step.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert_eq!(storage.scheduler().optimizer_steps_done(), 0);
    /// ```
    pub fn optimizer_steps_done(&self) -> u32 {
        self.opt_done
    }

    /// The step's summary so far (`None` before the first step).
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(3), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert_eq!(s.summary().unwrap().began_at, Tick(3));
    /// ```
    pub fn summary(&self) -> Option<StepSummary> {
        (self.phase != StepPhase::Idle).then(|| StepSummary {
            step: self.step,
            version: self.version,
            began_at: self.began_at,
            batch_final_at: self.final_at,
            done_at: self.done_at,
            batch_groups: if self.is_final {
                self.counters.batch_filled()
            } else {
                self.plan.batch_groups
            },
            short: self.short,
            counters: self.counters,
        })
    }

    /// A snapshot of group `g` of the current step.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, SchedulerStorage};
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(storage.scheduler().group(GroupId(0)).is_none());
    /// ```
    pub fn group(&self, g: GroupId) -> Option<GroupInfo> {
        let s = self.slot(g)?;
        Some(GroupInfo {
            state: s.state,
            target: s.target,
            pending: s.pending,
            in_flight: s.in_flight,
            generated: s.generated,
            rewarded: s.rewarded,
            tokens: s.tokens,
            reward_mean: s.mean,
            reward_var: if s.rewarded == 0 {
                0.0
            } else {
                s.m2 / s.rewarded as f64
            },
            drawn_at: s.drawn_at,
            ended_at: s.ended_at,
            dispatch_seq: (s.dispatch_seq != NIL).then_some(s.dispatch_seq),
        })
    }

    /// Group `g`'s rewards by sample index (`None` where not recorded). The core keeps them so
    /// the trainer can compute advantages when the group is dispatched.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// s.on_request_finished(Tick(1), a.request, PolicyVersion(0), 3, 0.5).unwrap();
    /// let r: Vec<Option<f32>> = s.group_rewards(GroupId(0)).unwrap().collect();
    /// assert_eq!(r, [Some(0.5), None]);
    /// ```
    pub fn group_rewards(&self, g: GroupId) -> Option<impl Iterator<Item = Option<f32>> + '_> {
        let s = self.slot(g)?;
        let reqs = &self.reqs[s.first as usize..(s.first + s.target as u32) as usize];
        Some(
            reqs.iter()
                .map(|r| (r.state == RequestState::Rewarded).then_some(r.reward)),
        )
    }

    /// Group `g`'s generated token counts by sample index (`None` where not generated).
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 1)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// s.on_request_generated(Tick(1), a.request, PolicyVersion(0), 7).unwrap();
    /// assert_eq!(s.group_tokens(GroupId(0)).unwrap().collect::<Vec<_>>(), [Some(7)]);
    /// ```
    pub fn group_tokens(&self, g: GroupId) -> Option<impl Iterator<Item = Option<u32>> + '_> {
        let s = self.slot(g)?;
        let reqs = &self.reqs[s.first as usize..(s.first + s.target as u32) as usize];
        Some(reqs.iter().map(|r| {
            matches!(r.state, RequestState::Generated | RequestState::Rewarded).then_some(r.tokens)
        }))
    }

    /// The current state and attempt of a request slot (any attempt number accepted).
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, RequestState, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 1)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.request_state(GroupId(0), 0), Some((RequestState::Pending, 0)));
    /// ```
    pub fn request_state(&self, g: GroupId, sample: u16) -> Option<(RequestState, u8)> {
        let s = self.slot(g)?;
        if sample >= s.target {
            return None;
        }
        let r = &self.reqs[(s.first + sample as u32) as usize];
        Some((r.state, r.attempt))
    }

    /// The group dispatched with sequence number `seq`.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(storage.scheduler().dispatched_group(0).is_none());
    /// ```
    pub fn dispatched_group(&self, seq: u32) -> Option<GroupId> {
        (self.phase != StepPhase::Idle && seq < self.dispatched)
            .then(|| GroupId(self.groups[seq as usize].by_seq))
    }

    // ----- the one place group states change ----------------------------------------------

    /// Moves group `g` to `new`, keeping the per-state counters in step (and logging `A=>B`
    /// with the `log` or `defmt` feature). Callers guarantee the transition is legal.
    fn set_state(&mut self, g: u32, new: GroupState) {
        let old = self.groups[g as usize].state;
        #[cfg(feature = "log")]
        log::trace!("{} g{}: {} => {}", self.step, g, old, new);
        #[cfg(feature = "defmt")]
        defmt::trace!("{} g{}: {} => {}", self.step.0, g, old, new);
        *self.count_mut(old) -= 1;
        *self.count_mut(new) += 1;
        self.groups[g as usize].state = new;
    }

    /// Moves request slot `idx` to `new`: the one place an existing request changes state,
    /// checked against [`RequestState::can_become`] in debug builds.
    fn set_req(&mut self, idx: u32, new: RequestState) {
        let old = self.reqs[idx as usize].state;
        debug_assert!(
            old.can_become(new),
            "illegal request transition {old} => {new}"
        );
        self.reqs[idx as usize].state = new;
    }

    fn count_mut(&mut self, s: GroupState) -> &mut u32 {
        let c = &mut self.counters;
        match s {
            GroupState::Queued => &mut c.queued,
            GroupState::Generating => &mut c.generating,
            GroupState::Materializing => &mut c.materializing,
            GroupState::Trainable => &mut c.trainable,
            GroupState::Dispatched => &mut c.dispatched,
            GroupState::Trained => &mut c.trained,
            GroupState::Filtered(FilterReason::ZeroVariance) => &mut c.filtered_zero_variance,
            GroupState::Filtered(FilterReason::NonFiniteReward) => &mut c.filtered_non_finite,
            GroupState::Filtered(FilterReason::AttemptsExhausted) => &mut c.filtered_attempts,
            GroupState::Filtered(FilterReason::Skipped(_)) => &mut c.filtered_skipped,
            GroupState::Aborted => &mut c.aborted,
        }
    }

    // ----- helpers --------------------------------------------------------------------------

    /// Group `g` has pending requests now (it had none).
    fn mark_pending(&mut self, g: u32) {
        let (w0, w1, w2) = (g >> 6, g >> 12, g >> 18);
        let l0 = &mut self.groups[w0 as usize].bits[0];
        let fresh = *l0 == 0;
        *l0 |= 1 << (g & 63);
        if !fresh {
            return;
        }
        let l1 = &mut self.groups[w1 as usize].bits[1];
        let fresh = *l1 == 0;
        *l1 |= 1 << (w0 & 63);
        if !fresh {
            return;
        }
        self.pending_l2[w2 as usize] |= 1 << (w1 & 63);
        self.pending_l3 |= 1 << w2;
    }

    /// Group `g` has no pending request any more.
    fn unmark_pending(&mut self, g: u32) {
        let (w0, w1, w2) = (g >> 6, g >> 12, g >> 18);
        let l0 = &mut self.groups[w0 as usize].bits[0];
        *l0 &= !(1 << (g & 63));
        if *l0 != 0 {
            return;
        }
        let l1 = &mut self.groups[w1 as usize].bits[1];
        *l1 &= !(1 << (w0 & 63));
        if *l1 != 0 {
            return;
        }
        let l2 = &mut self.pending_l2[w2 as usize];
        *l2 &= !(1 << (w1 & 63));
        if *l2 == 0 {
            self.pending_l3 &= !(1 << w2);
        }
    }

    /// The lowest-numbered group with a pending request: four word reads.
    pub(crate) fn first_pending_group(&self) -> Option<u32> {
        if self.pending_l3 == 0 {
            return None;
        }
        let w2 = self.pending_l3.trailing_zeros();
        let w1 = (w2 << 6) | self.pending_l2[w2 as usize].trailing_zeros();
        let w0 = (w1 << 6) | self.groups[w1 as usize].bits[1].trailing_zeros();
        Some((w0 << 6) | self.groups[w0 as usize].bits[0].trailing_zeros())
    }

    pub(crate) fn slot(&self, g: GroupId) -> Option<&GroupSlot> {
        (self.phase != StepPhase::Idle && g.0 < self.counters.drawn)
            .then(|| &self.groups[g.0 as usize])
    }

    fn pending_index(&self, r: RequestRef) -> Option<u32> {
        let s = self.slot(r.group)?;
        if r.sample >= s.target {
            return None;
        }
        let idx = s.first + r.sample as u32;
        (self.reqs[idx as usize].state == RequestState::Pending).then_some(idx)
    }

    fn lookup(&self, id: RequestId) -> Result<u32, RequestError> {
        if self.phase == StepPhase::Idle {
            return Err(RequestError::NoActiveStep);
        }
        if id.step != self.step {
            return Err(RequestError::OtherStep {
                current: self.step,
                given: id.step,
            });
        }
        let Some(s) = self.slot(id.group) else {
            return Err(RequestError::UnknownGroup { group: id.group });
        };
        if id.sample >= s.target {
            return Err(RequestError::UnknownSample {
                group: id.group,
                sample: id.sample,
                target: s.target,
            });
        }
        let idx = s.first + id.sample as u32;
        let current = self.reqs[idx as usize].attempt;
        if id.attempt != current {
            return Err(RequestError::StaleAttempt {
                current,
                given: id.attempt,
            });
        }
        Ok(idx)
    }

    fn check_version(&self, given: PolicyVersion) -> Result<(), RequestError> {
        if given == self.version {
            Ok(())
        } else {
            Err(RequestError::WrongVersion {
                expected: self.version,
                given,
            })
        }
    }

    fn apply_generated(&mut self, idx: u32, tokens: u32, now: Tick) {
        let _ = now;
        self.set_req(idx, RequestState::Generated);
        let r = &mut self.reqs[idx as usize];
        r.tokens = tokens;
        let g = r.group;
        self.counters.in_flight -= 1;
        self.counters.requests_generated += 1;
        let gs = &mut self.groups[g as usize];
        gs.in_flight -= 1;
        gs.generated += 1;
        gs.tokens += tokens as u64;
        if gs.generated == gs.target {
            self.set_state(g, GroupState::Materializing);
        }
    }

    /// Records a reward of a `Generated` request; returns the group's new state.
    fn apply_reward(&mut self, idx: u32, reward: f32, now: Tick) -> GroupState {
        self.set_req(idx, RequestState::Rewarded);
        let r = &mut self.reqs[idx as usize];
        r.reward = reward;
        let g = r.group;
        self.counters.requests_rewarded += 1;
        let gs = &mut self.groups[g as usize];
        gs.rewarded += 1;
        if !reward.is_finite() {
            self.end_group(g, GroupState::Filtered(FilterReason::NonFiniteReward), now);
            return self.groups[g as usize].state;
        }
        // Welford: stable for long groups, and every earlier reward was finite (a non-finite one
        // would have ended the group).
        let x = reward as f64;
        let n = gs.rewarded as f64;
        let d = x - gs.mean;
        gs.mean += d / n;
        gs.m2 += d * (x - gs.mean);
        gs.min = gs.min.min(reward);
        gs.max = gs.max.max(reward);
        if gs.rewarded == gs.target {
            if self.plan.hold_scored {
                self.hold(g);
            } else {
                self.commit_scored(g, now);
            }
        }
        self.groups[g as usize].state
    }

    /// Ends a fully scored group: trainable, or filtered for zero variance.
    pub(crate) fn commit_scored(&mut self, g: u32, now: Tick) {
        let gs = &self.groups[g as usize];
        if gs.m2 / gs.rewarded as f64 <= ZERO_VARIANCE {
            self.end_group(g, GroupState::Filtered(FilterReason::ZeroVariance), now);
        } else {
            self.end_group(g, GroupState::Trainable, now);
        }
    }

    /// Appends a fully scored group to the held list (it stays `Materializing`).
    fn hold(&mut self, g: u32) {
        let tail = self.held_tail;
        let gs = &mut self.groups[g as usize];
        gs.held = true;
        gs.hold_link = Link {
            prev: tail,
            next: NIL,
        };
        if tail == NIL {
            self.held_head = g;
        } else {
            self.groups[tail as usize].hold_link.next = g;
        }
        self.held_tail = g;
        self.held_len += 1;
    }

    /// Gives group `g`'s budget reserve back (it was decided, extended or ended).
    pub(crate) fn release_reserve(&mut self, g: u32) {
        let r = core::mem::take(&mut self.groups[g as usize].reserve);
        self.reserved -= r as u64;
    }

    /// Takes group `g` off the held list (if it is on it).
    pub(crate) fn unhold(&mut self, g: u32) {
        if !self.groups[g as usize].held {
            return;
        }
        let Link { prev, next } = self.groups[g as usize].hold_link;
        if prev == NIL {
            self.held_head = next;
        } else {
            self.groups[prev as usize].hold_link.next = next;
        }
        if next == NIL {
            self.held_tail = prev;
        } else {
            self.groups[next as usize].hold_link.prev = prev;
        }
        let gs = &mut self.groups[g as usize];
        gs.held = false;
        gs.hold_link = Link::NONE;
        self.held_len -= 1;
    }

    /// Takes an incomplete group out of the rollout: drops its pending and reward-pending
    /// requests, marks running ones for abort, and moves it to `end` (Trainable, Filtered or
    /// Aborted). A trainable group joins the trainer FIFO; the B-th one makes the batch final.
    pub(crate) fn end_group(&mut self, g: u32, end: GroupState, now: Tick) {
        self.unhold(g);
        self.release_reserve(g);
        let s = self.groups[g as usize];
        for idx in s.first..s.first + s.target as u32 {
            match self.reqs[idx as usize].state {
                RequestState::Pending => {
                    self.queue.remove(self.reqs, idx);
                    self.set_req(idx, RequestState::Cancelled);
                    self.counters.requests_dropped += 1;
                }
                RequestState::InFlight => {
                    self.set_req(idx, RequestState::AbortPending);
                    self.aborts.push_back(self.reqs, idx);
                }
                RequestState::Generated => {
                    self.set_req(idx, RequestState::Dropped);
                    self.counters.requests_dropped += 1;
                }
                _ => {}
            }
        }
        if self.groups[g as usize].pending > 0 {
            self.unmark_pending(g);
        }
        let gs = &mut self.groups[g as usize];
        gs.pending = 0;
        gs.in_flight = 0;
        gs.ended_at = Some(now);
        self.frontier_on_remove(g);
        self.incomplete.remove(self.groups, g);
        self.set_state(g, end);
        if end == GroupState::Trainable {
            self.account_fill(g);
        }
        self.frontier_resize();
        if end == GroupState::Trainable {
            if self.ready_tail == NIL {
                self.ready_head = g;
            } else {
                self.groups[self.ready_tail as usize].next_ready = g;
            }
            self.ready_tail = g;
            if self.counters.batch_filled() >= self.plan.batch_groups {
                self.make_final(now, false);
            }
        }
    }

    /// Units of group `g` in the plan's micro-batch unit.
    pub(crate) fn mb_units(&self, g: u32) -> u64 {
        let s = &self.groups[g as usize];
        match self.plan.micro_batch_unit {
            MicroBatchUnit::Groups => 1,
            MicroBatchUnit::Samples => s.target as u64,
            MicroBatchUnit::Tokens => s.tokens,
        }
    }

    /// Whether a micro-batch holding `acc` units and ending at the `end`-th group is cut there.
    pub(crate) fn mb_cut_at(&self, acc: u64, end: u32) -> bool {
        acc >= self.plan.micro_batch as u64 || end.is_multiple_of(self.plan.groups_per_opt_step())
    }

    /// Group `g` just filled the batch further: replay the micro-batch cut on it.
    fn account_fill(&mut self, g: u32) {
        let u = self.mb_units(g);
        self.fill_units += u;
        self.fill_acc += u;
        if self.mb_cut_at(self.fill_acc, self.counters.batch_filled()) {
            self.fill_acc = 0;
        }
    }

    fn make_final(&mut self, now: Tick, short: bool) {
        self.is_final = true;
        self.short = short;
        self.final_at = Some(now);
        self.draw_outstanding = 0;
        while self.incomplete.head != NIL {
            let g = self.incomplete.head;
            self.end_group(g, GroupState::Aborted, now);
        }
        // A short batch can turn final with no group left to end: the frontier empties here.
        self.frontier_resize();
    }

    /// Puts an admitted request back at the front of the queue without burning an attempt.
    fn requeue(&mut self, now: Tick, id: RequestId) -> Result<Failure, RequestError> {
        let idx = self.lookup(id)?;
        match self.reqs[idx as usize].state {
            RequestState::InFlight => {
                let r = self.reqs[idx as usize];
                let g = r.group;
                self.counters.requests_requeued += 1;
                self.counters.in_flight -= 1;
                self.set_req(idx, RequestState::Pending);
                self.queue.push_front(self.reqs, idx);
                if self.groups[g as usize].pending == 0 {
                    self.mark_pending(g);
                }
                let gs = &mut self.groups[g as usize];
                gs.in_flight -= 1;
                gs.pending += 1;
                gs.low = gs.low.min(r.sample);
                self.after_event(now);
                Ok(Failure::Retried { attempt: r.attempt })
            }
            RequestState::AbortPending | RequestState::AbortSent => {
                self.end_aborting(idx, RequestState::Unused, now);
                Ok(Failure::AbortAcked)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// A request being aborted stopped. `then` says how: `Unused` when the abort was acked (or
    /// the request failed), `Cancelled` when it finished with its reward, `Dropped` when it
    /// generated a response whose reward may still come; the result is discarded.
    fn end_aborting(&mut self, idx: u32, then: RequestState, now: Tick) {
        if self.reqs[idx as usize].state == RequestState::AbortPending {
            self.aborts.remove(self.reqs, idx);
        }
        let acked = then == RequestState::Unused;
        self.set_req(idx, if acked { RequestState::Cancelled } else { then });
        self.counters.in_flight -= 1;
        if acked {
            self.counters.requests_aborted += 1;
        } else {
            self.counters.requests_discarded += 1;
        }
        self.after_event(now);
    }

    /// Moves group `g`'s request records to the end of the used storage; its old range becomes
    /// a hole that `compact` reclaims.
    fn relocate(&mut self, g: u32) {
        let s = self.groups[g as usize];
        let (old, new, n) = (s.first, self.req_used, s.target as u32);
        self.move_block(old, new, n);
        for k in 0..n {
            self.reqs[(old + k) as usize] = RequestSlot::EMPTY;
        }
        self.groups[g as usize].first = new;
        self.req_used = new + n;
        self.req_holes += n;
    }

    /// Copies the `n` records at `old` to `new` (ascending, so a move downwards may overlap),
    /// fixing the queue and abort-list links of, and to, the moved records.
    fn move_block(&mut self, old: u32, new: u32, n: u32) {
        let moved = |i: u32| {
            if i != NIL && i >= old && i < old + n {
                new + (i - old)
            } else {
                i
            }
        };
        for k in 0..n {
            let mut r = self.reqs[(old + k) as usize];
            r.link = Link {
                prev: moved(r.link.prev),
                next: moved(r.link.next),
            };
            self.reqs[(new + k) as usize] = r;
        }
        self.relink_range(new, new + n);
    }

    /// Points the list neighbours (and list ends) of the records in `from..to` at them, after
    /// the records moved there with their own links already fixed.
    fn relink_range(&mut self, from: u32, to: u32) {
        for i in from..to {
            match self.reqs[i as usize].state {
                RequestState::Pending => self.queue.relink(self.reqs, i),
                RequestState::AbortPending => self.aborts.relink(self.reqs, i),
                _ => {}
            }
        }
    }

    /// Moves group `g`'s records (in a compacted storage) to the end by rotating the records
    /// from its `first` to `req_used` in place: no spare room needed. O(records rotated).
    fn rotate_to_tail(&mut self, g: u32) {
        let (a, end) = (self.groups[g as usize].first, self.req_used);
        let t = self.groups[g as usize].target as u32;
        if a + t == end {
            return;
        }
        self.reqs[a as usize..end as usize].rotate_left(t as usize);
        let moved = |i: u32| match i {
            NIL => NIL,
            i if i < a || i >= end => i,
            i if i < a + t => end - t + (i - a),
            i => i - t,
        };
        // Links first (all of them, so that relinking reads fixed neighbours), then neighbours.
        for i in a..end {
            let l = self.reqs[i as usize].link;
            self.reqs[i as usize].link = Link {
                prev: moved(l.prev),
                next: moved(l.next),
            };
        }
        self.relink_range(a, end);
        // The blocks after g moved down by t, in storage order.
        let mut i = a;
        while i < end - t {
            let h = self.reqs[i as usize].group;
            self.groups[h as usize].first = i;
            i += self.groups[h as usize].target as u32;
        }
        self.groups[g as usize].first = end - t;
    }

    /// Slides every live group's records down over the holes relocations left, in storage
    /// order, so extensions in tight storage reuse the space instead of running out. O(used
    /// request slots), allocation-free; runs only when an extension would not fit otherwise.
    /// Request ids stay valid: a record is found through its group's `first`.
    pub(crate) fn compact(&mut self) {
        let (mut read, mut write) = (0u32, 0u32);
        while read < self.req_used {
            let r = self.reqs[read as usize];
            let g = r.group;
            // A hole is `Unused` (a drawn group's records never are); a block starts at its
            // group's `first`.
            let starts = r.state != RequestState::Unused
                && g < self.counters.drawn
                && self.groups[g as usize].first == read;
            if !starts {
                read += 1;
                continue;
            }
            let n = self.groups[g as usize].target as u32;
            if read != write {
                self.move_block(read, write, n);
                self.groups[g as usize].first = write;
            }
            read += n;
            write += n;
        }
        for i in write..self.req_used {
            self.reqs[i as usize] = RequestSlot::EMPTY;
        }
        self.req_used = write;
        self.req_holes = 0;
    }

    // ----- the frontier cache, kept exact in O(1 + |change of its length|) per event ----------
    //
    // `frontier_cache = (n, last)`: the frontier is the first `n` incomplete groups in draw
    // order and `last` the n-th of them, or NIL when fewer than `n` exist. Re-walking it from
    // the head at every change cost O(n) per completion, O(B^2) per step under `Sync`, where n
    // is the whole batch; these three updates move `last` only as far as the change requires.
    // The audit compares the cache with a full walk after every event in the tests.

    /// Group `g` is about to leave the incomplete list.
    fn frontier_on_remove(&mut self, g: u32) {
        let last = self.frontier_cache.1;
        if last != NIL && g <= last {
            // g's place goes to the first incomplete group after `last` (if g is `last`, its
            // own successor).
            self.frontier_cache.1 = self.groups[last as usize].link.next;
        }
    }

    /// Groups `first .. first + count` were appended to the incomplete list.
    fn frontier_on_append(&mut self, first: u32, count: u32) {
        let (n, last) = self.frontier_cache;
        if n == 0 || last != NIL {
            return;
        }
        let before = self.incomplete.len - count;
        if before + count >= n {
            self.frontier_cache.1 = first + (n - before) - 1;
        }
    }

    /// The frontier's length may have changed (the batch filled further, or became final).
    fn frontier_resize(&mut self) {
        let new = self.view().frontier_len();
        let (n, mut last) = self.frontier_cache;
        if new == n {
            return;
        }
        if new == 0 {
            self.frontier_cache = (0, NIL);
            return;
        }
        if new < n {
            let mut back = n - new;
            if last == NIL {
                // Fewer than n existed: count back from the tail.
                let len = self.incomplete.len;
                if len < new {
                    self.frontier_cache = (new, NIL);
                    return;
                }
                last = self.incomplete.tail;
                back = len - new;
            }
            for _ in 0..back {
                last = self.groups[last as usize].link.prev;
            }
        } else if n == 0 {
            last = self.view().walk_frontier(new).1;
        } else {
            for _ in 0..new - n {
                if last == NIL {
                    break;
                }
                last = self.groups[last as usize].link.next;
            }
        }
        self.frontier_cache = (new, last);
    }

    /// Settles what an event may have made true: a short final batch, the end of the step.
    pub(crate) fn after_event(&mut self, now: Tick) {
        if self.phase != StepPhase::Active {
            return;
        }
        if !self.is_final && self.counters.incomplete() == 0 && self.draws_closed() {
            self.make_final(now, true);
        }
        if self.is_final
            && self.counters.trained == self.counters.batch_filled()
            && !self.optimizer_step_due()
            && self.counters.in_flight == 0
        {
            self.phase = StepPhase::Done;
            self.done_at = Some(now);
        }
    }
}

#[cfg(test)]
mod tests;
