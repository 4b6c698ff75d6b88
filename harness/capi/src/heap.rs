//! A scheduler over storage sized at run time: what a C handle or a Python object holds.
//! `OwnedScheduler<G, R>` fixes its capacities at compile time, which a foreign caller cannot
//! choose; this type either allocates `groups` + `requests` slots once, at creation
//! ([`HeapScheduler::new`]), or places them in memory the caller owns
//! ([`HeapScheduler::new_in`], for C callers that allocate nothing at run time). The core never
//! allocates either way.
//!
//! The scheduler borrows the two slot arrays for `'static` while this value owns them (a
//! self-reference), so the arrays are held as raw pointers and freed only after the scheduler is
//! gone. Callers reach the scheduler only through [`HeapScheduler::with`], whose closure is
//! generic over the borrow's lifetime: it cannot move the scheduler (or the storage it borrows)
//! out, which is what keeps the self-reference sound.

use rolloutpipe_core::{GroupSlot, RequestSlot, Scheduler};

/// A scheduler over `groups` group slots and `requests` request slots allocated on the heap.
///
/// ```
/// use rolloutpipe_capi::HeapScheduler;
/// use rolloutpipe_core::{Plan, PolicyVersion, StepId, Tick};
/// let mut h = HeapScheduler::new(8, 32);
/// h.with(|s| s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2))).unwrap();
/// let n = h.with(|s| s.poll_draw(Tick(0))).unwrap();
/// h.with(|s| s.on_prompts_drawn(Tick(0), n)).unwrap();
/// assert_eq!(h.with(|s| s.counters().drawn), 2); // state survives between calls
/// assert_eq!(h.capacity(), (8, 32));
/// ```
pub struct HeapScheduler {
    /// `Some` except while a `with` closure runs (or after one panicked).
    live: Option<Scheduler<'static>>,
    groups: *mut [GroupSlot],
    requests: *mut [RequestSlot],
    /// The slot arrays came from `Box::leak` and are freed on drop; otherwise the caller owns
    /// the memory and frees it after this value is gone.
    owned: bool,
}

// SAFETY: the raw pointers are owned allocations that only `live` reads, and only through
// `&mut self` (`with`) or `&self` (`with_ref`); moving the value to another thread moves that
// exclusive ownership with it. `Scheduler` itself is `Send + Sync` (plain slices of `Copy` data).
unsafe impl Send for HeapScheduler {}
// SAFETY: `&HeapScheduler` only hands out `&Scheduler`, which is `Sync`.
unsafe impl Sync for HeapScheduler {}

impl HeapScheduler {
    /// An idle scheduler over freshly allocated storage. The core uses at most 2^24 group slots
    /// and `u32::MAX - 1` request slots; larger counts allocate memory it ignores.
    pub fn new(groups: usize, requests: usize) -> Self {
        let g: &'static mut [GroupSlot] =
            Box::leak(vec![GroupSlot::EMPTY; groups].into_boxed_slice());
        let r: &'static mut [RequestSlot] =
            Box::leak(vec![RequestSlot::EMPTY; requests].into_boxed_slice());
        let (gp, rp) = (g as *mut [GroupSlot], r as *mut [RequestSlot]);
        HeapScheduler {
            live: Some(Scheduler::new(g, r)),
            groups: gp,
            requests: rp,
            owned: true,
        }
    }

    /// Bytes of caller memory [`new_in`](Self::new_in) needs for `groups` + `requests` slots,
    /// at any alignment (the slack to align the arrays is included). `None` on overflow.
    pub fn storage_bytes(groups: usize, requests: usize) -> Option<usize> {
        let g = groups.checked_mul(size_of::<GroupSlot>())?;
        let r = requests.checked_mul(size_of::<RequestSlot>())?;
        g.checked_add(r)?
            .checked_add(align_of::<GroupSlot>() - 1)?
            .checked_add(align_of::<RequestSlot>() - 1)
    }

