//! Admission as a pure function of a read-only view of the scheduler.
//!
//! The state machine asks a policy "which pending request takes the free slot?" and then applies
//! the answer itself; a policy cannot change state. New policies (variance-guided, length-aware)
//! implement [`Admit`] outside the crate and are used through `Scheduler::poll_admit_with`.

use crate::Scheduler;
use crate::allocate::RewardStats;
use crate::state::{Counters, GroupState, RequestState};
use crate::storage::NIL;
use crate::types::{AdmissionPolicy, DispatchPolicy, GroupId, MicroBatchUnit, Plan, RequestRef};

/// A read-only view of the scheduler for admission policies.
///
/// ```
/// use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
/// let mut storage = SchedulerStorage::<4, 16>::new();
/// let mut s = storage.scheduler();
/// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
/// s.on_prompts_drawn(Tick(0), 2).unwrap();
/// let view = s.view();
/// assert_eq!(view.pending_requests(), 4);
/// assert_eq!(view.queue_front().map(|r| (r.group.0, r.sample)), Some((0, 0)));
/// ```
#[derive(Clone, Copy)]
pub struct View<'s, 'a> {
    pub(crate) s: &'s Scheduler<'a>,
}

impl<'s, 'a> View<'s, 'a> {
    /// The running step's plan (`None` before the first step).
    ///
    /// ```
    /// # use rolloutpipe_core::{SchedulerStorage};
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// let s = storage.scheduler();
    /// assert!(s.view().plan().is_none());
    /// ```
    pub fn plan(&self) -> Option<&'s Plan> {
        self.s.plan()
    }

    /// Reward statistics of group `g`'s recorded rewards (for allocation policies).
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 4>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// let a = s.poll_admit(Tick(0)).unwrap();
    /// s.on_request_finished(Tick(1), a.request, PolicyVersion(0), 3, 0.5).unwrap();
    /// let st = s.view().reward_stats(GroupId(0)).unwrap();
    /// assert_eq!((st.count, st.mean, st.min, st.max), (1, 0.5, 0.5, 0.5));
    /// ```
    pub fn reward_stats(&self, g: GroupId) -> Option<RewardStats> {
        let s = self.s.slot(g)?;
        // A non-finite reward ends its group at once, so it is the last one recorded and the
        // only one outside the statistics.
        let finite = if s.state == GroupState::Filtered(crate::state::FilterReason::NonFiniteReward)
        {
            s.rewarded.saturating_sub(1)
        } else {
            s.rewarded
        };
        Some(RewardStats {
            count: finite,
            mean: s.mean,
            var: if finite == 0 {
                0.0
            } else {
                s.m2 / finite as f64
            },
            min: s.min,
            max: s.max,
        })
    }

    /// Samples the step's `sample_budget` still allows, less what is reserved for undecided
    /// groups' commits (`Plan::commit_reserve`); `None` without a budget.
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 16>::new();
    /// let mut s = storage.scheduler();
    /// let mut plan = Plan::new(2, 2);
    /// plan.sample_budget = 10;
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan).unwrap();
    /// s.on_prompts_drawn(Tick(0), 2).unwrap();
    /// assert_eq!(s.view().samples_left(), Some(6));
    /// ```
    pub fn samples_left(&self) -> Option<u64> {
        let p = self.s.plan()?;
        (p.sample_budget != 0)
            .then(|| (p.sample_budget as u64).saturating_sub(self.s.samples_used + self.s.reserved))
    }

    /// The step's counters.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// let s = storage.scheduler();
    /// assert_eq!(s.view().counters().drawn, 0);
    /// ```
    pub fn counters(&self) -> &'s Counters {
        &self.s.counters
    }

    /// Requests waiting for a slot.
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert_eq!(storage.scheduler().view().pending_requests(), 0);
    /// ```
    pub fn pending_requests(&self) -> u32 {
        self.s.queue.len
    }

    /// The head of the FIFO waiting queue (submission order; retries at the back).
    ///
    /// ```
    /// # use rolloutpipe_core::SchedulerStorage;
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(storage.scheduler().view().queue_front().is_none());
    /// ```
    pub fn queue_front(&self) -> Option<RequestRef> {
        let h = self.s.queue.head;
        if h == NIL {
            return None;
        }
        let r = &self.s.reqs[h as usize];
        Some(RequestRef {
            group: GroupId(r.group),
            sample: r.sample,
        })
    }

    /// The waiting queue from head to tail.
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<2, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(1, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.view().queue().count(), 2);
    /// ```
    pub fn queue(&self) -> Queue<'s, 'a> {
        Queue {
            s: self.s,
            at: self.s.queue.head,
        }
    }

    /// Incomplete groups (queued, generating, materializing) in draw order.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 2).unwrap();
    /// let v: Vec<GroupId> = s.view().incomplete().collect();
    /// assert_eq!(v, [GroupId(0), GroupId(1)]);
    /// ```
    pub fn incomplete(&self) -> Incomplete<'s, 'a> {
        Incomplete {
            s: self.s,
            at: self.s.incomplete.head,
        }
    }

    /// How many groups the frontier holds for a given width and expected filter rate: the groups
    /// still needed for the trainer's next micro-batch (under `Sync`, for the whole batch),
    /// divided by the keep rate and rounded up, plus `width`. Zero once the batch is final.
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<16, 64>::new();
    /// let mut s = storage.scheduler();
    /// let mut plan = Plan::new(8, 2);
    /// plan.micro_batch = 4;
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), plan).unwrap();
    /// assert_eq!(s.view().frontier_len_for(0, 0), 4);
    /// assert_eq!(s.view().frontier_len_for(1, 500_000), 9);
    /// ```
    pub fn frontier_len_for(&self, width: u32, expected_filter_ppm: u32) -> u32 {
        let Some(plan) = self.s.plan() else { return 0 };
        if self.s.is_final {
            return 0;
        }
        let filled = self.s.counters.batch_filled();
        let remaining = plan.batch_groups.saturating_sub(filled);
        if remaining == 0 {
            return 0;
        }
        let need = match plan.dispatch {
            DispatchPolicy::Pipelined => self.micro_batch_need(plan, filled).min(remaining),
            DispatchPolicy::Sync => remaining,
        } as u64;
        let keep = 1_000_000u64
            .saturating_sub(expected_filter_ppm as u64)
            .max(1);
        let widened = (need * 1_000_000).div_ceil(keep);
        u32::try_from(widened)
            .unwrap_or(u32::MAX)
            .saturating_add(width)
    }

    /// Groups still needed to complete the open micro-batch, by the groups' final sizes: the
    /// units it lacks over the size of a group still to come (its initial `G` samples, a lower
    /// bound when groups get extended, so the frontier errs wide; for tokens, the filled
    /// groups' mean, or the rest of the optimizer step before any is known). Never past the
    /// optimizer step's end, where a micro-batch is always cut.
    fn micro_batch_need(&self, plan: &Plan, filled: u32) -> u32 {
        let per_opt = plan.groups_per_opt_step();
        let to_boundary = per_opt - filled % per_opt;
        let lacking = (plan.micro_batch as u64)
            .saturating_sub(self.s.fill_acc)
            .max(1);
        let per_group = match plan.micro_batch_unit {
            MicroBatchUnit::Groups => 1,
            MicroBatchUnit::Samples => plan.group_size as u64,
            MicroBatchUnit::Tokens if filled > 0 => (self.s.fill_units / filled as u64).max(1),
            MicroBatchUnit::Tokens => return to_boundary,
        };
        u32::try_from(lacking.div_ceil(per_group))
            .unwrap_or(u32::MAX)
            .min(to_boundary)
    }

    /// The frontier size under the plan's own admission policy (width 0, no widening for `Fifo`).
    ///
    /// ```
    /// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// assert_eq!(s.view().frontier_len(), 1);
    /// ```
    pub fn frontier_len(&self) -> u32 {
        match self.s.plan().map(|p| p.admission) {
            Some(AdmissionPolicy::Frontier {
                width,
                expected_filter_ppm,
                ..
            }) => self.frontier_len_for(width, expected_filter_ppm),
            _ => self.frontier_len_for(0, 0),
        }
    }

    /// The frontier groups under the plan's policy, in draw order.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 2).unwrap();
    /// assert_eq!(s.view().frontier().collect::<Vec<_>>(), [GroupId(0)]);
    /// ```
    pub fn frontier(&self) -> core::iter::Take<Incomplete<'s, 'a>> {
        self.incomplete().take(self.frontier_len() as usize)
    }

    /// The lowest-numbered group that has a pending request (O(1): a four-level bitset).
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 1)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 2).unwrap();
    /// s.poll_admit(Tick(0)).unwrap();
    /// assert_eq!(s.view().first_pending_group(), Some(GroupId(1)));
    /// ```
    pub fn first_pending_group(&self) -> Option<GroupId> {
        self.s.first_pending_group().map(GroupId)
    }

    /// Whether group `g` is in the frontier of the given width and filter rate. O(1) for the
    /// plan's own parameters while the scheduler's cache is fresh (it is refreshed before every
    /// admission), else O(frontier) by walking the incomplete list.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 2).unwrap();
    /// assert!(s.view().in_frontier_for(GroupId(0), 0, 0));
    /// assert!(!s.view().in_frontier_for(GroupId(1), 0, 0));
    /// assert!(s.view().in_frontier_for(GroupId(1), 1, 0));
    /// ```
    pub fn in_frontier_for(&self, g: GroupId, width: u32, expected_filter_ppm: u32) -> bool {
        let n = self.frontier_len_for(width, expected_filter_ppm);
        let (len, last) = if !self.s.frontier_dirty && n == self.frontier_len() {
            self.s.frontier_cache
        } else {
            self.walk_frontier(n)
        };
        len > 0
            && self.group_state(g).is_some_and(|st| st.is_incomplete())
            && (last == NIL || g.0 <= last)
    }

    /// `(len, last)` of the first `n` incomplete groups; `last == NIL` when fewer than `n`
    /// exist (the frontier is every incomplete group).
    pub(crate) fn walk_frontier(&self, n: u32) -> (u32, u32) {
        if n == 0 {
            return (0, NIL);
        }
        let mut it = self.incomplete();
        match it.nth(n as usize - 1) {
            Some(g) => (n, g.0),
            None => (n, NIL),
        }
    }

    /// A drawn group's state.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, GroupState, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.view().group_state(GroupId(0)), Some(GroupState::Queued));
    /// assert_eq!(s.view().group_state(GroupId(1)), None);
    /// ```
    pub fn group_state(&self, g: GroupId) -> Option<GroupState> {
        self.s.slot(g).map(|x| x.state)
    }

    /// A drawn group's current sample count (its target: initial samples plus extensions).
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.view().group_target(GroupId(0)), Some(2));
    /// assert_eq!(s.view().group_target(GroupId(1)), None);
    /// ```
    pub fn group_target(&self, g: GroupId) -> Option<u16> {
        self.s.slot(g).map(|x| x.target)
    }

    /// Whether group `g` is held: scored, awaiting an allocation decision.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, SchedulerStorage};
    /// let mut storage = SchedulerStorage::<1, 1>::new();
    /// assert!(!storage.scheduler().view().is_held(GroupId(0)));
    /// ```
    pub fn is_held(&self, g: GroupId) -> bool {
        self.s.slot(g).is_some_and(|x| x.held)
    }

    /// A group's requests waiting for a slot (0 for unknown groups).
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.view().pending_in(GroupId(0)), 2);
    /// ```
    pub fn pending_in(&self, g: GroupId) -> u16 {
        self.s.slot(g).map_or(0, |x| x.pending)
    }

    /// The group's pending request with the lowest sample index. O(G) worst case, O(1)
    /// amortized: the scan starts at a lower bound the scheduler keeps.
    ///
    /// ```
    /// # use rolloutpipe_core::{GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 8>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
    /// s.on_prompts_drawn(Tick(0), 1).unwrap();
    /// assert_eq!(s.view().lowest_pending(GroupId(0)).map(|r| r.sample), Some(0));
    /// ```
    pub fn lowest_pending(&self, g: GroupId) -> Option<RequestRef> {
        let slot = self.s.slot(g)?;
        if slot.pending == 0 {
            return None;
        }
        let base = slot.first as usize;
        (slot.low..slot.target)
            .find(|&k| self.s.reqs[base + k as usize].state == RequestState::Pending)
            .map(|sample| RequestRef { group: g, sample })
    }
}

