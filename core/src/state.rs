//! Group and request states, the counters they feed, and the step summary.
//!
//! Every group state change goes through `Scheduler::set_state`, which keeps the per-state
//! counts here in step; the counts therefore prove conservation by construction, and the audit
//! (`Scheduler::audit`) re-derives them from storage to prove the construction right.

use core::fmt;

use crate::types::{PolicyVersion, StepId, Tick};

/// Why a complete (or failing) group contributes no gradient.
///
/// ```
/// use rolloutpipe_core::FilterReason;
/// assert_eq!(FilterReason::ZeroVariance.to_string(), "zero-variance");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum FilterReason {
    /// All rewards equal (population std ≤ 1e-6): the group's advantages are all zero.
    ZeroVariance,
    /// A reward was NaN or infinite; the group is filtered at that reward, without waiting for
    /// the rest (their requests are aborted).
    NonFiniteReward,
    /// A request failed `max_attempts` times.
    AttemptsExhausted,
    /// An allocation policy skipped the held group.
    Skipped(SkipReason),
}

/// Why an allocation policy skipped a group (Pilot-Commit's fates; `Other` for the rest).
///
/// ```
/// use rolloutpipe_core::SkipReason;
/// assert_eq!(SkipReason::TooEasy.to_string(), "too-easy");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum SkipReason {
    /// The mean reward is above the policy's band.
    TooEasy,
    /// Every sample earned the full reward (p = 1): the caller may evict the prompt from later
    /// epochs (Pilot-Commit).
    Solved,
    /// The mean reward is below the policy's band (deferred).
    TooHard,
    /// Another policy-specific reason.
    Other,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SkipReason::TooEasy => "too-easy",
            SkipReason::Solved => "solved",
            SkipReason::TooHard => "too-hard",
            SkipReason::Other => "other",
        })
    }
}

impl fmt::Display for FilterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FilterReason::ZeroVariance => f.write_str("zero-variance"),
            FilterReason::NonFiniteReward => f.write_str("non-finite-reward"),
            FilterReason::AttemptsExhausted => f.write_str("attempts-exhausted"),
            FilterReason::Skipped(r) => write!(f, "skipped-{r}"),
        }
    }
}

/// The lifecycle of a group within a step (SPEC §1–2).
///
/// ```text
/// Queued -> Generating -> Materializing -> Trainable -> Dispatched -> Trained
///    \           \              \-> Filtered(ZeroVariance)
///     \           \-> Filtered(NonFiniteReward | AttemptsExhausted)
///      \-> Aborted (any incomplete state, once the batch is full)
/// ```
///
/// ```
/// use rolloutpipe_core::{FilterReason, GroupState};
/// assert_eq!(GroupState::Filtered(FilterReason::NonFiniteReward).to_string(), "filtered(non-finite-reward)");
/// assert!(GroupState::Generating.is_incomplete());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum GroupState {
    /// Drawn; no request admitted yet.
    Queued,
    /// At least one request admitted; not every response generated.
    Generating,
    /// Every response generated; some rewards (verifier) pending.
    Materializing,
    /// Complete and trainable, not yet handed to the trainer.
    Trainable,
    /// Contributes no gradient.
    Filtered(FilterReason),
    /// In the trainer FIFO or a micro-batch in training.
    Dispatched,
    /// Its micro-batch has been consumed by the trainer.
    Trained,
    /// Surplus: the batch filled before it completed.
    Aborted,
}

impl GroupState {
    /// Queued, Generating or Materializing: still needs work from the rollout side.
    ///
    /// ```
    /// use rolloutpipe_core::GroupState;
    /// assert!(!GroupState::Trainable.is_incomplete());
    /// ```
    pub const fn is_incomplete(self) -> bool {
        matches!(
            self,
            GroupState::Queued | GroupState::Generating | GroupState::Materializing
        )
    }

    /// Trainable, Dispatched or Trained: counts towards the batch.
    ///
    /// ```
    /// use rolloutpipe_core::GroupState;
    /// assert!(GroupState::Dispatched.is_trainable());
    /// ```
    pub const fn is_trainable(self) -> bool {
        matches!(
            self,
            GroupState::Trainable | GroupState::Dispatched | GroupState::Trained
        )
    }

    /// Filtered, Trained or Aborted: the group's story in this step is over.
    ///
    /// ```
    /// use rolloutpipe_core::GroupState;
    /// assert!(GroupState::Aborted.is_final());
    /// ```
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            GroupState::Filtered(_) | GroupState::Trained | GroupState::Aborted
        )
    }
}

impl fmt::Display for GroupState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupState::Queued => f.write_str("queued"),
            GroupState::Generating => f.write_str("generating"),
            GroupState::Materializing => f.write_str("materializing"),
            GroupState::Trainable => f.write_str("trainable"),
            GroupState::Filtered(r) => write!(f, "filtered({r})"),
            GroupState::Dispatched => f.write_str("dispatched"),
            GroupState::Trained => f.write_str("trained"),
            GroupState::Aborted => f.write_str("aborted"),
        }
    }
}

