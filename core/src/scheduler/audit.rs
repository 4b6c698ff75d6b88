//! The audit: every count and list re-derived from storage and compared with the incremental
//! bookkeeping. O(groups + requests): the oracle of the tests and the fuzz driver, not the hot
//! path.

use super::{NIL, Scheduler};
use crate::state::{Counters, FilterReason, GroupState, RequestState, StepPhase};
use crate::types::Tick;

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

impl Scheduler<'_> {
    /// Re-derives every count and list from storage and checks the invariants: per-state
    /// counts, per-group request tallies, queue and abort-list contents, incomplete list in draw
    /// order, slot cap, dispatch order = materialization order of the dispatched groups, budget
    /// reserves (their sum, none on an ended group, used + reserved within the budget), and
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
        let mut live = 0u64;
        let mut reserved = 0u64;
        for g in 0..self.counters.drawn {
            let s = &self.groups[g as usize];
            if s.reserve != 0 && !s.state.is_incomplete() {
                return bad("ended group still holds a budget reserve", g as u64);
            }
            reserved += s.reserve as u64;
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
            live += s.target as u64;
            if s.first as u64 + s.target as u64 > self.req_used as u64 {
                return bad("group records past the used request storage", g as u64);
            }
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
        // Blocks do not overlap (each slot names its own group and sample, checked above), so
        // this says every used slot is a live record or a counted hole: nothing leaks.
        if live + self.req_holes as u64 != self.req_used as u64 {
            return bad(
                "request storage: live records plus holes",
                self.req_used as u64,
            );
        }
        if reserved != self.reserved {
            return bad("budget reserves", self.reserved);
        }
        if self.plan.sample_budget != 0
            && self.samples_used + self.reserved > self.plan.sample_budget as u64
        {
            return bad(
                "samples used plus reserves exceed the budget",
                self.samples_used,
            );
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
}