    /// A scheduler whose `groups` + `requests` slots live in `mem` (caller-owned storage): no
    /// allocation, and nothing is freed on drop. `mem` may have any alignment; it needs
    /// [`storage_bytes`](Self::storage_bytes) bytes. `None` when it is too short.
    ///
    /// # Safety
    /// `mem` is valid for reads and writes of `len` bytes, not accessed otherwise while the
    /// returned value lives, and outlives it (the caller frees it after dropping this value).
    pub unsafe fn new_in(mem: *mut u8, len: usize, groups: usize, requests: usize) -> Option<Self> {
        if mem.is_null() || len < Self::storage_bytes(groups, requests)? {
            return None;
        }
        let g_at = mem.align_offset(align_of::<GroupSlot>());
        let g_end = g_at + groups * size_of::<GroupSlot>();
        // SAFETY: g_end <= len (storage_bytes counts the alignment slack), so the offset stays in
        // `mem`'s allocation.
        let r_at = g_end + unsafe { mem.add(g_end) }.align_offset(align_of::<RequestSlot>());
        debug_assert!(r_at + requests * size_of::<RequestSlot>() <= len);
        // SAFETY: both ranges are inside `mem` (checked above), aligned for their element type,
        // disjoint, and exclusively ours for the value's life by the caller's contract. Every
        // element is written before the slices are formed.
        let (g, r) = unsafe {
            let gp = mem.add(g_at).cast::<GroupSlot>();
            let rp = mem.add(r_at).cast::<RequestSlot>();
            for i in 0..groups {
                gp.add(i).write(GroupSlot::EMPTY);
            }
            for i in 0..requests {
                rp.add(i).write(RequestSlot::EMPTY);
            }
            (
                std::ptr::slice_from_raw_parts_mut(gp, groups),
                std::ptr::slice_from_raw_parts_mut(rp, requests),
            )
        };
        // SAFETY: as above; the borrow is held only by `live`, which goes before the memory.
        let live = unsafe { Scheduler::new(&mut *g, &mut *r) };
        Some(HeapScheduler {
            live: Some(live),
            groups: g,
            requests: r,
            owned: false,
        })
    }

    /// Runs `f` on the scheduler. Returns `None` only if an earlier `f` panicked (the step's
    /// state was lost with the unwinding closure; the core itself does not panic).
    pub fn try_with<R>(&mut self, f: impl for<'s> FnOnce(&mut Scheduler<'s>) -> R) -> Option<R> {
        let mut s = self.live.take()?;
        let r = f(&mut s);
        // `f` is generic over the lifetime, so whatever it left in `s` borrows either this
        // value's storage or data that lives for any lifetime (empty or leaked slices).
        self.live = Some(s);
        Some(r)
    }

    /// [`try_with`](Self::try_with) for callers that treat a lost state as unreachable:
    /// after a panic inside `f`, later calls see a fresh idle scheduler over the same storage.
    pub fn with<R>(&mut self, f: impl for<'s> FnOnce(&mut Scheduler<'s>) -> R) -> R {
        if self.live.is_none() {
            // SAFETY: the only borrower of the storage (`live`) is gone, so these are the sole
            // references; the storage outlives `self` (owned: freed in drop after `live`;
            // caller-owned: by `new_in`'s contract). Reset over the same storage, which keeps a
            // caller-owned scheduler allocation-free.
            let (g, r) = unsafe { (&mut *self.groups, &mut *self.requests) };
            g.fill(GroupSlot::EMPTY);
            r.fill(RequestSlot::EMPTY);
            self.live = Some(Scheduler::new(g, r));
        }
        match self.try_with(f) {
            Some(r) => r,
            None => unreachable!("the scheduler was just restored"),
        }
    }

    /// Runs `f` on a shared borrow (accessors, `audit`). `None` after a panic, as `try_with`.
    pub fn with_ref<R>(&self, f: impl for<'s> FnOnce(&Scheduler<'s>) -> R) -> Option<R> {
        self.live.as_ref().map(f)
    }

    /// The slots allocated: (groups, requests).
    pub fn capacity(&self) -> (usize, usize) {
        self.capacity_slots()
    }

    fn capacity_slots(&self) -> (usize, usize) {
        (self.groups.len(), self.requests.len())
    }
}

