//! Decisions out: what to do next (`poll_*`), each handed out once.

use super::*;

impl<'a> Scheduler<'a> {
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
        let budget = self.budget_prompts(self.draw_outstanding);
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
        self.groups[seq as usize].mb_cut = false;
        self.set_state(g, GroupState::Dispatched);
        Some(Dispatch {
            group: GroupId(g),
            seq,
        })
    }

    /// The next micro-batch the trainer may start: the dispatched groups up to the cut (`m`
    /// groups, or the group that brings it to `m` samples or tokens, or the end of an optimizer
    /// step's groups), or, once the batch is final, the remaining ones.
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
        let first_seq = self.released_groups;
        // Scan the dispatched groups not scanned yet for the cut (O(1) amortized per group).
        let mut cut = None;
        while self.mb_scan < self.dispatched {
            let g = self.groups[self.mb_scan as usize].by_seq;
            self.mb_acc += self.mb_units(g);
            self.mb_scan += 1;
            if self.mb_cut_at(self.mb_acc, self.mb_scan) {
                cut = Some(self.mb_scan);
                break;
            }
        }
        let end = match cut {
            Some(end) => end,
            // The final batch's remainder, once nothing more can join it.
            None if self.is_final && self.mb_scan > first_seq && self.counters.trainable == 0 => {
                self.mb_scan
            }
            None => return None,
        };
        let len = end - first_seq;
        self.mb_acc = 0;
        self.groups[(end - 1) as usize].mb_cut = true;
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
}