/// Iterator over incomplete groups in draw order (see [`View::incomplete`]).
///
/// ```
/// # use rolloutpipe_core::{Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
/// let mut storage = SchedulerStorage::<4, 8>::new();
/// let mut s = storage.scheduler();
/// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
/// assert_eq!(s.view().incomplete().count(), 0);
/// ```
#[derive(Clone)]
pub struct Incomplete<'s, 'a> {
    s: &'s Scheduler<'a>,
    at: u32,
}

impl Iterator for Incomplete<'_, '_> {
    type Item = GroupId;
    fn next(&mut self) -> Option<GroupId> {
        if self.at == NIL {
            return None;
        }
        let g = self.at;
        self.at = self.s.groups[g as usize].link.next;
        Some(GroupId(g))
    }
}

/// Iterator over the waiting queue (see [`View::queue`]).
///
/// ```
/// # use rolloutpipe_core::SchedulerStorage;
/// let mut storage = SchedulerStorage::<1, 1>::new();
/// assert_eq!(storage.scheduler().view().queue().count(), 0);
/// ```
#[derive(Clone)]
pub struct Queue<'s, 'a> {
    s: &'s Scheduler<'a>,
    at: u32,
}

impl Iterator for Queue<'_, '_> {
    type Item = RequestRef;
    fn next(&mut self) -> Option<RequestRef> {
        if self.at == NIL {
            return None;
        }
        let r = &self.s.reqs[self.at as usize];
        self.at = r.link.next;
        Some(RequestRef {
            group: GroupId(r.group),
            sample: r.sample,
        })
    }
}