impl Drop for HeapScheduler {
    fn drop(&mut self) {
        // The borrower goes first, then the storage it borrowed.
        self.live = None;
        if !self.owned {
            return; // caller-owned memory: the slots are `Copy`, nothing to drop or free
        }
        // SAFETY: both pointers came from `Box::leak` in `new` and are freed only here; the
        // only borrower (`live`) is gone and `with` cannot have moved it elsewhere.
        unsafe {
            drop(Box::from_raw(self.groups));
            drop(Box::from_raw(self.requests));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rolloutpipe_core::{Plan, PolicyVersion, StepId, StepPhase, Tick};

    #[test]
    fn state_survives_between_calls_and_capacity_is_the_allocation() {
        let mut h = HeapScheduler::new(4, 16);
        assert_eq!(h.with(|s| s.capacity()), (4, 16));
        h.with(|s| s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)))
            .unwrap();
        assert_eq!(h.with_ref(|s| s.phase()), Some(StepPhase::Active));
        // A plan needing more groups than allocated is refused by the core, not by us.
        let mut h = HeapScheduler::new(1, 16);
        assert!(
            h.with(|s| s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)))
                .is_err()
        );
    }

    #[test]
    fn a_swapped_in_scheduler_is_kept_and_the_storage_still_freed() {
        let mut h = HeapScheduler::new(4, 16);
        h.with(|s| *s = Scheduler::new(&mut [], &mut []));
        assert_eq!(h.with(|s| s.capacity()), (0, 0));
        drop(h); // frees the 4 + 16 slots; run under Miri to check
    }

    #[test]
    fn caller_owned_storage_at_any_alignment_runs_a_step_and_is_not_freed() {
        let need = HeapScheduler::storage_bytes(4, 16).unwrap();
        let mut buf = vec![0xA5u8; need + 3];
        for shift in 0..3 {
            let mem = buf[shift..].as_mut_ptr();
            // SAFETY: `buf[shift..]` has `need` bytes, outlives `h` and is untouched meanwhile.
            let mut h = unsafe { HeapScheduler::new_in(mem, need, 4, 16) }.unwrap();
            assert_eq!(h.capacity(), (4, 16));
            h.with(|s| s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 2)))
                .unwrap();
            let n = h.with(|s| s.poll_draw(Tick(0))).unwrap();
            h.with(|s| s.on_prompts_drawn(Tick(0), n)).unwrap();
            assert_eq!(h.with(|s| s.counters().drawn), 2);
            assert!(h.with_ref(|s| s.audit()).unwrap().is_ok());
            drop(h); // frees nothing: Miri would report a double free of `buf` otherwise
        }
        // One byte short, or null, is refused.
        // SAFETY: refused before any access.
        assert!(unsafe { HeapScheduler::new_in(buf.as_mut_ptr(), need - 1, 4, 16) }.is_none());
        // SAFETY: as above.
        assert!(unsafe { HeapScheduler::new_in(std::ptr::null_mut(), need, 4, 16) }.is_none());
        assert!(HeapScheduler::storage_bytes(usize::MAX, 1).is_none());
    }

    #[test]
    fn a_panic_in_the_closure_loses_the_step_but_not_the_storage() {
        let mut h = HeapScheduler::new(4, 16);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            h.with(|_| panic!("boom"));
        }));
        assert!(r.is_err());
        assert!(h.with_ref(|s| s.phase()).is_none());
        assert_eq!(h.with(|s| s.phase()), StepPhase::Idle);
        assert_eq!(h.with(|s| s.capacity()), (4, 16));
    }
}
