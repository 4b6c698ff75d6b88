//! The state machine: events in (`on_*`), decisions out (`poll_*`). All group state changes go
//! through [`Scheduler::set_state`]; all request-slot bookkeeping through a handful of private
//! helpers next to it.

use crate::error::{
    AdmitError, BeginError, DrawError, ExtendError, RequestError, SlotsError, TrainError,
};
use crate::policy::{Admit, View};
use crate::state::{Counters, FilterReason, GroupState, RequestState, StepPhase, StepSummary};
use crate::storage::{GroupSlot, Link, List, NIL, RequestSlot};
use crate::types::{
    DispatchPolicy, GroupId, Plan, PlanError, PolicyVersion, RequestId, RequestRef, StepId,
    SubmitOrder, Tick,
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

/// A broken internal invariant, found by [`Scheduler::audit`].
///
/// ```
/// use rolloutpipe_core::AuditError;
/// let e = AuditError { what: "queue length", index: 0 };
/// assert_eq!(e.what, "queue length");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AuditError {
    /// Which invariant.
    pub what: &'static str,
    /// The group, request slot or count where it broke.
    pub index: u64,
}

impl core::fmt::Display for AuditError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "invariant broken: {} (at {})", self.what, self.index)
    }
}

impl core::error::Error for AuditError {}

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
            opt_done: 0,
            opt_announced: false,
            slots_ceiling: 0,
            held_head: NIL,
            held_tail: NIL,
            held_len: 0,
            samples_used: 0,
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
            opt_done: self.opt_done,
            opt_announced: self.opt_announced,
            slots_ceiling: self.slots_ceiling,
            held_head: self.held_head,
            held_tail: self.held_tail,
            held_len: self.held_len,
            samples_used: self.samples_used,
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

    // ----- events -------------------------------------------------------------------------

    /// Starts step `step` with policy version `version`. Allowed before the first step and once
    /// the previous step is `Done`; step ids must increase.
    ///
    /// ```
    /// use rolloutpipe_core::{BeginError, Plan, PlanError, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 16>::new();
    /// let mut s = storage.scheduler();
    /// assert_eq!(s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(5, 1)),
    ///     Err(BeginError::Plan(PlanError::GroupCapacity { needed: 10, capacity: 4 })));
    /// assert!(s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 4)).is_ok());
    /// ```
    pub fn begin_step(
        &mut self,
        now: Tick,
        step: StepId,
        version: PolicyVersion,
        plan: Plan,
    ) -> Result<(), BeginError> {
        match self.phase {
            StepPhase::Active => return Err(BeginError::StepInProgress { step: self.step }),
            StepPhase::Done if step <= self.step => {
                return Err(BeginError::StaleStep {
                    last: self.step,
                    given: step,
                });
            }
            _ => {}
        }
        plan.validate().map_err(BeginError::Plan)?;
        if plan.max_groups > self.group_cap {
            return Err(BeginError::Plan(PlanError::GroupCapacity {
                needed: plan.max_groups,
                capacity: self.group_cap,
            }));
        }
        // Every draw `poll_draw` may ask for must fit: over-sampling draws up to `max_groups`
        // prompts of G samples. Refusing here, once, keeps `poll_draw` a promise (a refused draw
        // would leave its reservation behind and the step stalled), where clamping the draws
        // instead would silently over-sample less than the plan says.
        let needed = plan.max_groups as u64 * plan.group_size as u64;
        if needed > self.req_cap as u64 {
            return Err(BeginError::Plan(PlanError::RequestCapacity {
                needed,
                capacity: self.req_cap,
            }));
        }
        // Slots of earlier steps are never read again: validity is `group < drawn` and
        // `request < req_used`, so a new step costs O(1) whatever the storage size.
        *self = Scheduler {
            phase: StepPhase::Active,
            step,
            version,
            plan,
            began_at: now,
            ..Scheduler::new(
                core::mem::take(&mut self.groups),
                core::mem::take(&mut self.reqs),
            )
        };
        // No group is incomplete yet: the frontier is "every incomplete group" of its length.
        self.frontier_cache = (self.view().frontier_len(), NIL);
        self.frontier_dirty = false;
        Ok(())
    }

    /// `n` prompts were drawn from the data source, in order; returns the first one's id (the
    /// others follow consecutively). Their requests enter the waiting queue in the policy's
    /// submission order.
    ///
    /// ```
    /// use rolloutpipe_core::{DrawError, GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 16>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 4)).unwrap();
    /// assert_eq!(s.on_prompts_drawn(Tick(0), 3), Ok(GroupId(0)));
    /// assert_eq!(s.on_prompts_drawn(Tick(0), 2), Err(DrawError::MaxGroups { drawn: 3, requested: 2, max_groups: 4 }));
    /// ```
    pub fn on_prompts_drawn(&mut self, now: Tick, n: u32) -> Result<GroupId, DrawError> {
        if self.phase != StepPhase::Active {
            return Err(DrawError::NoActiveStep);
        }
        if self.is_final || self.exhausted {
            return Err(DrawError::DrawsClosed);
        }
        if n == 0 {
            return Err(DrawError::ZeroCount);
        }
        let drawn = self.counters.drawn;
        if drawn as u64 + n as u64 > self.plan.max_groups as u64 {
            return Err(DrawError::MaxGroups {
                drawn,
                requested: n,
                max_groups: self.plan.max_groups,
            });
        }
        if drawn as u64 + n as u64 > self.group_cap as u64 {
            return Err(DrawError::GroupsFull { requested: n });
        }
        if n > self.budget_prompts() {
            return Err(DrawError::SampleBudget { requested: n });
        }
        let g_size = self.plan.group_size as u32;
        let total = n as u64 * g_size as u64;
        // Unreachable under begin_step's capacity contract (extensions keep the storage for
        // the prompts still drawable reserved); kept so that a broken invariant is an error,
        // not an out-of-bounds panic.
        if self.req_used as u64 + total > self.req_cap as u64 {
            return Err(DrawError::RequestsFull { requested: n });
        }
        let base = self.req_used;
        for i in 0..n {
            let g = drawn + i;
            let first = base + i * g_size;
            self.groups[g as usize] = GroupSlot {
                state: GroupState::Queued,
                target: self.plan.group_size,
                pending: self.plan.group_size,
                first,
                drawn_at: now,
                ..GroupSlot::EMPTY
            };
            for s in 0..self.plan.group_size {
                self.reqs[(first + s as u32) as usize] = RequestSlot {
                    state: RequestState::Pending,
                    sample: s,
                    group: g,
                    ..RequestSlot::EMPTY
                };
            }
            self.incomplete.push_back(self.groups, g);
            self.mark_pending(g);
            self.counters.drawn += 1;
            self.counters.queued += 1;
        }
        self.req_used = base + n * g_size;
        let total = n * g_size;
        self.samples_used += total as u64;
        match self.plan.admission.submit_order() {
            SubmitOrder::GroupMajor => {
                for k in 0..total {
                    self.queue.push_back(self.reqs, base + k);
                }
            }
            SubmitOrder::Interleaved => {
                for s in 0..g_size {
                    for i in 0..n {
                        self.queue.push_back(self.reqs, base + i * g_size + s);
                    }
                }
            }
            SubmitOrder::Shuffled { seed } => {
                let mut rng = SplitMix64(
                    seed ^ self.step.0.wrapping_mul(0xA076_1D64_78BD_642F) ^ ((drawn as u64) << 32),
                );
                for k in 0..total {
                    self.reqs[(base + k) as usize].aux = k;
                }
                for k in (1..total).rev() {
                    let j = rng.below(k + 1);
                    let a = self.reqs[(base + k) as usize].aux;
                    self.reqs[(base + k) as usize].aux = self.reqs[(base + j) as usize].aux;
                    self.reqs[(base + j) as usize].aux = a;
                }
                for k in 0..total {
                    let idx = base + self.reqs[(base + k) as usize].aux;
                    self.queue.push_back(self.reqs, idx);
                }
            }
        }
        self.draw_outstanding = self.draw_outstanding.saturating_sub(n);
        self.frontier_on_append(drawn, n);
        Ok(GroupId(drawn))
    }

    /// One prompt was drawn (`on_prompts_drawn(now, 1)`).
    ///
    /// ```
    /// use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 16>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 4)).unwrap();
    /// assert_eq!(s.on_prompt_drawn(Tick(0)), Ok(GroupId(0)));
    /// assert_eq!(s.on_prompt_drawn(Tick(0)), Ok(GroupId(1)));
    /// ```
    pub fn on_prompt_drawn(&mut self, now: Tick) -> Result<GroupId, DrawError> {
        self.on_prompts_drawn(now, 1)
    }

    /// The data source has no more prompts: no more draws this step. If nothing is left in
    /// progress the batch becomes final, short.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, StepPhase, Tick};
    /// let mut storage = SchedulerStorage::<4, 16>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 4)).unwrap();
    /// s.on_data_exhausted(Tick(1)).unwrap();
    /// assert_eq!(s.phase(), StepPhase::Done);
    /// assert!(s.summary().unwrap().short);
    /// ```
    pub fn on_data_exhausted(&mut self, now: Tick) -> Result<(), DrawError> {
        if self.phase != StepPhase::Active {
            return Err(DrawError::NoActiveStep);
        }
        self.exhausted = true;
        self.draw_outstanding = 0;
        self.after_event(now);
        Ok(())
    }

    /// Gives group `group` `extra` more samples (variance-guided allocation). Allowed while the
    /// group is incomplete; a materializing group goes back to generating.
    ///
    /// The group's requests stay contiguous in storage: if other groups were drawn after it,
    /// its records move to the end of the used storage (O(target)), so storage is consumed
    /// by `target + extra`. Storage for the `max_groups − drawn` prompts the step may still draw
    /// stays reserved (until the batch is final or the data exhausted), so an extension never
    /// makes a draw that `poll_draw` asked for fail.
    ///
    /// ```
    /// use rolloutpipe_core::{ExtendError, GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// let mut plan = Plan::new(2, 2);
    /// plan.max_groups = 2; // no over-sampling: nothing to reserve once both prompts are drawn
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan).unwrap();
    /// s.on_prompts_drawn(Tick(0), 2).unwrap();
    /// s.extend_group(Tick(0), GroupId(0), 2).unwrap();
    /// assert_eq!(s.group(GroupId(0)).unwrap().target, 4);
    /// assert_eq!(s.extend_group(Tick(0), GroupId(1), 3), Err(ExtendError::RequestsFull { extra: 3 }));
    /// ```
    pub fn extend_group(
        &mut self,
        now: Tick,
        group: GroupId,
        extra: u16,
    ) -> Result<(), ExtendError> {
        let _ = now;
        if self.phase != StepPhase::Active {
            return Err(ExtendError::NoActiveStep);
        }
        let Some(slot) = self.slot(group).copied() else {
            return Err(ExtendError::UnknownGroup { group });
        };
        if !slot.state.is_incomplete() {
            return Err(ExtendError::NotExtendable { state: slot.state });
        }
        if extra == 0 {
            return Err(ExtendError::ZeroExtra);
        }
        let Some(new_target) = slot.target.checked_add(extra) else {
            return Err(ExtendError::SampleLimit {
                target: slot.target,
                extra,
            });
        };
        let at_tail = self.extension_room(group.0, extra)?;
        let g = group.0;
        // A held group goes back to generating; its new samples get a fresh decision.
        self.unhold(g);
        self.samples_used += extra as u64;
        if !at_tail {
            self.relocate(g);
        }
        let first = self.groups[g as usize].first;
        for s in slot.target..new_target {
            let idx = first + s as u32;
            self.reqs[idx as usize] = RequestSlot {
                state: RequestState::Pending,
                sample: s,
                group: g,
                ..RequestSlot::EMPTY
            };
            self.queue.push_back(self.reqs, idx);
        }
        self.req_used = first + new_target as u32;
        if self.groups[g as usize].pending == 0 {
            self.mark_pending(g);
        }
        let gs = &mut self.groups[g as usize];
        gs.target = new_target;
        gs.pending += extra;
        if gs.state == GroupState::Materializing {
            self.set_state(g, GroupState::Generating);
        }
        Ok(())
    }

    /// Checks that `extra` more samples for incomplete group `g` fit the sample budget and the
    /// request storage; returns whether the group's records are already at the storage's end.
    fn extension_room(&self, g: u32, extra: u16) -> Result<bool, ExtendError> {
        let slot = &self.groups[g as usize];
        if self.plan.sample_budget != 0
            && self.samples_used + extra as u64 > self.plan.sample_budget as u64
        {
            return Err(ExtendError::SampleBudget { extra });
        }
        let at_tail = slot.first + slot.target as u32 == self.req_used;
        let needed = if at_tail {
            extra as u64
        } else {
            slot.target as u64 + extra as u64
        };
        // Request storage for the prompts this step may still draw stays reserved, so that a
        // draw `poll_draw` asks for is always accepted (extensions cannot starve over-sampling).
        let reserved = if self.draws_closed() {
            0
        } else {
            self.plan.max_groups.saturating_sub(self.counters.drawn) as u64
                * self.plan.group_size as u64
        };
        if self.req_used as u64 + needed + reserved > self.req_cap as u64 {
            return Err(ExtendError::RequestsFull { extra });
        }
        Ok(at_tail)
    }

    /// Whether `extra` more samples for incomplete group `g` fit (budget and storage).
    pub(crate) fn extension_fits(&self, g: u32, extra: u16) -> bool {
        self.groups[g as usize].target.checked_add(extra).is_some()
            && self.extension_room(g, extra).is_ok()
    }

    /// Prompts the sample budget still allows (`u32::MAX` without a budget).
    fn budget_prompts(&self) -> u32 {
        if self.plan.sample_budget == 0 {
            return u32::MAX;
        }
        let left = (self.plan.sample_budget as u64).saturating_sub(self.samples_used);
        u32::try_from(left / self.plan.group_size as u64).unwrap_or(u32::MAX)
    }

    /// No more draws this step: the batch is final, the data exhausted, `max_groups` drawn, or
    /// the sample budget has no room for another group.
    fn draws_closed(&self) -> bool {
        self.is_final
            || self.exhausted
            || self.counters.drawn >= self.plan.max_groups
            || self.budget_prompts() == 0
    }

    /// Request `id` generated `tokens` tokens and its reward is known: `on_request_generated`
    /// and `on_reward` in one event. Checked in full before anything changes.
    ///
    /// ```
    /// use rolloutpipe_core::{Completion, GroupState, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(1), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// assert_eq!(s.on_request_finished(Tick(3), a.request, PolicyVersion(1), 10, 1.0),
    ///     Ok(Completion::Accepted { group_state: GroupState::Generating }));
    /// ```
    pub fn on_request_finished(
        &mut self,
        now: Tick,
        id: RequestId,
        version: PolicyVersion,
        tokens: u32,
        reward: f32,
    ) -> Result<Completion, RequestError> {
        let idx = self.lookup(id)?;
        self.check_version(version)?;
        match self.reqs[idx as usize].state {
            RequestState::InFlight => {
                self.apply_generated(idx, tokens, now);
                let state = self.apply_reward(idx, reward, now);
                self.after_event(now);
                Ok(Completion::Accepted { group_state: state })
            }
            RequestState::AbortPending | RequestState::AbortSent => {
                self.end_aborting(idx, RequestState::Cancelled, now);
                Ok(Completion::Discarded)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// Request `id` finished generating (`tokens` tokens); its slot is free, its reward will
    /// follow through `on_reward` (the verifier runs outside the engine).
    ///
    /// ```
    /// use rolloutpipe_core::{Completion, GroupState, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(1), Plan::new(1, 1)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// assert_eq!(s.on_request_generated(Tick(3), a.request, PolicyVersion(1), 10),
    ///     Ok(Completion::Accepted { group_state: GroupState::Materializing }));
    /// assert_eq!(s.slots_in_use(), 0);
    /// ```
    pub fn on_request_generated(
        &mut self,
        now: Tick,
        id: RequestId,
        version: PolicyVersion,
        tokens: u32,
    ) -> Result<Completion, RequestError> {
        let idx = self.lookup(id)?;
        self.check_version(version)?;
        match self.reqs[idx as usize].state {
            RequestState::InFlight => {
                self.apply_generated(idx, tokens, now);
                let g = self.reqs[idx as usize].group;
                self.after_event(now);
                Ok(Completion::Accepted {
                    group_state: self.groups[g as usize].state,
                })
            }
            RequestState::AbortPending | RequestState::AbortSent => {
                self.end_aborting(idx, RequestState::Dropped, now);
                Ok(Completion::Discarded)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// The verifier's reward for a generated request. A non-finite reward filters the group at
    /// once; the group's last reward completes it (trainable, or filtered for zero variance).
    /// A reward for a response whose group ended meanwhile (aborted, filtered, or the batch
    /// filled) is `Discarded`, as a late completion is.
    ///
    /// ```
    /// use rolloutpipe_core::{Completion, FilterReason, GroupState, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 1)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// s.on_request_generated(Tick(1), a.request, PolicyVersion(0), 5).unwrap();
    /// assert_eq!(s.on_reward(Tick(2), a.request, 1.0),
    ///     Ok(Completion::Accepted { group_state: GroupState::Filtered(FilterReason::ZeroVariance) }));
    /// ```
    pub fn on_reward(
        &mut self,
        now: Tick,
        id: RequestId,
        reward: f32,
    ) -> Result<Completion, RequestError> {
        let idx = self.lookup(id)?;
        match self.reqs[idx as usize].state {
            RequestState::Generated => {
                let group_state = self.apply_reward(idx, reward, now);
                self.after_event(now);
                Ok(Completion::Accepted { group_state })
            }
            RequestState::Dropped => {
                // Counted when it was dropped; only the state moves on (a second reward is an
                // error again).
                self.set_req(idx, RequestState::Cancelled);
                Ok(Completion::Discarded)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// Request `id` failed (engine error, lost connection). It is re-queued at the back with
    /// `attempt + 1`, or, at `max_attempts`, its group is filtered. A failure of a request being
    /// aborted counts as the abort's acknowledgement.
    ///
    /// ```
    /// use rolloutpipe_core::{Failure, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// assert_eq!(s.on_request_failed(Tick(1), a.request, PolicyVersion(0)), Ok(Failure::Retried { attempt: 1 }));
    /// ```
    pub fn on_request_failed(
        &mut self,
        now: Tick,
        id: RequestId,
        version: PolicyVersion,
    ) -> Result<Failure, RequestError> {
        let idx = self.lookup(id)?;
        self.check_version(version)?;
        match self.reqs[idx as usize].state {
            RequestState::InFlight => {
                let r = self.reqs[idx as usize];
                let g = r.group;
                self.counters.requests_failed += 1;
                self.counters.in_flight -= 1;
                self.groups[g as usize].in_flight -= 1;
                let out = if r.attempt as u32 + 1 >= self.plan.max_attempts as u32 {
                    self.set_req(idx, RequestState::Cancelled);
                    self.end_group(
                        g,
                        GroupState::Filtered(FilterReason::AttemptsExhausted),
                        now,
                    );
                    Failure::GroupFiltered
                } else {
                    let attempt = r.attempt + 1;
                    self.set_req(idx, RequestState::Pending);
                    self.reqs[idx as usize].attempt = attempt;
                    self.queue.push_back(self.reqs, idx);
                    if self.groups[g as usize].pending == 0 {
                        self.mark_pending(g);
                    }
                    let gs = &mut self.groups[g as usize];
                    gs.pending += 1;
                    gs.low = gs.low.min(r.sample);
                    Failure::Retried { attempt }
                };
                self.after_event(now);
                Ok(out)
            }
            RequestState::AbortPending | RequestState::AbortSent => {
                self.end_aborting(idx, RequestState::Unused, now);
                Ok(Failure::AbortAcked)
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// The engine confirmed that an aborted request stopped; its slot is free.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick, RequestError, RequestState};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// assert_eq!(s.on_abort_acked(Tick(1), a.request), Err(RequestError::BadRequestState { state: RequestState::InFlight }));
    /// ```
    pub fn on_abort_acked(&mut self, now: Tick, id: RequestId) -> Result<(), RequestError> {
        let idx = self.lookup(id)?;
        match self.reqs[idx as usize].state {
            RequestState::AbortPending | RequestState::AbortSent => {
                self.end_aborting(idx, RequestState::Unused, now);
                Ok(())
            }
            state => Err(RequestError::BadRequestState { state }),
        }
    }

    /// The engine refused to start an admitted request (its queue is full, it is draining): the
    /// request waits for a slot again, at the front of the queue, with the same attempt; no
    /// attempt is burned. Lower the slot count with [`set_slots`](Self::set_slots) if the engine
    /// has fewer slots than the plan thought. A request being aborted counts as acknowledged.
    ///
    /// ```
    /// use rolloutpipe_core::{Failure, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// assert_eq!(s.on_admission_refused(Tick(1), a.request), Ok(Failure::Retried { attempt: 0 }));
    /// assert_eq!(s.poll_admit(Tick(1)).unwrap().request, a.request);
    /// ```
    pub fn on_admission_refused(
        &mut self,
        now: Tick,
        id: RequestId,
    ) -> Result<Failure, RequestError> {
        self.requeue(now, id)
    }

    /// A running request was preempted by its engine, or is being migrated to another engine
    /// (JigsawRL-style): it waits for a slot again at the front of the queue, with the same
    /// attempt, and no attempt is burned. Its old run must not complete (the caller stops it);
    /// the re-admission hands out the same id. A request being aborted counts as acknowledged.
    ///
    /// ```
    /// use rolloutpipe_core::{Failure, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// let mut plan = Plan::new(1, 2);
    /// plan.max_attempts = 1;
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// // With one attempt allowed, a failure would filter the group; a preemption does not.
    /// assert_eq!(s.on_request_preempted(Tick(1), a.request), Ok(Failure::Retried { attempt: 0 }));
    /// assert_eq!(s.counters().requests_requeued, 1);
    /// ```
    pub fn on_request_preempted(
        &mut self,
        now: Tick,
        id: RequestId,
    ) -> Result<Failure, RequestError> {
        self.requeue(now, id)
    }

    /// Changes the number of rollout slots mid-step (an engine joined or left). Shrinking below
    /// the slots in use evicts nothing: admission pauses until enough requests end.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, SlotsError, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// s.set_slots(Tick(0), 1).unwrap();
    /// assert!(s.poll_admit(Tick(0)).is_some());
    /// assert!(s.poll_admit(Tick(0)).is_none());
    /// assert_eq!(s.set_slots(Tick(0), 0), Err(SlotsError::ZeroSlots));
    /// ```
    pub fn set_slots(&mut self, now: Tick, slots: u32) -> Result<(), SlotsError> {
        let _ = now;
        if self.phase != StepPhase::Active {
            return Err(SlotsError::NoActiveStep);
        }
        if slots == 0 {
            return Err(SlotsError::ZeroSlots);
        }
        self.plan.slots = slots;
        self.slots_ceiling = self.counters.in_flight;
        Ok(())
    }

    /// The trainer finished forward/backward on the oldest released micro-batch; its groups are
    /// trained. Returns it, with `ends_optimizer_step` authoritative. Refused while an optimizer
    /// step is due.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick, TrainError};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert_eq!(s.on_micro_batch_consumed(Tick(0)), Err(TrainError::NoMicroBatchReleased));
    /// ```
    pub fn on_micro_batch_consumed(&mut self, now: Tick) -> Result<MicroBatch, TrainError> {
        if self.phase != StepPhase::Active {
            return Err(TrainError::NoActiveStep);
        }
        if self.optimizer_step_due() {
            return Err(TrainError::OptimizerStepPending);
        }
        if self.mb_consumed == self.mb_released {
            return Err(TrainError::NoMicroBatchReleased);
        }
        let m = self.plan.micro_batch;
        let index = self.mb_consumed;
        let first_seq = index * m;
        let len = m.min(self.released_groups - first_seq);
        for seq in first_seq..first_seq + len {
            let g = self.groups[seq as usize].by_seq;
            self.set_state(g, GroupState::Trained);
        }
        self.mb_consumed += 1;
        self.trained_since_opt += len;
        let ends_optimizer_step = self.optimizer_step_due();
        self.after_event(now);
        Ok(MicroBatch {
            index,
            first_seq,
            len,
            ends_optimizer_step,
        })
    }

    /// The trainer applied an optimizer step (after the micro-batch that ended it).
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick, TrainError};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert_eq!(s.on_optimizer_step_done(Tick(0)), Err(TrainError::NoOptimizerStepDue));
    /// ```
    pub fn on_optimizer_step_done(&mut self, now: Tick) -> Result<(), TrainError> {
        if self.phase != StepPhase::Active {
            return Err(TrainError::NoActiveStep);
        }
        if !self.optimizer_step_due() {
            return Err(TrainError::NoOptimizerStepDue);
        }
        self.trained_since_opt = 0;
        self.opt_done += 1;
        self.opt_announced = false;
        self.after_event(now);
        Ok(())
    }

    // ----- decisions ----------------------------------------------------------------------

    /// The next request to start, if a slot is free and the plan's admission policy picks one.
    /// Marks it in flight.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// let mut plan = Plan::new(1, 2);
    /// plan.slots = 1;
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert!(s.poll_admit(Tick(0)).is_some());
    /// assert!(s.poll_admit(Tick(0)).is_none()); // the one slot is taken
    /// ```
    pub fn poll_admit(&mut self, now: Tick) -> Option<Admission> {
        let policy = self.plan.admission;
        // The built-in policies only ever name pending requests.
        self.poll_admit_with(now, &policy).ok().flatten()
    }

    /// Fills `out` with admissions ([`poll_admit`](Self::poll_admit) until it says `None` or
    /// `out` is full) and returns how many: one call across an FFI boundary for many slots.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 4)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let first = s.poll_admit(Tick(0)).unwrap();
    /// let mut buf = [first; 8];
    /// assert_eq!(s.poll_admit_into(Tick(0), &mut buf), 3);
    /// assert_eq!(buf[2].request.sample, 3);
    /// ```
    pub fn poll_admit_into(&mut self, now: Tick, out: &mut [Admission]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(a) = self.poll_admit(now) else { break };
            out[n] = a;
            n += 1;
        }
        n
    }

    /// Fills `out` with aborts to send ([`poll_abort`](Self::poll_abort)); returns how many.
    ///
    /// ```
    /// # use rolloutpipe_core::{RequestId, SchedulerStorage, Tick};
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// let mut buf = [RequestId::default(); 8];
    /// assert_eq!(storage.scheduler().poll_abort_into(Tick(0), &mut buf), 0);
    /// ```
    pub fn poll_abort_into(&mut self, now: Tick, out: &mut [RequestId]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(r) = self.poll_abort(now) else { break };
            out[n] = r;
            n += 1;
        }
        n
    }

    /// Fills `out` with groups for the trainer ([`poll_dispatch`](Self::poll_dispatch)); returns
    /// how many.
    ///
    /// ```
    /// # use rolloutpipe_core::{Dispatch, GroupId, SchedulerStorage, Tick};
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// let mut buf = [Dispatch { group: GroupId(0), seq: 0 }; 4];
    /// assert_eq!(storage.scheduler().poll_dispatch_into(Tick(0), &mut buf), 0);
    /// ```
    pub fn poll_dispatch_into(&mut self, now: Tick, out: &mut [Dispatch]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some(d) = self.poll_dispatch(now) else {
                break;
            };
            out[n] = d;
            n += 1;
        }
        n
    }

    /// [`poll_admit`](Self::poll_admit) with a caller-supplied policy; a choice that is not a
    /// pending request is refused and changes nothing.
    ///
    /// ```
    /// use rolloutpipe_core::{Admit, Plan, PolicyVersion, RequestRef, SchedulerStorage, StepId, Tick, View};
    /// struct Newest;
    /// impl Admit for Newest {
    ///     fn choose(&self, v: &View<'_, '_>) -> Option<RequestRef> { v.queue().last() }
    /// }
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.poll_admit_with(Tick(0), &Newest).unwrap().unwrap().request.sample, 1);
    /// ```
    pub fn poll_admit_with<P: Admit + ?Sized>(
        &mut self,
        now: Tick,
        policy: &P,
    ) -> Result<Option<Admission>, AdmitError> {
        let _ = now;
        if self.phase != StepPhase::Active
            || self.counters.in_flight >= self.plan.slots
            || self.queue.len == 0
        {
            return Ok(None);
        }
        let Some(choice) = policy.choose(&self.view()) else {
            return Ok(None);
        };
        let idx = self
            .pending_index(choice)
            .ok_or(AdmitError::NotPending { request: choice })?;
        self.queue.remove(self.reqs, idx);
        self.set_req(idx, RequestState::InFlight);
        let r = &self.reqs[idx as usize];
        let (g, sample, attempt) = (r.group, r.sample, r.attempt);
        let gs = &mut self.groups[g as usize];
        gs.pending -= 1;
        gs.in_flight += 1;
        if gs.low == sample {
            gs.low = sample + 1;
        }
        let none_left = gs.pending == 0;
        if gs.state == GroupState::Queued {
            self.set_state(g, GroupState::Generating);
        }
        if none_left {
            self.unmark_pending(g);
        }
        self.counters.in_flight += 1;
        self.counters.requests_admitted += 1;
        Ok(Some(Admission {
            request: RequestId {
                step: self.step,
                group: GroupId(g),
                sample,
                attempt,
            },
            version: self.version,
        }))
    }

    /// How many prompts to draw now (over-sampling): while the batch is not final and fewer than
    /// `B + draw_ahead` groups are trainable or in progress (counting draws already asked for),
    /// up to `draw_batch` at a time and never past `max_groups`. Report the draw with
    /// `on_prompts_drawn`.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<8, 32>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(4, 2)).unwrap();
    /// assert_eq!(s.poll_draw(Tick(0)), Some(4));
    /// assert_eq!(s.poll_draw(Tick(0)), None); // 4 already asked for
    /// ```
    pub fn poll_draw(&mut self, now: Tick) -> Option<u32> {
        let _ = now;
        if self.phase != StepPhase::Active || self.is_final || self.exhausted {
            return None;
        }
        let c = &self.counters;
        let outstanding =
            c.batch_filled() as u64 + c.incomplete() as u64 + self.draw_outstanding as u64;
        let target = self.plan.batch_groups as u64 + self.plan.draw_ahead as u64;
        if outstanding >= target {
            return None;
        }
        let room = self
            .plan
            .max_groups
            .saturating_sub(c.drawn)
            .saturating_sub(self.draw_outstanding);
        let budget = self.budget_prompts().saturating_sub(self.draw_outstanding);
        let n = self.plan.draw_batch.min(room).min(budget);
        if n == 0 {
            return None;
        }
        self.draw_outstanding += n;
        Some(n)
    }

    /// The next group for the trainer FIFO, in materialization order, each once. Under `Sync`,
    /// nothing until the batch is final.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert!(s.poll_dispatch(Tick(0)).is_none());
    /// ```
    pub fn poll_dispatch(&mut self, now: Tick) -> Option<Dispatch> {
        let _ = now;
        if self.phase != StepPhase::Active || self.ready_head == NIL {
            return None;
        }
        if self.plan.dispatch == DispatchPolicy::Sync && !self.is_final {
            return None;
        }
        let g = self.ready_head;
        self.ready_head = self.groups[g as usize].next_ready;
        if self.ready_head == NIL {
            self.ready_tail = NIL;
        }
        let seq = self.dispatched;
        self.dispatched += 1;
        self.groups[g as usize].next_ready = NIL;
        self.groups[g as usize].dispatch_seq = seq;
        self.groups[seq as usize].by_seq = g;
        self.set_state(g, GroupState::Dispatched);
        Some(Dispatch {
            group: GroupId(g),
            seq,
        })
    }

    /// The next micro-batch the trainer may start: `m` dispatched groups, or, once the batch is
    /// final, the remaining ones.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert!(s.poll_micro_batch(Tick(0)).is_none());
    /// ```
    pub fn poll_micro_batch(&mut self, now: Tick) -> Option<MicroBatch> {
        let _ = now;
        if self.phase != StepPhase::Active {
            return None;
        }
        let m = self.plan.micro_batch;
        let first_seq = self.released_groups;
        let avail = self.dispatched - first_seq;
        let len = if avail >= m {
            m
        } else if self.is_final && avail > 0 && self.counters.trainable == 0 {
            avail
        } else {
            return None;
        };
        let end = first_seq + len;
        let ends_optimizer_step = end % self.plan.groups_per_opt_step() == 0
            || (self.is_final && end == self.counters.batch_filled());
        let mb = MicroBatch {
            index: self.mb_released,
            first_seq,
            len,
            ends_optimizer_step,
        };
        self.mb_released += 1;
        self.released_groups = end;
        Some(mb)
    }

    /// The optimizer step the trainer must apply now, once per due step: after the micro-batch
    /// that completes `B / k_opt` groups, or once the batch is final and every trainable group
    /// is trained (a short batch can make that true after its last micro-batch was consumed, so
    /// only this poll, not `MicroBatch::ends_optimizer_step`, says so in every case). Apply it and
    /// report [`on_optimizer_step_done`](Self::on_optimizer_step_done).
    ///
    /// ```
    /// use rolloutpipe_core::{OptimizerStep, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// for r in [0.0, 1.0] {
    ///     let a = s.poll_admit(Tick(0)).unwrap();
    ///     s.on_request_finished(Tick(1), a.request, PolicyVersion(0), 5, r).unwrap();
    /// }
    /// s.poll_dispatch(Tick(1)).unwrap();
    /// s.poll_micro_batch(Tick(1)).unwrap();
    /// s.on_micro_batch_consumed(Tick(2)).unwrap();
    /// assert_eq!(s.poll_optimizer_step(Tick(2)), Some(OptimizerStep { index: 0 }));
    /// assert_eq!(s.poll_optimizer_step(Tick(2)), None); // handed out once
    /// s.on_optimizer_step_done(Tick(3)).unwrap();
    /// assert!(s.poll_step_done().is_some());
    /// ```
    pub fn poll_optimizer_step(&mut self, now: Tick) -> Option<OptimizerStep> {
        let _ = now;
        if self.phase != StepPhase::Active || self.opt_announced || !self.optimizer_step_due() {
            return None;
        }
        self.opt_announced = true;
        Some(OptimizerStep {
            index: self.opt_done,
        })
    }

    /// The next in-flight request to abort (its group ended: surplus once the batch filled, or
    /// filtered early). Report the engine's confirmation with `on_abort_acked`; a finish or
    /// failure that crosses the abort also frees the slot.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert!(s.poll_abort(Tick(0)).is_none());
    /// ```
    pub fn poll_abort(&mut self, now: Tick) -> Option<RequestId> {
        let _ = now;
        let idx = self.aborts.pop_front(self.reqs)?;
        self.set_req(idx, RequestState::AbortSent);
        let r = &self.reqs[idx as usize];
        Some(RequestId {
            step: self.step,
            group: GroupId(r.group),
            sample: r.sample,
            attempt: r.attempt,
        })
    }

    /// The step's summary once it is done (batch trained, optimizer steps applied, no slot
    /// held), else `None`.
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// assert!(s.poll_step_done().is_none());
    /// ```
    pub fn poll_step_done(&self) -> Option<StepSummary> {
        if self.phase == StepPhase::Done {
            self.summary()
        } else {
            None
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

    /// Re-derives every count and list from storage and checks the invariants: per-state
    /// counts, per-group request tallies, queue and abort-list contents, incomplete list in draw
    /// order, slot cap, dispatch order = materialization order of the dispatched groups, and
    /// conservation. O(groups + requests): for tests and fuzzing, not the hot path.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert_eq!(storage.scheduler().audit(), Ok(()));
    /// ```
    pub fn audit(&self) -> Result<(), AuditError> {
        let bad = |what: &'static str, index: u64| Err(AuditError { what, index });
        if !self.counters.is_conserved() {
            return bad("conservation", self.counters.drawn as u64);
        }
        if self.phase == StepPhase::Idle {
            return Ok(());
        }
        if self.counters.in_flight > self.plan.slots.max(self.slots_ceiling) {
            return bad(
                "slots in use exceed capacity",
                self.counters.in_flight as u64,
            );
        }
        let mut c = Counters {
            drawn: self.counters.drawn,
            ..Counters::default()
        };
        let mut slots = 0u32;
        let mut pending_total = 0u32;
        let mut abort_pending = 0u32;
        for g in 0..self.counters.drawn {
            let s = &self.groups[g as usize];
            match s.state {
                GroupState::Queued => c.queued += 1,
                GroupState::Generating => c.generating += 1,
                GroupState::Materializing => c.materializing += 1,
                GroupState::Trainable => c.trainable += 1,
                GroupState::Dispatched => c.dispatched += 1,
                GroupState::Trained => c.trained += 1,
                GroupState::Filtered(FilterReason::ZeroVariance) => c.filtered_zero_variance += 1,
                GroupState::Filtered(FilterReason::NonFiniteReward) => c.filtered_non_finite += 1,
                GroupState::Filtered(FilterReason::AttemptsExhausted) => c.filtered_attempts += 1,
                GroupState::Filtered(FilterReason::Skipped(_)) => c.filtered_skipped += 1,
                GroupState::Aborted => c.aborted += 1,
            }
            let (mut p, mut f, mut gen_, mut rew) = (0u16, 0u16, 0u16, 0u16);
            for k in 0..s.target {
                let r = &self.reqs[(s.first + k as u32) as usize];
                if r.group != g || r.sample != k {
                    return bad("request slot names another group", g as u64);
                }
                match r.state {
                    RequestState::Pending => p += 1,
                    RequestState::InFlight => f += 1,
                    RequestState::Generated => gen_ += 1,
                    RequestState::Rewarded => {
                        gen_ += 1;
                        rew += 1
                    }
                    RequestState::AbortPending => abort_pending += 1,
                    RequestState::Unused => {
                        return bad("unused request in a drawn group", g as u64);
                    }
                    _ => {}
                }
                if r.state.holds_slot() {
                    slots += 1;
                }
                if r.state == RequestState::Pending && k < s.low {
                    return bad("pending sample below the low-water mark", g as u64);
                }
            }
            pending_total += p as u32;
            let bit = self.groups[(g >> 6) as usize].bits[0] >> (g & 63) & 1 == 1;
            if bit != (p > 0) {
                return bad("pending-groups bitset", g as u64);
            }
            if s.state.is_incomplete() {
                if (p, f, gen_, rew) != (s.pending, s.in_flight, s.generated, s.rewarded) {
                    return bad("group request tallies", g as u64);
                }
                let expect =
                    if s.in_flight == 0 && s.generated == 0 && s.rewarded == 0 && p == s.target {
                        // Never admitted, or every admitted attempt failed and was re-queued.
                        s.state == GroupState::Queued || s.state == GroupState::Generating
                    } else if gen_ == s.target {
                        s.state == GroupState::Materializing
                    } else {
                        s.state == GroupState::Generating
                    };
                if !expect {
                    return bad("group state does not match its requests", g as u64);
                }
            } else if p != 0 || f != 0 {
                return bad(
                    "ended group still has pending or running requests",
                    g as u64,
                );
            }
            if s.state.is_trainable() && rew != s.target {
                return bad("trainable group without all rewards", g as u64);
            }
            if matches!(s.state, GroupState::Dispatched | GroupState::Trained) {
                if s.dispatch_seq >= self.dispatched
                    || self.groups[s.dispatch_seq as usize].by_seq != g
                {
                    return bad("dispatch order map", g as u64);
                }
            } else if s.dispatch_seq != NIL {
                return bad("undispatched group has a seq", g as u64);
            }
        }
        c.in_flight = slots;
        let mut mine = self.counters;
        mine.requests_admitted = 0;
        mine.requests_generated = 0;
        mine.requests_rewarded = 0;
        mine.requests_failed = 0;
        mine.requests_aborted = 0;
        mine.requests_discarded = 0;
        mine.requests_requeued = 0;
        mine.requests_dropped = 0;
        if mine != c {
            return bad("per-state counts", 0);
        }
        if self.queue.len != pending_total || self.aborts.len != abort_pending {
            return bad("queue or abort list length", self.queue.len as u64);
        }
        let mut n = 0u32;
        let mut i = self.queue.head;
        while i != NIL {
            if self.reqs[i as usize].state != RequestState::Pending || n > self.queue.len {
                return bad("queue holds a non-pending request", i as u64);
            }
            n += 1;
            i = self.reqs[i as usize].link.next;
        }
        let first = (0..self.counters.drawn).find(|&g| self.groups[g as usize].pending > 0);
        if first != self.first_pending_group() {
            return bad("first pending group", first.unwrap_or(NIL) as u64);
        }
        if !self.frontier_dirty
            && self.frontier_cache != self.view().walk_frontier(self.view().frontier_len())
        {
            return bad("stale frontier cache", self.frontier_cache.1 as u64);
        }
        let mut last = None;
        let mut n = 0u32;
        let mut i = self.incomplete.head;
        while i != NIL {
            if !self.groups[i as usize].state.is_incomplete() || last.is_some_and(|l| l >= i) {
                return bad("incomplete list", i as u64);
            }
            last = Some(i);
            n += 1;
            i = self.groups[i as usize].link.next;
        }
        if n != self.counters.incomplete() || self.incomplete.len != n {
            return bad("incomplete list length", n as u64);
        }
        let mut held = 0u32;
        let mut i = self.held_head;
        while i != NIL {
            let s = &self.groups[i as usize];
            if !s.held || s.state != GroupState::Materializing || s.rewarded != s.target {
                return bad("held group not fully scored", i as u64);
            }
            held += 1;
            if held > self.held_len {
                return bad("held list loops", i as u64);
            }
            i = s.hold_link.next;
        }
        let flagged = (0..self.counters.drawn)
            .filter(|&g| self.groups[g as usize].held)
            .count() as u32;
        if held != self.held_len || flagged != held {
            return bad("held list length", held as u64);
        }
        if self.is_final && self.counters.incomplete() != 0 {
            return bad("incomplete groups after the batch is final", 0);
        }
        if self.counters.batch_filled() > self.plan.batch_groups {
            return bad(
                "more trainable groups than the batch",
                self.counters.batch_filled() as u64,
            );
        }
        // Dispatch order is materialization order: seqs were handed out in ready-FIFO order, so
        // dispatched groups' completion ticks must be non-decreasing along the seqs, and every
        // still-undispatched trainable group materialized no earlier than the last dispatched.
        let mut prev = Tick(0);
        for seq in 0..self.dispatched {
            let g = self.groups[seq as usize].by_seq;
            let t = self.groups[g as usize].ended_at.unwrap_or(Tick(u64::MAX));
            if t < prev {
                return bad(
                    "dispatch order differs from materialization order",
                    seq as u64,
                );
            }
            prev = t;
        }
        Ok(())
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

    /// Moves group `g`'s request records to the end of the used storage, fixing the queue and
    /// abort-list links of the moved records.
    fn relocate(&mut self, g: u32) {
        let s = self.groups[g as usize];
        let (old, new, n) = (s.first, self.req_used, s.target as u32);
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
            self.reqs[(old + k) as usize] = RequestSlot::EMPTY;
        }
        for k in 0..n {
            match self.reqs[(new + k) as usize].state {
                RequestState::Pending => self.queue.relink(self.reqs, new + k),
                RequestState::AbortPending => self.aborts.relink(self.reqs, new + k),
                _ => {}
            }
        }
        self.groups[g as usize].first = new;
        self.req_used = new + n;
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
mod tests {
    extern crate std;
    use std::vec;
    use std::vec::Vec;

    use super::*;
    use crate::types::AdmissionPolicy;

    const V: PolicyVersion = PolicyVersion(1);
    const T: Tick = Tick(0);

    fn storage(groups: usize, reqs: usize) -> (Vec<GroupSlot>, Vec<RequestSlot>) {
        (
            vec![GroupSlot::EMPTY; groups],
            vec![RequestSlot::EMPTY; reqs],
        )
    }

    fn plan(b: u32, g: u16) -> Plan {
        Plan::new(b, g)
    }

    fn begun<'a>(gs: &'a mut [GroupSlot], rs: &'a mut [RequestSlot], p: Plan) -> Scheduler<'a> {
        let mut s = Scheduler::new(gs, rs);
        s.begin_step(T, StepId(1), V, p).unwrap();
        s
    }

    fn admit_all(s: &mut Scheduler<'_>) -> Vec<RequestId> {
        let mut v = Vec::new();
        while let Some(a) = s.poll_admit(T) {
            v.push(a.request);
        }
        v
    }

    fn refs(v: &[RequestId]) -> Vec<(u32, u16)> {
        v.iter().map(|r| (r.group.0, r.sample)).collect()
    }

    fn finish(s: &mut Scheduler<'_>, r: RequestId, reward: f32) -> Completion {
        let c = s.on_request_finished(T, r, V, 10, reward).unwrap();
        s.audit().unwrap();
        c
    }

    // ----- step ------------------------------------------------------------------------------

    mod step {
        use super::*;

        #[test]
        fn begin_rejects_overlap_stale_ids_and_small_storage() {
            let (mut g, mut r) = storage(4, 8);
            let mut s = Scheduler::new(&mut g, &mut r);
            assert_eq!(
                s.begin_step(T, StepId(0), V, Plan::new(2, 8)),
                Err(BeginError::Plan(PlanError::RequestCapacity {
                    needed: 32,
                    capacity: 8
                }))
            );
            assert_eq!(s.phase(), StepPhase::Idle);
            s.begin_step(T, StepId(5), V, Plan::new(1, 1)).unwrap();
            assert_eq!(
                s.begin_step(T, StepId(6), V, Plan::new(1, 1)),
                Err(BeginError::StepInProgress { step: StepId(5) })
            );
            s.on_data_exhausted(T).unwrap();
            assert_eq!(s.phase(), StepPhase::Done);
            assert_eq!(
                s.begin_step(T, StepId(5), V, Plan::new(1, 1)),
                Err(BeginError::StaleStep {
                    last: StepId(5),
                    given: StepId(5)
                })
            );
            s.begin_step(T, StepId(6), PolicyVersion(2), Plan::new(1, 1))
                .unwrap();
            assert_eq!(s.counters().drawn, 0);
        }

        #[test]
        fn late_completion_from_previous_step_is_rejected() {
            let (mut g, mut r) = storage(4, 8);
            let mut s = begun(&mut g, &mut r, plan(1, 2));
            s.on_prompts_drawn(T, 1).unwrap();
            let a = admit_all(&mut s);
            finish(&mut s, a[0], 0.0);
            finish(&mut s, a[1], 1.0);
            let d = s.poll_dispatch(T).unwrap();
            assert_eq!(
                d,
                Dispatch {
                    group: GroupId(0),
                    seq: 0
                }
            );
            assert!(s.poll_micro_batch(T).unwrap().ends_optimizer_step);
            assert!(s.on_micro_batch_consumed(T).unwrap().ends_optimizer_step);
            assert_eq!(s.poll_step_done(), None);
            s.on_optimizer_step_done(T).unwrap();
            let sum = s.poll_step_done().unwrap();
            assert_eq!(
                (sum.counters.trained, sum.short, sum.batch_groups),
                (1, false, 1)
            );
            s.begin_step(T, StepId(2), PolicyVersion(2), plan(1, 2))
                .unwrap();
            s.on_prompts_drawn(T, 1).unwrap();
            admit_all(&mut s);
            assert_eq!(
                s.on_request_finished(T, a[0], PolicyVersion(2), 1, 1.0),
                Err(RequestError::OtherStep {
                    current: StepId(2),
                    given: StepId(1)
                })
            );
        }

        #[test]
        fn events_before_any_step_are_refused() {
            let (mut g, mut r) = storage(2, 2);
            let mut s = Scheduler::new(&mut g, &mut r);
            let id = RequestId::default();
            assert_eq!(
                s.on_request_failed(T, id, V),
                Err(RequestError::NoActiveStep)
            );
            assert_eq!(s.on_prompts_drawn(T, 1), Err(DrawError::NoActiveStep));
            assert_eq!(s.on_micro_batch_consumed(T), Err(TrainError::NoActiveStep));
            assert_eq!(
                s.extend_group(T, GroupId(0), 1),
                Err(ExtendError::NoActiveStep)
            );
            assert_eq!(
                (s.poll_admit(T), s.poll_draw(T), s.poll_dispatch(T)),
                (None, None, None)
            );
            s.audit().unwrap();
        }
    }

    // ----- queued ----------------------------------------------------------------------------

    mod queued {
        use super::*;

        fn queue_order(order: SubmitOrder) -> Vec<(u32, u16)> {
            let (mut g, mut r) = storage(8, 64);
            let mut p = plan(2, 3);
            p.admission = AdmissionPolicy::Fifo { order };
            let mut s = begun(&mut g, &mut r, p);
            s.on_prompts_drawn(T, 2).unwrap();
            s.on_prompts_drawn(T, 1).unwrap();
            s.audit().unwrap();
            s.view().queue().map(|r| (r.group.0, r.sample)).collect()
        }

        #[test]
        fn group_major_order() {
            assert_eq!(
                queue_order(SubmitOrder::GroupMajor),
                [
                    (0, 0),
                    (0, 1),
                    (0, 2),
                    (1, 0),
                    (1, 1),
                    (1, 2),
                    (2, 0),
                    (2, 1),
                    (2, 2)
                ]
            );
        }

        #[test]
        fn interleaved_is_sample_major_within_a_draw_batch() {
            assert_eq!(
                queue_order(SubmitOrder::Interleaved),
                [
                    (0, 0),
                    (1, 0),
                    (0, 1),
                    (1, 1),
                    (0, 2),
                    (1, 2),
                    (2, 0),
                    (2, 1),
                    (2, 2)
                ]
            );
        }

        #[test]
        fn shuffled_is_a_seeded_permutation_within_each_batch() {
            let a = queue_order(SubmitOrder::Shuffled { seed: 7 });
            assert_eq!(a, queue_order(SubmitOrder::Shuffled { seed: 7 }));
            assert_ne!(a, queue_order(SubmitOrder::Shuffled { seed: 8 }));
            let mut first: Vec<_> = a[..6].to_vec();
            first.sort();
            assert_eq!(first, queue_order(SubmitOrder::GroupMajor)[..6]);
            assert_eq!(a[6..].iter().filter(|x| x.0 == 2).count(), 3);
        }

        #[test]
        fn draw_errors_change_nothing() {
            // Storage for B x G but not max_groups x G is refused up front, so that no draw
            // `poll_draw` asks for can fail for storage.
            let (mut g, mut r) = storage(8, 12);
            let mut p = plan(2, 4);
            p.max_groups = 4;
            assert_eq!(
                Scheduler::new(&mut g, &mut r).begin_step(T, StepId(1), V, p),
                Err(BeginError::Plan(PlanError::RequestCapacity {
                    needed: 16,
                    capacity: 12
                }))
            );
            let (mut g, mut r) = storage(8, 16);
            let mut s = begun(&mut g, &mut r, p);
            assert_eq!(s.on_prompts_drawn(T, 0), Err(DrawError::ZeroCount));
            assert_eq!(
                s.on_prompts_drawn(T, 5),
                Err(DrawError::MaxGroups {
                    drawn: 0,
                    requested: 5,
                    max_groups: 4
                })
            );
            assert_eq!(s.counters().drawn, 0);
            s.on_prompts_drawn(T, 3).unwrap();
            assert_eq!(
                s.on_prompts_drawn(T, 2),
                Err(DrawError::MaxGroups {
                    drawn: 3,
                    requested: 2,
                    max_groups: 4
                })
            );
            assert_eq!(s.counters().drawn, 3);
            s.audit().unwrap();
        }

        #[test]
        fn poll_draw_oversamples_after_filtering_and_stops_at_the_cap() {
            let (mut g, mut r) = storage(8, 32);
            let mut p = plan(2, 2);
            p.max_groups = 3;
            p.draw_batch = 2;
            let mut s = begun(&mut g, &mut r, p);
            assert_eq!(s.poll_draw(T), Some(2));
            assert_eq!(s.poll_draw(T), None);
            s.on_prompts_drawn(T, 2).unwrap();
            assert_eq!(s.poll_draw(T), None);
            let a = admit_all(&mut s);
            finish(&mut s, a[0], 1.0);
            finish(&mut s, a[1], 1.0); // g0 filtered: one more prompt wanted, capped at max_groups
            assert_eq!(s.counters().filtered_zero_variance, 1);
            assert_eq!(s.poll_draw(T), Some(1));
            s.on_prompts_drawn(T, 1).unwrap();
            assert_eq!(s.poll_draw(T), None);
            assert_eq!(
                s.on_prompts_drawn(T, 1),
                Err(DrawError::MaxGroups {
                    drawn: 3,
                    requested: 1,
                    max_groups: 3
                })
            );
        }
    }

    // ----- generating ------------------------------------------------------------------------

    mod generating {
        use super::*;

        #[test]
        fn admission_respects_the_slot_cap() {
            let (mut g, mut r) = storage(4, 16);
            let mut p = plan(2, 4);
            p.slots = 3;
            let mut s = begun(&mut g, &mut r, p);
            s.on_prompts_drawn(T, 2).unwrap();
            let a = admit_all(&mut s);
            assert_eq!(refs(&a), [(0, 0), (0, 1), (0, 2)]);
            assert_eq!(
                s.view().group_state(GroupId(0)),
                Some(GroupState::Generating)
            );
            assert_eq!(s.view().group_state(GroupId(1)), Some(GroupState::Queued));
            s.on_request_generated(T, a[0], V, 5).unwrap();
            assert_eq!(refs(&admit_all(&mut s)), [(0, 3)]);
            s.audit().unwrap();
        }

        #[test]
        fn frontier_admits_frontier_groups_before_the_queue_head() {
            let (mut g, mut r) = storage(8, 32);
            let mut p = plan(4, 2);
            p.micro_batch = 2;
            p.slots = 4;
            p.admission = AdmissionPolicy::Frontier {
                width: 0,
                expected_filter_ppm: 0,
                fallback: SubmitOrder::Interleaved,
            };
            let mut s = begun(&mut g, &mut r, p);
            s.on_prompts_drawn(T, 4).unwrap();
            // Interleaved queue: g0s0 g1s0 g2s0 g3s0 g0s1 …; the frontier (2 groups for m = 2)
            // takes all four slots first.
            assert_eq!(
                s.view().frontier().collect::<Vec<_>>(),
                [GroupId(0), GroupId(1)]
            );
            let a = admit_all(&mut s);
            assert_eq!(refs(&a), [(0, 0), (0, 1), (1, 0), (1, 1)]);
            // Under FIFO the same queue would have started one sample of every group.
            let (mut g2, mut r2) = storage(8, 32);
            p.admission = AdmissionPolicy::Fifo {
                order: SubmitOrder::Interleaved,
            };
            let mut f = begun(&mut g2, &mut r2, p);
            f.on_prompts_drawn(T, 4).unwrap();
            assert_eq!(refs(&admit_all(&mut f)), [(0, 0), (1, 0), (2, 0), (3, 0)]);
            // Once the frontier has nothing pending, the queue head (fallback) is used.
            s.on_request_generated(T, a[0], V, 1).unwrap();
            assert_eq!(refs(&admit_all(&mut s)), [(2, 0)]);
            s.audit().unwrap();
        }

        #[test]
        fn frontier_width_and_filter_rate_widen_it() {
            let (mut g, mut r) = storage(16, 64);
            let mut p = plan(8, 2);
            p.micro_batch = 4;
            p.admission = AdmissionPolicy::Frontier {
                width: 1,
                expected_filter_ppm: 200_000,
                fallback: SubmitOrder::GroupMajor,
            };
            let mut s = begun(&mut g, &mut r, p);
            // need 4 / 0.8 = 5, + width 1.
            assert_eq!(s.view().frontier_len(), 6);
            s.on_prompts_drawn(T, 8).unwrap();
            let a = admit_all(&mut s);
            finish(&mut s, a[0], 0.0);
            finish(&mut s, a[1], 1.0); // one trainable: 3 more for the micro-batch -> ceil(3.75) + 1
            assert_eq!(s.view().frontier_len(), 5);
            let mut sync = p;
            sync.dispatch = DispatchPolicy::Sync;
            let (mut g2, mut r2) = storage(16, 64);
            let s2 = begun(&mut g2, &mut r2, sync);
            assert_eq!(s2.view().frontier_len(), 11); // 8 / 0.8 + 1
        }

        #[test]
        fn failures_retry_at_the_back_then_filter_the_group() {
            let (mut g, mut r) = storage(4, 16);
            let mut p = plan(2, 2);
            p.slots = 1;
            p.max_attempts = 2;
            let mut s = begun(&mut g, &mut r, p);
            s.on_prompts_drawn(T, 2).unwrap();
            let a = s.poll_admit(T).unwrap().request;
            assert_eq!(
                s.on_request_failed(T, a, V),
                Ok(Failure::Retried { attempt: 1 })
            );
            s.audit().unwrap();
            assert_eq!(
                s.view().queue().last(),
                Some(RequestRef {
                    group: GroupId(0),
                    sample: 0
                })
            );
            // The stale attempt is now rejected.
            assert_eq!(
                s.on_request_failed(T, a, V),
                Err(RequestError::StaleAttempt {
                    current: 1,
                    given: 0
                })
            );
            let order = refs(&[s.poll_admit(T).unwrap().request]);
            assert_eq!(order, [(0, 1)]);
            let b = RequestId {
                attempt: 0,
                sample: 1,
                ..a
            };
            s.on_request_generated(T, b, V, 3).unwrap();
            // Admit through group 1 until the retry comes up.
            let mut got = Vec::new();
            while let Some(x) = s.poll_admit(T) {
                got.push(x.request);
                if x.request.group == GroupId(0) {
                    break;
                }
                s.on_request_generated(T, x.request, V, 1).unwrap();
            }
            let retry = *got.last().unwrap();
            assert_eq!(
                (retry.group, retry.sample, retry.attempt),
                (GroupId(0), 0, 1)
            );
            assert_eq!(s.on_request_failed(T, retry, V), Ok(Failure::GroupFiltered));
            assert_eq!(
                s.view().group_state(GroupId(0)),
                Some(GroupState::Filtered(FilterReason::AttemptsExhausted))
            );
            // Its generated sibling's reward is no longer wanted: discarded, once.
            assert_eq!(
                s.request_state(GroupId(0), 1),
                Some((RequestState::Dropped, 0))
            );
            let dropped = s.counters().requests_dropped;
            assert_eq!(s.on_reward(T, b, 1.0), Ok(Completion::Discarded));
            assert_eq!(s.counters().requests_dropped, dropped);
            assert_eq!(
                s.on_reward(T, b, 1.0),
                Err(RequestError::BadRequestState {
                    state: RequestState::Cancelled
                })
            );
            s.audit().unwrap();
            assert!(s.counters().is_conserved());
        }

        #[test]
        fn bad_completions_are_rejected_and_change_nothing() {
            let (mut g, mut r) = storage(4, 16);
            let mut s = begun(&mut g, &mut r, plan(2, 2));
            s.on_prompts_drawn(T, 1).unwrap();
            let a = s.poll_admit(T).unwrap().request;
            let before = *s.counters();
            assert_eq!(
                s.on_request_finished(T, a, PolicyVersion(0), 1, 1.0),
                Err(RequestError::WrongVersion {
                    expected: V,
                    given: PolicyVersion(0)
                })
            );
            assert_eq!(
                s.on_request_finished(
                    T,
                    RequestId {
                        group: GroupId(3),
                        ..a
                    },
                    V,
                    1,
                    1.0
                ),
                Err(RequestError::UnknownGroup { group: GroupId(3) })
            );
            assert_eq!(
                s.on_request_finished(T, RequestId { sample: 2, ..a }, V, 1, 1.0),
                Err(RequestError::UnknownSample {
                    group: GroupId(0),
                    sample: 2,
                    target: 2
                })
            );
            assert_eq!(
                s.on_request_finished(T, RequestId { sample: 1, ..a }, V, 1, 1.0),
                Err(RequestError::BadRequestState {
                    state: RequestState::Pending
                })
            );
            assert_eq!(
                s.on_reward(T, a, 1.0),
                Err(RequestError::BadRequestState {
                    state: RequestState::InFlight
                })
            );
            assert_eq!(*s.counters(), before);
            finish(&mut s, a, 1.0);
            assert_eq!(
                s.on_request_finished(T, a, V, 1, 1.0),
                Err(RequestError::BadRequestState {
                    state: RequestState::Rewarded
                })
            );
        }

        #[test]
        fn custom_policy_choice_must_be_pending() {
            struct Bad;
            impl Admit for Bad {
                fn choose(&self, _: &View<'_, '_>) -> Option<RequestRef> {
                    Some(RequestRef {
                        group: GroupId(9),
                        sample: 0,
                    })
                }
            }
            let (mut g, mut r) = storage(4, 16);
            let mut s = begun(&mut g, &mut r, plan(2, 2));
            s.on_prompts_drawn(T, 1).unwrap();
            assert_eq!(
                s.poll_admit_with(T, &Bad),
                Err(AdmitError::NotPending {
                    request: RequestRef {
                        group: GroupId(9),
                        sample: 0
                    }
                })
            );
            assert_eq!(s.slots_in_use(), 0);
        }
    }

    // ----- materializing ---------------------------------------------------------------------

    mod materializing {
        use super::*;

        #[test]
        fn rewards_after_generation_complete_the_group() {
            let (mut g, mut r) = storage(4, 16);
            let mut s = begun(&mut g, &mut r, plan(2, 2));
            s.on_prompts_drawn(T, 1).unwrap();
            let a = admit_all(&mut s);
            s.on_request_generated(Tick(1), a[1], V, 4).unwrap();
            assert_eq!(
                s.on_request_generated(Tick(2), a[0], V, 6),
                Ok(Completion::Accepted {
                    group_state: GroupState::Materializing
                })
            );
            assert_eq!(s.slots_in_use(), 0);
            assert_eq!(
                s.on_reward(Tick(3), a[0], 0.0),
                Ok(Completion::Accepted {
                    group_state: GroupState::Materializing
                })
            );
            assert_eq!(
                s.on_reward(Tick(4), a[1], 1.0),
                Ok(Completion::Accepted {
                    group_state: GroupState::Trainable
                })
            );
            let info = s.group(GroupId(0)).unwrap();
            assert_eq!(
                (
                    info.tokens,
                    info.ended_at,
                    info.reward_mean,
                    info.reward_var
                ),
                (10, Some(Tick(4)), 0.5, 0.25)
            );
            s.audit().unwrap();
        }

        #[test]
        fn extending_a_materializing_group_reopens_it_and_relocates_its_records() {
            let (mut g, mut r) = storage(4, 16);
            let mut s = begun(&mut g, &mut r, plan(2, 2));
            s.on_prompts_drawn(T, 2).unwrap();
            let a: Vec<_> = (0..2).map(|_| s.poll_admit(T).unwrap().request).collect();
            for x in &a {
                s.on_request_generated(T, *x, V, 1).unwrap();
            }
            s.on_reward(T, a[0], 1.0).unwrap();
            assert_eq!(
                s.view().group_state(GroupId(0)),
                Some(GroupState::Materializing)
            );
            s.extend_group(T, GroupId(0), 2).unwrap();
            s.audit().unwrap();
            assert_eq!(
                s.view().group_state(GroupId(0)),
                Some(GroupState::Generating)
            );
            // Group 1's two samples stay ahead of group 0's new ones in the queue.
            let q: Vec<_> = s.view().queue().map(|r| (r.group.0, r.sample)).collect();
            assert_eq!(q, [(1, 0), (1, 1), (0, 2), (0, 3)]);
            // The moved records keep their data.
            assert_eq!(
                s.group_rewards(GroupId(0)).unwrap().collect::<Vec<_>>(),
                [Some(1.0), None, None, None]
            );
            assert_eq!(
                s.on_reward(T, a[1], 1.0),
                Ok(Completion::Accepted {
                    group_state: GroupState::Generating
                })
            );
            let rest = admit_all(&mut s);
            for x in rest {
                finish(&mut s, x, if x.group == GroupId(0) { 0.0 } else { 1.0 });
            }
            assert_eq!(
                s.view().group_state(GroupId(0)),
                Some(GroupState::Trainable)
            );
            assert_eq!(s.group(GroupId(0)).unwrap().reward_mean, 0.5);
            assert_eq!(
                s.extend_group(T, GroupId(0), 1),
                Err(ExtendError::NotExtendable {
                    state: GroupState::Trainable
                })
            );
        }
    }

    // ----- trainable and filtered -----------------------------------------------------------

    mod trainable_filtered {
        use super::*;

        #[test]
        fn trainer_fifo_follows_materialization_not_draw_order() {
            let (mut g, mut r) = storage(8, 32);
            let mut s = begun(&mut g, &mut r, plan(3, 2));
            s.on_prompts_drawn(T, 3).unwrap();
            let a = admit_all(&mut s);
            for i in [4, 5, 0, 1, 2, 3] {
                finish(&mut s, a[i], (i % 2) as f32);
            }
            let order: Vec<_> = core::iter::from_fn(|| s.poll_dispatch(T))
                .map(|d| (d.group.0, d.seq))
                .collect();
            assert_eq!(order, [(2, 0), (0, 1), (1, 2)]);
            assert_eq!(s.dispatched_group(1), Some(GroupId(0)));
        }

        #[test]
        fn zero_variance_threshold_is_population_std_1e_6() {
            let (mut g, mut r) = storage(8, 32);
            let mut s = begun(&mut g, &mut r, plan(2, 2));
            s.on_prompts_drawn(T, 2).unwrap();
            let a = admit_all(&mut s);
            finish(&mut s, a[0], 0.5);
            finish(&mut s, a[1], 0.5 + 1e-6); // std 5e-7
            finish(&mut s, a[2], 0.5);
            finish(&mut s, a[3], 0.5 + 1e-5); // std 5e-6 (f32 rounding is far below that)
            assert_eq!(
                s.view().group_state(GroupId(0)),
                Some(GroupState::Filtered(FilterReason::ZeroVariance))
            );
            assert_eq!(
                s.view().group_state(GroupId(1)),
                Some(GroupState::Trainable)
            );
        }

        #[test]
        fn a_non_finite_reward_filters_at_once_and_aborts_the_siblings() {
            let (mut g, mut r) = storage(8, 32);
            let mut s = begun(&mut g, &mut r, plan(2, 3));
            s.on_prompts_drawn(T, 1).unwrap();
            let a = admit_all(&mut s);
            assert_eq!(
                finish(&mut s, a[1], f32::NAN),
                Completion::Accepted {
                    group_state: GroupState::Filtered(FilterReason::NonFiniteReward)
                }
            );
            let aborts: Vec<_> = core::iter::from_fn(|| s.poll_abort(T)).collect();
            assert_eq!(aborts, [a[0], a[2]]);
            assert_eq!(s.slots_in_use(), 2);
            s.on_abort_acked(T, a[0]).unwrap();
            assert_eq!(finish(&mut s, a[2], 1.0), Completion::Discarded);
            assert_eq!(
                s.on_abort_acked(T, a[2]),
                Err(RequestError::BadRequestState {
                    state: RequestState::Cancelled
                })
            );
            let c = s.counters();
            assert_eq!(
                (
                    c.requests_aborted,
                    c.requests_discarded,
                    c.in_flight,
                    c.filtered_non_finite
                ),
                (1, 1, 0, 1)
            );
        }
    }

    // ----- dispatched and trained -----------------------------------------------------------

    mod dispatched_trained {
        use super::*;

        /// Runs a step where group `i` is trainable unless `filtered(i)`, finishing requests in
        /// admission order; returns the (tick of dispatch, group) list.
        fn run(
            p: Plan,
            filtered: impl Fn(u32) -> bool,
        ) -> (Vec<(u64, u32)>, Vec<MicroBatch>, StepSummary) {
            let (mut g, mut r) = storage(64, 256);
            let mut s = begun(&mut g, &mut r, p);
            let (mut disp, mut mbs) = (Vec::new(), Vec::new());
            for t in 1..10_000u64 {
                let now = Tick(t);
                if let Some(n) = s.poll_draw(now) {
                    s.on_prompts_drawn(now, n).unwrap();
                }
                if let Some(a) = s.poll_admit(now) {
                    let reward = if filtered(a.request.group.0) {
                        1.0
                    } else {
                        a.request.sample as f32
                    };
                    s.on_request_finished(now, a.request, V, 1, reward).unwrap();
                }
                while let Some(x) = s.poll_abort(now) {
                    s.on_abort_acked(now, x).unwrap();
                }
                while let Some(d) = s.poll_dispatch(now) {
                    disp.push((t, d.group.0));
                }
                while s.poll_micro_batch(now).is_some() {
                    let mb = s.on_micro_batch_consumed(now).unwrap();
                    assert!(s.on_micro_batch_consumed(now).is_err());
                    if mb.ends_optimizer_step {
                        s.on_optimizer_step_done(now).unwrap();
                    }
                    mbs.push(mb);
                }
                s.audit().unwrap();
                if let Some(sum) = s.poll_step_done() {
                    return (disp, mbs, sum);
                }
            }
            panic!("step did not finish");
        }

        #[test]
        fn pipelined_dispatches_each_group_when_it_materializes() {
            let mut p = plan(4, 2);
            p.micro_batch = 2;
            p.opt_steps = 2;
            let (disp, mbs, sum) = run(p, |_| false);
            assert_eq!(disp, [(2, 0), (4, 1), (6, 2), (8, 3)]);
            assert_eq!(
                mbs.iter()
                    .map(|m| (m.first_seq, m.len, m.ends_optimizer_step))
                    .collect::<Vec<_>>(),
                [(0, 2, true), (2, 2, true)]
            );
            assert_eq!((sum.counters.trained, sum.done_at), (4, Some(Tick(8))));
        }

        #[test]
        fn sync_releases_nothing_until_the_batch_is_final() {
            let mut p = plan(4, 2);
            p.micro_batch = 2;
            p.dispatch = DispatchPolicy::Sync;
            let (disp, mbs, sum) = run(p, |g| g == 1);
            // Group 1 filtered; group 4 replaces it; all four released at tick 10.
            assert_eq!(disp, [(10, 0), (10, 2), (10, 3), (10, 4)]);
            assert_eq!(
                mbs.iter()
                    .map(|m| m.ends_optimizer_step)
                    .collect::<Vec<_>>(),
                [false, true]
            );
            assert_eq!(
                (sum.counters.filtered_zero_variance, sum.counters.trained),
                (1, 4)
            );
        }

        #[test]
        fn short_batch_ends_with_a_partial_micro_batch_and_an_optimizer_step() {
            let mut p = plan(4, 2);
            p.micro_batch = 2;
            p.max_groups = 5;
            p.draw_batch = 1;
            let (disp, mbs, sum) = run(p, |g| g % 2 == 1);
            assert_eq!(disp.iter().map(|d| d.1).collect::<Vec<_>>(), [0, 2, 4]);
            assert_eq!(
                mbs.iter()
                    .map(|m| (m.len, m.ends_optimizer_step))
                    .collect::<Vec<_>>(),
                [(2, false), (1, true)]
            );
            assert!(sum.short);
            assert_eq!(
                (
                    sum.batch_groups,
                    sum.counters.trained,
                    sum.counters.filtered()
                ),
                (3, 3, 2)
            );
        }

        #[test]
        fn trainer_events_are_ordered() {
            let (mut g, mut r) = storage(8, 32);
            let mut p = plan(2, 2);
            p.opt_steps = 2;
            let mut s = begun(&mut g, &mut r, p);
            s.on_prompts_drawn(T, 2).unwrap();
            for a in admit_all(&mut s) {
                finish(&mut s, a, a.sample as f32);
            }
            assert!(s.poll_dispatch(T).is_some() && s.poll_dispatch(T).is_some());
            assert!(s.poll_micro_batch(T).is_some() && s.poll_micro_batch(T).is_some());
            assert!(s.on_micro_batch_consumed(T).unwrap().ends_optimizer_step);
            assert_eq!(
                s.on_micro_batch_consumed(T),
                Err(TrainError::OptimizerStepPending)
            );
            s.on_optimizer_step_done(T).unwrap();
            assert_eq!(
                s.on_optimizer_step_done(T),
                Err(TrainError::NoOptimizerStepDue)
            );
            s.on_micro_batch_consumed(T).unwrap();
            s.on_optimizer_step_done(T).unwrap();
            assert_eq!(s.optimizer_steps_done(), 2);
            assert_eq!(s.phase(), StepPhase::Done);
        }
    }

    // ----- aborted ---------------------------------------------------------------------------

    mod aborted {
        use super::*;

        #[test]
        fn a_full_batch_aborts_the_surplus() {
            let (mut g, mut r) = storage(8, 32);
            let mut p = plan(1, 2);
            p.draw_ahead = 2;
            p.draw_batch = 3;
            p.max_groups = 4;
            let mut s = begun(&mut g, &mut r, p);
            assert_eq!(s.poll_draw(T), Some(3));
            s.on_prompts_drawn(T, 3).unwrap();
            let a = admit_all(&mut s);
            finish(&mut s, a[2], 0.0); // g1 s0
            finish(&mut s, a[3], 1.0); // g1 complete: batch full
            assert!(s.is_batch_final());
            assert_eq!(s.view().group_state(GroupId(0)), Some(GroupState::Aborted));
            assert_eq!(s.view().group_state(GroupId(2)), Some(GroupState::Aborted));
            let ab: Vec<_> = core::iter::from_fn(|| s.poll_abort(T)).collect();
            assert_eq!(refs(&ab), [(0, 0), (0, 1), (2, 0), (2, 1)]);
            assert_eq!(s.poll_draw(T), None);
            assert_eq!(s.on_prompts_drawn(T, 1), Err(DrawError::DrawsClosed));
            for x in &ab[..3] {
                s.on_abort_acked(T, *x).unwrap();
            }
            assert_eq!(s.on_request_failed(T, ab[3], V), Ok(Failure::AbortAcked));
            s.audit().unwrap();
            let c = *s.counters();
            assert_eq!(
                (c.aborted, c.requests_aborted, c.in_flight, c.drawn),
                (2, 4, 0, 3)
            );
            assert!(c.is_conserved());
        }
    }
}
