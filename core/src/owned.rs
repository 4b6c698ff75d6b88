//! A scheduler that owns its storage, with no borrowed lifetime: what a PyO3 class or a C handle
//! can hold (`Box<OwnedScheduler<G, R>>` behind a pointer). Still allocation-free: the capacities
//! are const generics and the storage lives inside the value.
//!
//! Between borrows the scheduler's state is parked over empty slices; [`OwnedScheduler::scheduler`]
//! re-attaches it to the owned storage for as long as the returned guard lives (a few hundred
//! bytes of state are moved each way, so hold the guard across a batch of events).

use core::ops::{Deref, DerefMut};

use crate::Scheduler;
use crate::storage::SchedulerStorage;

/// A scheduler with its own fixed-capacity storage.
///
/// ```
/// use rolloutpipe_core::{OwnedScheduler, Plan, PolicyVersion, StepId, Tick};
/// // Box it to keep the storage off the stack (and to hand a stable pointer to C or Python).
/// let mut owned = Box::new(OwnedScheduler::<8, 32>::new());
/// owned.scheduler().begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)).unwrap();
/// let n = owned.scheduler().poll_draw(Tick(0)).unwrap();
/// owned.scheduler().on_prompts_drawn(Tick(0), n).unwrap();
/// assert_eq!(owned.scheduler().counters().drawn, 2); // the state survives between borrows
/// fn holdable<T: Send + 'static>(_: &T) {}
/// holdable(&owned);
/// ```
pub struct OwnedScheduler<const GROUPS: usize, const REQUESTS: usize> {
    storage: SchedulerStorage<GROUPS, REQUESTS>,
    parked: Scheduler<'static>,
}

impl<const GROUPS: usize, const REQUESTS: usize> OwnedScheduler<GROUPS, REQUESTS> {
    /// An idle scheduler over empty storage.
    ///
    /// ```
    /// # use rolloutpipe_core::OwnedScheduler;
    /// let mut s = OwnedScheduler::<4, 16>::new();
    /// assert_eq!(s.scheduler().capacity(), (4, 16));
    /// ```
    pub fn new() -> Self {
        let mut storage = SchedulerStorage::new();
        // Built over the real storage once so that its capacities are the storage's.
        let parked =
            Scheduler::new(&mut storage.groups, &mut storage.requests).rebind(&mut [], &mut []);
        OwnedScheduler { storage, parked }
    }

    /// The scheduler, attached to the owned storage while the guard lives.
    ///
    /// ```
    /// # use rolloutpipe_core::{OwnedScheduler, StepPhase};
    /// let mut s = OwnedScheduler::<4, 16>::new();
    /// assert_eq!(s.scheduler().phase(), StepPhase::Idle);
    /// ```
    pub fn scheduler(&mut self) -> Attached<'_> {
        let parked = core::mem::replace(&mut self.parked, Scheduler::new(&mut [], &mut []));
        let live = parked.rebind(&mut self.storage.groups, &mut self.storage.requests);
        Attached {
            parked: &mut self.parked,
            live: Some(live),
        }
    }
}

impl<const GROUPS: usize, const REQUESTS: usize> Default for OwnedScheduler<GROUPS, REQUESTS> {
    fn default() -> Self {
        Self::new()
    }
}

/// An [`OwnedScheduler`]'s scheduler, attached to its storage; parks the state back when
/// dropped. (If the guard is leaked with `mem::forget`, the step's state is lost, not memory.)
pub struct Attached<'o> {
    parked: &'o mut Scheduler<'static>,
    live: Option<Scheduler<'o>>,
}

impl<'o> Deref for Attached<'o> {
    type Target = Scheduler<'o>;
    fn deref(&self) -> &Scheduler<'o> {
        // Some from construction until drop.
        self.live.as_ref().unwrap_or_else(|| unreachable!())
    }
}

impl<'o> DerefMut for Attached<'o> {
    fn deref_mut(&mut self) -> &mut Scheduler<'o> {
        self.live.as_mut().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        if let Some(live) = self.live.take() {
            *self.parked = live.rebind(&mut [], &mut []);
        }
    }
}