/// The lifecycle of one request slot (one sample of a group; attempts reuse the slot).
///
/// ```
/// use rolloutpipe_core::RequestState;
/// assert!(RequestState::AbortSent.holds_slot());
/// assert!(!RequestState::Pending.holds_slot());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum RequestState {
    /// Not part of the current step.
    Unused,
    /// Waiting for a slot.
    Pending,
    /// Holding a slot, generating.
    InFlight,
    /// Response generated (slot freed), reward pending.
    Generated,
    /// Reward recorded.
    Rewarded,
    /// Its group ended while it ran; the abort has not been polled yet. Holds its slot.
    AbortPending,
    /// Abort handed out by `poll_abort`; waiting for the ack (or a late finish). Holds its slot.
    AbortSent,
    /// Generated, but its group ended before the reward came: the reward, if it still comes, is
    /// discarded (`on_reward` returns `Completion::Discarded`).
    Dropped,
    /// Ended without a result (dropped while pending, abort acked, or discarded).
    Cancelled,
}

impl RequestState {
    /// The request transition table: whether a request may move from `self` to `to`. Every
    /// change of an existing request goes through `Scheduler::set_req`, which checks this in
    /// debug builds (a request is born `Pending` when its group is drawn or extended).
    ///
    /// ```
    /// use rolloutpipe_core::RequestState;
    /// assert!(RequestState::InFlight.can_become(RequestState::Generated));
    /// assert!(!RequestState::Rewarded.can_become(RequestState::Pending));
    /// ```
    pub const fn can_become(self, to: RequestState) -> bool {
        use RequestState::*;
        matches!(
            (self, to),
            (Pending, InFlight | Cancelled)
                | (InFlight, Generated | Pending | Cancelled | AbortPending)
                | (Generated, Rewarded | Dropped)
                | (AbortPending, AbortSent | Cancelled | Dropped)
                | (AbortSent, Cancelled | Dropped)
                | (Dropped, Cancelled)
        )
    }

    /// Whether the request occupies a rollout slot.
    ///
    /// ```
    /// use rolloutpipe_core::RequestState;
    /// assert!(RequestState::InFlight.holds_slot());
    /// ```
    pub const fn holds_slot(self) -> bool {
        matches!(
            self,
            RequestState::InFlight | RequestState::AbortPending | RequestState::AbortSent
        )
    }
}

impl fmt::Display for RequestState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RequestState::Unused => "unused",
            RequestState::Pending => "pending",
            RequestState::InFlight => "in-flight",
            RequestState::Generated => "generated",
            RequestState::Rewarded => "rewarded",
            RequestState::AbortPending => "abort-pending",
            RequestState::AbortSent => "abort-sent",
            RequestState::Dropped => "dropped",
            RequestState::Cancelled => "cancelled",
        })
    }
}

/// Per-step counts of groups by state and of request events.
///
/// Group counts are maintained by the one state-change function, so
/// `drawn == trained + filtered() + aborted + in_progress()` holds after every event.
///
/// ```
/// use rolloutpipe_core::Counters;
/// let c = Counters::default();
/// assert!(c.is_conserved());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Counters {
    /// Prompts drawn.
    pub drawn: u32,
    /// Groups now Queued.
    pub queued: u32,
    /// Groups now Generating.
    pub generating: u32,
    /// Groups now Materializing.
    pub materializing: u32,
    /// Groups now Trainable (complete, undispatched).
    pub trainable: u32,
    /// Groups now Dispatched (in the trainer FIFO or an untrained micro-batch).
    pub dispatched: u32,
    /// Groups trained.
    pub trained: u32,
    /// Groups filtered for zero variance.
    pub filtered_zero_variance: u32,
    /// Groups filtered for a non-finite reward.
    pub filtered_non_finite: u32,
    /// Groups filtered after a request exhausted its attempts.
    pub filtered_attempts: u32,
    /// Groups skipped by an allocation policy.
    pub filtered_skipped: u32,
    /// Groups aborted as surplus.
    pub aborted: u32,
    /// Requests admitted into a slot (each attempt counts).
    pub requests_admitted: u64,
    /// Responses generated and accepted.
    pub requests_generated: u64,
    /// Rewards accepted.
    pub requests_rewarded: u64,
    /// Attempts that failed.
    pub requests_failed: u64,
    /// In-flight requests whose abort was acknowledged.
    pub requests_aborted: u64,
    /// Requests that finished after their group ended; their result was discarded.
    pub requests_discarded: u64,
    /// Admitted requests handed back without burning an attempt (the engine refused the
    /// admission, or preempted or migrated the request); they wait for a slot again.
    pub requests_requeued: u64,
    /// Pending or generated requests dropped without running (or without a reward) because their
    /// group ended.
    pub requests_dropped: u64,
    /// Requests holding a slot now (in flight or being aborted).
    pub in_flight: u32,
}