/// An admission policy: a pure choice of the next pending request, given a view.
///
/// ```
/// use rolloutpipe_core::{Admit, RequestRef, View};
/// /// Admits the newest request first (a toy LIFO policy).
/// struct Lifo;
/// impl Admit for Lifo {
///     fn choose(&self, view: &View<'_, '_>) -> Option<RequestRef> {
///         view.queue().last()
///     }
/// }
/// ```
pub trait Admit {
    /// The request that should take the next free slot, or `None` to leave it free.
    fn choose(&self, view: &View<'_, '_>) -> Option<RequestRef>;
}

impl Admit for AdmissionPolicy {
    fn choose(&self, view: &View<'_, '_>) -> Option<RequestRef> {
        match *self {
            AdmissionPolicy::Fifo { .. } => view.queue_front(),
            AdmissionPolicy::Frontier {
                width,
                expected_filter_ppm,
                ..
            } => {
                // Pending groups are incomplete and the incomplete list is in draw (= id) order,
                // so the earliest frontier group with a pending request, if any, is the
                // lowest-numbered pending group, provided it lies within the frontier.
                view.first_pending_group()
                    .filter(|&g| view.in_frontier_for(g, width, expected_filter_ppm))
                    .and_then(|g| view.lowest_pending(g))
                    .or_else(|| view.queue_front())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec;
    use std::vec::Vec;

    use super::*;
    use crate::storage::{GroupSlot, RequestSlot};
    use crate::types::{PolicyVersion, StepId, SubmitOrder, Tick};

    fn frontier_plan(b: u32, m: u32, width: u32) -> Plan {
        let mut p = Plan::new(b, 2);
        p.micro_batch = m;
        p.admission = AdmissionPolicy::Frontier {
            width,
            expected_filter_ppm: 0,
            fallback: SubmitOrder::GroupMajor,
        };
        p
    }

    #[test]
    fn frontier_membership_agrees_between_cache_and_walk() {
        let (mut g, mut r) = (vec![GroupSlot::EMPTY; 16], vec![RequestSlot::EMPTY; 64]);
        let mut s = Scheduler::new(&mut g, &mut r);
        s.begin_step(Tick(0), StepId(0), PolicyVersion(0), frontier_plan(8, 4, 1))
            .unwrap();
        s.on_prompts_drawn(Tick(0), 8).unwrap();
        // Before any admission the cache is dirty: the walk answers.
        let walked: Vec<bool> = (0..8)
            .map(|g| s.view().in_frontier_for(GroupId(g), 1, 0))
            .collect();
        assert_eq!(walked, [true, true, true, true, true, false, false, false]);
        s.poll_admit(Tick(0)).unwrap(); // refreshes the cache
        assert!(!s.frontier_dirty);
        let cached: Vec<bool> = (0..8)
            .map(|g| s.view().in_frontier_for(GroupId(g), 1, 0))
            .collect();
        assert_eq!(cached, walked);
        // Other parameters than the plan's always walk.
        assert_eq!(s.view().frontier_len_for(0, 0), 4);
        assert!(s.view().in_frontier_for(GroupId(3), 0, 0));
        assert!(!s.view().in_frontier_for(GroupId(4), 0, 0));
        // Unknown groups are never in the frontier.
        assert!(!s.view().in_frontier_for(GroupId(99), 100, 0));
    }

    #[test]
    fn frontier_skips_groups_that_left_the_incomplete_list() {
        let (mut g, mut r) = (vec![GroupSlot::EMPTY; 16], vec![RequestSlot::EMPTY; 64]);
        let mut s = Scheduler::new(&mut g, &mut r);
        s.begin_step(Tick(0), StepId(0), PolicyVersion(0), frontier_plan(8, 2, 0))
            .unwrap();
        s.on_prompts_drawn(Tick(0), 4).unwrap();
        let a = [
            s.poll_admit(Tick(0)).unwrap().request,
            s.poll_admit(Tick(0)).unwrap().request,
        ];
        // Group 0 filtered (zero variance): the frontier moves on to groups 1 and 2.
        for x in a {
            s.on_request_finished(Tick(1), x, PolicyVersion(0), 1, 1.0)
                .unwrap();
        }
        let f: Vec<u32> = s.view().frontier().map(|g| g.0).collect();
        assert_eq!(f, [1, 2]);
        assert_eq!(s.view().first_pending_group(), Some(GroupId(1)));
        let next = s.poll_admit(Tick(1)).unwrap().request;
        assert_eq!((next.group, next.sample), (GroupId(1), 0));
        assert_eq!(s.audit(), Ok(()));
    }

    #[test]
    fn fifo_ignores_the_frontier() {
        let (mut g, mut r) = (vec![GroupSlot::EMPTY; 16], vec![RequestSlot::EMPTY; 64]);
        let mut s = Scheduler::new(&mut g, &mut r);
        let mut p = frontier_plan(4, 1, 0);
        p.admission = AdmissionPolicy::Fifo {
            order: SubmitOrder::Interleaved,
        };
        s.begin_step(Tick(0), StepId(0), PolicyVersion(0), p)
            .unwrap();
        s.on_prompts_drawn(Tick(0), 3).unwrap();
        let order: Vec<(u32, u16)> = core::iter::from_fn(|| s.poll_admit(Tick(0)))
            .map(|a| (a.request.group.0, a.request.sample))
            .collect();
        assert_eq!(order, [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]);
    }
}
