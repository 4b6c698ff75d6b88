//! The allocation seam: how many samples a group gets, decided after its samples are scored.
//!
//! With `Plan::hold_scored` set, a group whose last reward arrives is *held* (it stays
//! `Materializing`, with every reward recorded) instead of being committed at once. The driver
//! asks [`Scheduler::poll_allocation_with`] what to do with the oldest held group; an
//! [`Allocate`] policy, a pure function of the read-only [`View`] (per-group reward statistics,
//! the step's sample budget), answers commit, extend by n, or skip with a reason, and the core
//! applies the answer. [`FixedG`] always commits: with it (or with `hold_scored` off, the
//! default) a step behaves exactly as before the seam existed. VIGOR (extend the high-variance
//! groups until the budget is spent) and Pilot-Commit (pilot, then keep, skip or defer) are
//! policies on this seam.

use crate::Scheduler;
use crate::policy::View;
use crate::state::{FilterReason, GroupState, SkipReason};
use crate::storage::NIL;
use crate::types::{GroupId, Tick};

/// Reward statistics of one group's recorded (finite) rewards.
///
/// ```
/// use rolloutpipe_core::RewardStats;
/// let s = RewardStats { count: 2, mean: 0.5, var: 0.25, min: 0.0, max: 1.0 };
/// assert_eq!(s.max - s.min, 1.0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RewardStats {
    /// Rewards recorded.
    pub count: u16,
    /// Their mean.
    pub mean: f64,
    /// Their population variance.
    pub var: f64,
    /// The smallest (`+inf` when none).
    pub min: f32,
    /// The largest (`-inf` when none).
    pub max: f32,
}

/// What an allocation policy decides for a scored, held group.
///
/// ```
/// use rolloutpipe_core::{Allocation, SkipReason};
/// assert_ne!(Allocation::Extend(4), Allocation::Skip(SkipReason::TooEasy));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum Allocation {
    /// Done sampling: trainable, or filtered for zero variance, exactly as without a hold.
    Commit,
    /// Generate this many more samples, then hold the group again.
    Extend(u16),
    /// Drop the group: `Filtered(Skipped(reason))`.
    Skip(SkipReason),
    /// Not yet: keep the group held and decide it again later (a policy that compares groups,
    /// such as VIGOR's rounds, waits until every group of the round is scored). The policy
    /// must answer something else once the groups it waits for are held or ended, or the step
    /// stalls.
    Wait,
}

/// An allocation policy: a pure function of a read-only view of the scheduler.
pub trait Allocate {
    /// The decision for held group `group` (all its samples scored).
    fn decide(&self, view: &View<'_, '_>, group: GroupId) -> Allocation;
}

/// GRPO's fixed group size: every held group is committed as it is (the default policy).
///
/// ```
/// use rolloutpipe_core::{Allocate, Allocation, FixedG, GroupId, SchedulerStorage};
/// let mut storage = SchedulerStorage::<1, 1>::new();
/// let s = storage.scheduler();
/// assert_eq!(FixedG.decide(&s.view(), GroupId(0)), Allocation::Commit);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FixedG;

impl Allocate for FixedG {
    fn decide(&self, _: &View<'_, '_>, _: GroupId) -> Allocation {
        Allocation::Commit
    }
}

/// What `poll_allocation_with` did with a held group.
///
/// ```
/// use rolloutpipe_core::{Allocated, Allocation, GroupId};
/// let a = Allocated { group: GroupId(0), decided: Allocation::Extend(8), applied: Allocation::Commit };
/// assert_ne!(a.decided, a.applied); // the budget or the storage had no room for 8 more
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Allocated {
    /// The group.
    pub group: GroupId,
    /// The policy's decision.
    pub decided: Allocation,
    /// What the core did: the decision, or `Commit` when an extension did not fit the step's
    /// sample budget or the request storage (never a silent stall).
    pub applied: Allocation,
}

impl Scheduler<'_> {
    /// The oldest held group (scored, waiting for an allocation decision) that `policy` does not
    /// answer [`Allocation::Wait`] for, decided and applied. `None` when no group is held
    /// (always, unless `Plan::hold_scored`) or the policy waits for every held one.
    ///
    /// ```
    /// use rolloutpipe_core::*;
    /// struct TwoMore;
    /// impl Allocate for TwoMore {
    ///     fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
    ///         if v.reward_stats(g).unwrap().count < 4 { Allocation::Extend(2) } else { Allocation::Commit }
    ///     }
    /// }
    /// let mut storage = SchedulerStorage::<2, 8>::new();
    /// let mut s = storage.scheduler();
    /// let mut plan = Plan::new(1, 2);
    /// plan.max_groups = 1;
    /// plan.hold_scored = true;
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let mut rounds = 0;
    /// while s.group(GroupId(0)).unwrap().state.is_incomplete() {
    ///     while let Some(a) = s.poll_admit(Tick(0)) {
    ///         s.on_request_finished(Tick(1), a.request, a.version, 5, a.request.sample as f32).unwrap();
    ///     }
    ///     s.poll_allocation_with(Tick(1), &TwoMore).unwrap();
    ///     rounds += 1;
    /// }
    /// assert_eq!((rounds, s.group(GroupId(0)).unwrap().target), (2, 4));
    /// assert_eq!(s.group(GroupId(0)).unwrap().state, GroupState::Trainable);
    /// ```
    pub fn poll_allocation_with<P: Allocate + ?Sized>(
        &mut self,
        now: Tick,
        policy: &P,
    ) -> Option<Allocated> {
        // The oldest held group the policy does not ask to wait for. O(held) policy calls when
        // groups wait; one when none does.
        let mut g = self.held_head;
        let decided = loop {
            if g == NIL {
                return None;
            }
            match policy.decide(&self.view(), GroupId(g)) {
                Allocation::Wait => g = self.groups[g as usize].hold_link.next,
                d => break d,
            }
        };
        let group = GroupId(g);
        self.unhold(g);
        let applied = match decided {
            Allocation::Extend(n) if n > 0 && self.extension_fits(g, n) => {
                // Cannot fail: the group is incomplete, `n > 0`, and the fit was just checked.
                match self.extend_group(now, group, n) {
                    Ok(()) => decided,
                    Err(_) => self.commit(g, now),
                }
            }
            Allocation::Skip(reason) => {
                self.end_group(g, GroupState::Filtered(FilterReason::Skipped(reason)), now);
                decided
            }
            _ => self.commit(g, now),
        };
        self.after_event(now);
        Some(Allocated {
            group,
            decided,
            applied,
        })
    }

    /// [`poll_allocation_with`](Self::poll_allocation_with) with the default policy, [`FixedG`].
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(storage.scheduler().poll_allocation(rolloutpipe_core::Tick(0)).is_none());
    /// ```
    pub fn poll_allocation(&mut self, now: Tick) -> Option<Allocated> {
        self.poll_allocation_with(now, &FixedG)
    }

    fn commit(&mut self, g: u32, now: Tick) -> Allocation {
        self.commit_scored(g, now);
        Allocation::Commit
    }
}
