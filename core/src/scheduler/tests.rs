//! Unit tests of the state machine, by group state.

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
    /// Relocation leaves a hole behind; compaction reclaims it, so storage holding exactly the
    /// step's live samples supports any number of extension cycles (before compaction existed,
    /// this ran out after a handful). Request ids, queue order and recorded rewards survive.
    #[test]
    fn many_extensions_in_tight_storage_reuse_the_holes() {
        let (mut g, mut r) = storage(3, 24);
        let mut p = plan(3, 2);
        p.max_groups = 3;
        p.slots = 64;
        let mut s = begun(&mut g, &mut r, p);
        s.on_prompts_drawn(T, 3).unwrap();
        let mut in_flight: Vec<RequestId> = Vec::new();
        let mut expected = [2u16; 3];
        let mut rewarded = 0u32;
        for cycle in 0..18u32 {
            let grp = cycle % 3;
            // Keep a mix of states: one request of the next group goes in flight, one earlier
            // one finishes (rewarded records must move with their group).
            if let Some(a) = s.poll_admit(T) {
                in_flight.push(a.request);
            }
            if cycle % 2 == 1 && !in_flight.is_empty() {
                let x = in_flight.remove(0);
                s.on_request_generated(T, x, V, 3).unwrap();
                s.on_reward(T, x, x.sample as f32).unwrap();
                rewarded += 1;
            }
            let before: Vec<_> = s.view().queue().map(|r| (r.group.0, r.sample)).collect();
            s.extend_group(T, GroupId(grp), 1)
                .unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
            expected[grp as usize] += 1;
            s.audit().unwrap_or_else(|e| panic!("cycle {cycle}: {e:?}"));
            let after: Vec<_> = s.view().queue().map(|r| (r.group.0, r.sample)).collect();
            assert_eq!(
                after[..before.len()],
                before[..],
                "cycle {cycle}: queue order"
            );
            assert_eq!(after.last(), Some(&(grp, expected[grp as usize] - 1)));
        }
        assert_eq!(expected.iter().map(|&t| t as u32).sum::<u32>(), 24);
        // Storage is now exactly full of live samples: one more does not fit.
        assert_eq!(
            s.extend_group(T, GroupId(0), 1),
            Err(ExtendError::RequestsFull { extra: 1 })
        );
        // Ids handed out before the compactions still resolve to their records.
        for x in in_flight {
            s.on_request_generated(T, x, V, 3).unwrap();
            s.on_reward(T, x, x.sample as f32).unwrap();
            rewarded += 1;
        }
        s.audit().unwrap();
        let mut seen = 0;
        for grp in 0..3 {
            let rw: Vec<_> = s.group_rewards(GroupId(grp)).unwrap().collect();
            assert_eq!(rw.len(), expected[grp as usize] as usize);
            for (k, x) in rw.iter().enumerate() {
                if let Some(v) = x {
                    assert_eq!(*v, k as f32);
                    seen += 1;
                }
            }
        }
        assert_eq!(seen, rewarded);
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
