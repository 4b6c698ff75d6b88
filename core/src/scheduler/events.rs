//! Events in: what happened (`begin_step`, draws, completions, failures, acks, training).

use super::*;

impl<'a> Scheduler<'a> {
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
        self.on_prompts_drawn_with(now, n, self.plan.group_size)
    }

    /// [`on_prompts_drawn`](Self::on_prompts_drawn) with `samples` initial samples per prompt,
    /// at most the plan's G (the group's target is its own: a pilot, a re-drawn deferred prompt,
    /// or VIGOR's n0 can start smaller; extensions grow it later). Storage and the sample budget
    /// are charged for the samples actually created.
    ///
    /// ```
    /// use rolloutpipe_core::{DrawError, GroupId, Plan, PolicyVersion, SchedulerStorage, StepId, Tick};
    /// let mut storage = SchedulerStorage::<4, 16>::new();
    /// let mut s = storage.scheduler();
    /// s.begin_step(Tick(0), StepId(0), PolicyVersion(0), Plan::new(2, 4)).unwrap();
    /// assert_eq!(s.on_prompts_drawn_with(Tick(0), 1, 2), Ok(GroupId(0)));
    /// assert_eq!(s.group(GroupId(0)).unwrap().target, 2);
    /// assert_eq!(s.on_prompts_drawn_with(Tick(0), 1, 5), Err(DrawError::SamplesAboveGroupSize { samples: 5, group_size: 4 }));
    /// ```
    pub fn on_prompts_drawn_with(
        &mut self,
        now: Tick,
        n: u32,
        samples: u16,
    ) -> Result<GroupId, DrawError> {
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
        if samples == 0 {
            return Err(DrawError::ZeroSamples);
        }
        if samples > self.plan.group_size {
            return Err(DrawError::SamplesAboveGroupSize {
                samples,
                group_size: self.plan.group_size,
            });
        }
        let Some(reserved_from) = self.draw_reserves(n, samples) else {
            return Err(DrawError::SampleBudget { requested: n });
        };
        let g_size = samples as u32;
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
            let reserve = if i >= reserved_from.0 || i < reserved_from.1 {
                self.plan.commit_reserve
            } else {
                0
            };
            self.reserved += reserve as u64;
            self.groups[g as usize] = GroupSlot {
                state: GroupState::Queued,
                target: samples,
                pending: samples,
                first,
                drawn_at: now,
                reserve,
                ..GroupSlot::EMPTY
            };
            for s in 0..samples {
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
    /// its records move to the end of the used storage (O(target)), leaving a hole. Holes are
    /// free space: when the tail has no room, the storage is compacted in place (O(used
    /// records), allocation-free) and the group rotated to the end, so an extension fails only
    /// when the step's live samples would not fit. Storage for the `max_groups − drawn` prompts the step may still draw
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
        // A held group goes back to generating; its new samples get a fresh decision. Its
        // reserve, if any, is what these samples spend.
        self.unhold(g);
        self.release_reserve(g);
        self.samples_used += extra as u64;
        let cap = self.req_cap as u64 - self.reserved_requests();
        let copy = if at_tail { 0 } else { slot.target as u64 };
        if self.req_used as u64 + copy + extra as u64 > cap {
            // No room to copy the records past the tail: squeeze out the holes, then rotate the
            // group's records to the end (in place; `extension_room` checked the live total).
            self.compact();
            self.rotate_to_tail(g);
        } else if !at_tail {
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
    pub(super) fn extension_room(&self, g: u32, extra: u16) -> Result<bool, ExtendError> {
        let slot = &self.groups[g as usize];
        // The group may spend its own reserve, not another group's.
        let others = self.reserved - slot.reserve as u64;
        if self.plan.sample_budget != 0
            && self.samples_used + others + extra as u64 > self.plan.sample_budget as u64
        {
            return Err(ExtendError::SampleBudget { extra });
        }
        let at_tail = slot.first + slot.target as u32 == self.req_used;
        // Request storage for the prompts this step may still draw stays reserved, so that a
        // draw `poll_draw` asks for is always accepted (extensions cannot starve over-sampling).
        // Holes left by earlier relocations count as free: `extend_group` compacts them away
        // when the tail alone has no room.
        let live = (self.req_used - self.req_holes) as u64;
        if live + extra as u64 + self.reserved_requests() > self.req_cap as u64 {
            return Err(ExtendError::RequestsFull { extra });
        }
        Ok(at_tail)
    }

    /// Request slots kept for the prompts this step may still draw.
    fn reserved_requests(&self) -> u64 {
        if self.draws_closed() {
            0
        } else {
            self.plan.max_groups.saturating_sub(self.counters.drawn) as u64
                * self.plan.group_size as u64
        }
    }

    /// Whether `extra` more samples for incomplete group `g` fit (budget and storage).
    pub(crate) fn extension_fits(&self, g: u32, extra: u16) -> bool {
        self.groups[g as usize].target.checked_add(extra).is_some()
            && self.extension_room(g, extra).is_ok()
    }

    /// Prompts the sample budget allows now, beyond the `outstanding` ones already asked for
    /// (`u32::MAX` without a budget), so that `on_prompts_drawn` accepts them. An asked-for
    /// prompt is charged `G + commit_reserve`, the most its draw can take; a prompt of the
    /// first B costs its pilot, plus its reserve when a prompt beyond B is asked for with it.
    pub(super) fn budget_prompts(&self, outstanding: u32) -> u32 {
        if self.plan.sample_budget == 0 {
            return u32::MAX;
        }
        let g = self.plan.group_size as u64;
        let gc = g + self.plan.commit_reserve as u64;
        let left = (self.plan.sample_budget as u64)
            .saturating_sub(self.samples_used + self.reserved + outstanding as u64 * gc);
        let batch_left =
            self.plan
                .batch_groups
                .saturating_sub(self.counters.drawn.saturating_add(outstanding)) as u64;
        let n = if left >= batch_left * gc {
            left / gc
        } else {
            batch_left.min(left / g)
        };
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The budget check of a draw of `n` prompts of `samples` samples: `None` when it does not
    /// fit, else `(over, first)`: the prompts from index `over` of the draw on are beyond the
    /// first B and get their `commit_reserve`, and so do the first `first` of those within B
    /// (as many as the budget holds, after the reserves, the draw's pilots and the batch's
    /// pilots still to draw).
    fn draw_reserves(&self, n: u32, samples: u16) -> Option<(u32, u32)> {
        let budget = self.plan.sample_budget as u64;
        let c = self.plan.commit_reserve as u64;
        if budget == 0 {
            return Some((u32::MAX, 0));
        }
        let drawn = self.counters.drawn;
        let within = self.plan.batch_groups.saturating_sub(drawn).min(n);
        let need =
            self.samples_used + self.reserved + n as u64 * samples as u64 + (n - within) as u64 * c;
        if need > budget {
            return None;
        }
        if c == 0 {
            return Some((u32::MAX, 0));
        }
        let later = self.plan.batch_groups.saturating_sub(drawn + within) as u64;
        let spare = (budget - need).saturating_sub(later * self.plan.group_size as u64);
        Some((within, (spare / c).min(within as u64) as u32))
    }

    /// No more draws this step: the batch is final, the data exhausted, `max_groups` drawn, or
    /// the sample budget has no room for another prompt (its pilot, plus its `commit_reserve`
    /// beyond the first B) even once every reserve is given back: reserves come back as their
    /// groups are decided, so they only delay draws.
    pub(super) fn draws_closed(&self) -> bool {
        let next = if self.counters.drawn < self.plan.batch_groups {
            self.plan.group_size as u64
        } else {
            self.plan.group_size as u64 + self.plan.commit_reserve as u64
        };
        self.is_final
            || self.exhausted
            || self.counters.drawn >= self.plan.max_groups
            || (self.plan.sample_budget != 0
                && (self.plan.sample_budget as u64).saturating_sub(self.samples_used) < next)
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
        let index = self.mb_consumed;
        let first_seq = self.consumed_groups;
        // Every released micro-batch ends at a marked cut.
        let mut end = first_seq;
        while !self.groups[end as usize].mb_cut {
            end += 1;
        }
        let len = end + 1 - first_seq;
        self.consumed_groups += len;
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
}