impl Counters {
    /// Groups filtered, all reasons.
    ///
    /// ```
    /// use rolloutpipe_core::Counters;
    /// let c = Counters { filtered_zero_variance: 2, filtered_attempts: 1, ..Counters::default() };
    /// assert_eq!(c.filtered(), 3);
    /// ```
    pub const fn filtered(&self) -> u32 {
        self.filtered_zero_variance
            + self.filtered_non_finite
            + self.filtered_attempts
            + self.filtered_skipped
    }

    /// Groups not yet in a final state (queued, generating, materializing, trainable, dispatched).
    ///
    /// ```
    /// use rolloutpipe_core::Counters;
    /// let c = Counters { queued: 1, dispatched: 2, ..Counters::default() };
    /// assert_eq!(c.in_progress(), 3);
    /// ```
    pub const fn in_progress(&self) -> u32 {
        self.queued + self.generating + self.materializing + self.trainable + self.dispatched
    }

    /// Groups that count towards the batch (trainable, dispatched, trained).
    ///
    /// ```
    /// use rolloutpipe_core::Counters;
    /// let c = Counters { trainable: 1, trained: 2, ..Counters::default() };
    /// assert_eq!(c.batch_filled(), 3);
    /// ```
    pub const fn batch_filled(&self) -> u32 {
        self.trainable + self.dispatched + self.trained
    }

    /// Groups that still need rollout work (queued, generating, materializing).
    ///
    /// ```
    /// use rolloutpipe_core::Counters;
    /// let c = Counters { queued: 1, materializing: 1, ..Counters::default() };
    /// assert_eq!(c.incomplete(), 2);
    /// ```
    pub const fn incomplete(&self) -> u32 {
        self.queued + self.generating + self.materializing
    }

    /// `drawn == trained + filtered + aborted + in_progress`, and every admitted attempt is
    /// accounted for: `admitted == generated + failed + aborted + discarded + in_flight`.
    ///
    /// ```
    /// use rolloutpipe_core::Counters;
    /// let c = Counters { drawn: 2, trained: 1, aborted: 1, ..Counters::default() };
    /// assert!(c.is_conserved());
    /// ```
    pub const fn is_conserved(&self) -> bool {
        self.drawn as u64
            == self.trained as u64
                + self.filtered() as u64
                + self.aborted as u64
                + self.in_progress() as u64
            && self.requests_admitted
                == self.requests_generated
                    + self.requests_failed
                    + self.requests_aborted
                    + self.requests_discarded
                    + self.requests_requeued
                    + self.in_flight as u64
    }
}

/// Where the scheduler is in its step protocol.
///
/// ```
/// use rolloutpipe_core::StepPhase;
/// assert_ne!(StepPhase::Idle, StepPhase::Done);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum StepPhase {
    /// No step begun yet.
    #[default]
    Idle,
    /// A step is running.
    Active,
    /// The step is over: its batch trained, optimizer steps done, no slot held.
    Done,
}

/// What happened in a step; complete once the phase is `Done`.
///
/// ```
/// use rolloutpipe_core::{StepSummary, StepId, PolicyVersion, Tick, Counters};
/// let s = StepSummary { step: StepId(0), version: PolicyVersion(0), began_at: Tick(0),
///     batch_final_at: None, done_at: None, batch_groups: 0, short: false, counters: Counters::default() };
/// assert!(s.done_at.is_none());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct StepSummary {
    /// The step.
    pub step: StepId,
    /// Its policy version.
    pub version: PolicyVersion,
    /// When `begin_step` was called.
    pub began_at: Tick,
    /// When the batch became final (B trainable groups, or short with nothing left to draw).
    pub batch_final_at: Option<Tick>,
    /// When the step became done.
    pub done_at: Option<Tick>,
    /// Trainable groups in the final batch (B unless short; only meaningful once final).
    pub batch_groups: u32,
    /// The batch ended with fewer than B trainable groups (draw cap or data exhausted).
    pub short: bool,
    /// The step's counters.
    pub counters: Counters,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_predicates_partition() {
        let all = [
            GroupState::Queued,
            GroupState::Generating,
            GroupState::Materializing,
            GroupState::Trainable,
            GroupState::Filtered(FilterReason::ZeroVariance),
            GroupState::Dispatched,
            GroupState::Trained,
            GroupState::Aborted,
        ];
        for s in all {
            // Each state is in exactly one of: incomplete, trainable-but-unfinished, final, or
            // both trainable and final (Trained).
            let n = s.is_incomplete() as u8 + s.is_final() as u8;
            assert!(
                n == 1 || s == GroupState::Trainable || s == GroupState::Dispatched,
                "{s:?}"
            );
        }
        assert!(GroupState::Trained.is_trainable() && GroupState::Trained.is_final());
    }

    #[test]
    fn conservation_detects_a_lost_group() {
        let c = Counters {
            drawn: 3,
            trained: 1,
            queued: 1,
            ..Counters::default()
        };
        assert!(!c.is_conserved());
        let c = Counters {
            requests_admitted: 2,
            in_flight: 1,
            ..Counters::default()
        };
        assert!(!c.is_conserved());
    }
}
