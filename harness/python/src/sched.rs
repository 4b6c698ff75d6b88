//! `rolloutpipe.Scheduler`: the core's scheduler with library-owned storage sized at creation.
//! Every event and decision of the core, under the same names; each refusal raises that
//! operation's exception class and changes nothing. The core's calls take nanoseconds, so the
//! GIL is kept (releasing it would cost more than the call).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rolloutpipe_capi::HeapScheduler;
use rolloutpipe_core::{GroupId, PolicyVersion, StepId, Tick};

use crate::errors::{
    AuditError, DrawError, ExtendError, RequestError, SlotsError, TrainError, begin_error, raise,
};
use crate::plan::{FixedG, PilotCommit, Plan, Vigor};
use crate::values::*;

/// The scheduling core with its own storage: `groups` group slots (one per prompt a step may
/// draw) and `requests` request slots (one per sample, extensions included).
///
/// The protocol: `begin_step`; then loop `poll_draw` → `on_prompts_drawn`; `poll_admit` → start
/// the request; `on_request_finished` (or `on_request_generated` + `on_reward`) /
/// `on_request_failed`; `poll_abort` → `on_abort_acked`; `poll_dispatch` → trainer;
/// `poll_micro_batch` → train → `on_micro_batch_consumed`; `poll_optimizer_step` →
/// `on_optimizer_step_done`; until `poll_step_done` returns the summary.
#[pyclass(module = "rolloutpipe")]
pub struct Scheduler(HeapScheduler);

fn id(r: &RequestId) -> rolloutpipe_core::RequestId {
    r.core()
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (groups, requests))]
    fn new(groups: usize, requests: usize) -> PyResult<Self> {
        if groups > 1 << 24 || requests >= u32::MAX as usize {
            return Err(PyValueError::new_err(format!(
                "capacity {groups} groups / {requests} requests exceeds 2^24 / 2^32 - 2"
            )));
        }
        Ok(Scheduler(HeapScheduler::new(groups, requests)))
    }

    /// (group slots, request slots) the core uses.
    #[getter]
    fn capacity(&mut self) -> (u32, u32) {
        self.0.with(|s| s.capacity())
    }

    /// `"idle"`, `"active"` or `"done"`.
    #[getter]
    fn phase(&mut self) -> String {
        self.0.with(|s| format!("{:?}", s.phase()).to_lowercase())
    }

    /// (step, policy version) of the current or last step, or None.
    #[getter]
    fn step(&mut self) -> Option<(u64, u64)> {
        self.0.with(|s| s.step().map(|(st, v)| (st.0, v.0)))
    }

    /// The current step's plan, or None.
    #[getter]
    fn plan(&mut self) -> Option<Plan> {
        self.0.with(|s| s.plan().map(Plan::from))
    }

    /// The step's counters.
    #[getter]
    fn counters(&mut self) -> Counters {
        self.0.with(|s| s.counters().into())
    }

    /// Requests holding a rollout slot.
    #[getter]
    fn slots_in_use(&mut self) -> u32 {
        self.0.with(|s| s.slots_in_use())
    }

    /// The batch is final (B trainable groups, or short).
    #[getter]
    fn is_batch_final(&mut self) -> bool {
        self.0.with(|s| s.is_batch_final())
    }

    /// An optimizer step is due.
    #[getter]
    fn optimizer_step_due(&mut self) -> bool {
        self.0.with(|s| s.optimizer_step_due())
    }

    /// Optimizer steps applied in this step.
    #[getter]
    fn optimizer_steps_done(&mut self) -> u32 {
        self.0.with(|s| s.optimizer_steps_done())
    }

    /// Begins a step. Raises `BeginError` (a step in progress, a stale id) or its subclass
    /// `PlanError` (an invalid plan, or one that does not fit the storage).
    fn begin_step(
        &mut self,
        py: Python<'_>,
        now: u64,
        step: u64,
        version: u64,
        plan: &Plan,
    ) -> PyResult<()> {
        let plan = plan.to_core()?;
        self.0
            .with(|s| s.begin_step(Tick(now), StepId(step), PolicyVersion(version), plan))
            .map_err(|e| begin_error(py, e))
    }

    /// How many prompts to draw now, or None.
    fn poll_draw(&mut self, now: u64) -> Option<u32> {
        self.0.with(|s| s.poll_draw(Tick(now)))
    }

    /// Reports `n` prompts drawn (with `samples` initial samples each, default G); returns the
    /// first new group's id. Raises `DrawError`.
    #[pyo3(signature = (now, n, samples = None))]
    fn on_prompts_drawn(
        &mut self,
        py: Python<'_>,
        now: u64,
        n: u32,
        samples: Option<u16>,
    ) -> PyResult<u32> {
        self.0
            .with(|s| match samples {
                None => s.on_prompts_drawn(Tick(now), n),
                Some(k) => s.on_prompts_drawn_with(Tick(now), n, k),
            })
            .map(|g| g.0)
            .map_err(|e| raise::<DrawError>(py, e))
    }

    /// Reports that the data source is exhausted. Raises `DrawError`.
    fn on_data_exhausted(&mut self, py: Python<'_>, now: u64) -> PyResult<()> {
        self.0
            .with(|s| s.on_data_exhausted(Tick(now)))
            .map_err(|e| raise::<DrawError>(py, e))
    }

    /// Extends a group by `extra` samples. Raises `ExtendError`.
    fn extend_group(&mut self, py: Python<'_>, now: u64, group: u32, extra: u16) -> PyResult<()> {
        self.0
            .with(|s| s.extend_group(Tick(now), GroupId(group), extra))
            .map_err(|e| raise::<ExtendError>(py, e))
    }

    /// The next request to start, or None.
    fn poll_admit(&mut self, now: u64) -> Option<Admission> {
        self.0
            .with(|s| s.poll_admit(Tick(now)))
            .map(Admission::from)
    }

    /// Up to `max` requests to start, in admission order (one call instead of `max`).
    fn poll_admit_batch(&mut self, now: u64, max: usize) -> Vec<Admission> {
        let mut buf = vec![
            rolloutpipe_core::Admission {
                request: Default::default(),
                version: PolicyVersion(0)
            };
            max.min(1 << 20)
        ];
        let n = self.0.with(|s| s.poll_admit_into(Tick(now), &mut buf));
        buf[..n].iter().map(|a| Admission::from(*a)).collect()
    }

    /// The next request to abort, or None; acknowledge with `on_abort_acked`.
    fn poll_abort(&mut self, now: u64) -> Option<RequestId> {
        self.0
            .with(|s| s.poll_abort(Tick(now)))
            .map(RequestId::from)
    }

    /// Up to `max` requests to abort.
    fn poll_abort_batch(&mut self, now: u64, max: usize) -> Vec<RequestId> {
        let mut buf = vec![rolloutpipe_core::RequestId::default(); max.min(1 << 20)];
        let n = self.0.with(|s| s.poll_abort_into(Tick(now), &mut buf));
        buf[..n].iter().map(|r| RequestId::from(*r)).collect()
    }

    /// The next trainable group for the trainer, or None.
    fn poll_dispatch(&mut self, now: u64) -> Option<Dispatch> {
        self.0
            .with(|s| s.poll_dispatch(Tick(now)))
            .map(Dispatch::from)
    }

    /// Up to `max` groups for the trainer.
    fn poll_dispatch_batch(&mut self, now: u64, max: usize) -> Vec<Dispatch> {
        let mut buf = vec![
            rolloutpipe_core::Dispatch {
                group: GroupId(0),
                seq: 0
            };
            max.min(1 << 20)
        ];
        let n = self.0.with(|s| s.poll_dispatch_into(Tick(now), &mut buf));
        buf[..n].iter().map(|d| Dispatch::from(*d)).collect()
    }

    /// The next micro-batch to train, or None.
    fn poll_micro_batch(&mut self, now: u64) -> Option<MicroBatch> {
        self.0
            .with(|s| s.poll_micro_batch(Tick(now)))
            .map(MicroBatch::from)
    }

    /// The due optimizer step's index, or None.
    fn poll_optimizer_step(&mut self, now: u64) -> Option<u32> {
        self.0
            .with(|s| s.poll_optimizer_step(Tick(now)))
            .map(|o| o.index)
    }

    /// The next held group's allocation under `policy` (`FixedG` when None, `Vigor`,
    /// `PilotCommit`), or None.
    #[pyo3(signature = (now, policy = None))]
    fn poll_allocation(
        &mut self,
        now: u64,
        policy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Allocated>> {
        let now = Tick(now);
        let a = match policy {
            None => self.0.with(|s| s.poll_allocation(now)),
            Some(p) => {
                if let Ok(v) = p.cast::<Vigor>() {
                    let v = v.get().0;
                    self.0.with(|s| s.poll_allocation_with(now, &v))
                } else if let Ok(pc) = p.cast::<PilotCommit>() {
                    let pc = pc.get().0;
                    self.0.with(|s| s.poll_allocation_with(now, &pc))
                } else if p.cast::<FixedG>().is_ok() {
                    self.0.with(|s| s.poll_allocation(now))
                } else {
                    return Err(PyValueError::new_err(
                        "policy must be FixedG, Vigor or PilotCommit",
                    ));
                }
            }
        };
        Ok(a.map(Allocated::from))
    }

    /// The step's summary once it is done, or None.
    fn poll_step_done(&mut self) -> Option<StepSummary> {
        self.0.with(|s| s.poll_step_done()).map(StepSummary::from)
    }

    /// The summary so far (None before the first step).
    fn summary(&mut self) -> Option<StepSummary> {
        self.0.with(|s| s.summary()).map(StepSummary::from)
    }

    /// A request finished: its response had `tokens` tokens and earned `reward`. Raises
    /// `RequestError` (unknown, stale attempt, duplicate, wrong version, other step).
    fn on_request_finished(
        &mut self,
        py: Python<'_>,
        now: u64,
        request: &RequestId,
        version: u64,
        tokens: u32,
        reward: f32,
    ) -> PyResult<Completion> {
        self.0
            .with(|s| {
                s.on_request_finished(
                    Tick(now),
                    id(request),
                    PolicyVersion(version),
                    tokens,
                    reward,
                )
            })
            .map(Completion::from)
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// A request's response was generated; its reward follows with `on_reward`.
    fn on_request_generated(
        &mut self,
        py: Python<'_>,
        now: u64,
        request: &RequestId,
        version: u64,
        tokens: u32,
    ) -> PyResult<Completion> {
        self.0
            .with(|s| {
                s.on_request_generated(Tick(now), id(request), PolicyVersion(version), tokens)
            })
            .map(Completion::from)
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// A generated response's reward.
    fn on_reward(
        &mut self,
        py: Python<'_>,
        now: u64,
        request: &RequestId,
        reward: f32,
    ) -> PyResult<Completion> {
        self.0
            .with(|s| s.on_reward(Tick(now), id(request), reward))
            .map(Completion::from)
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// A request failed (retried until the plan's `max_attempts`).
    fn on_request_failed(
        &mut self,
        py: Python<'_>,
        now: u64,
        request: &RequestId,
        version: u64,
    ) -> PyResult<Failure> {
        self.0
            .with(|s| s.on_request_failed(Tick(now), id(request), PolicyVersion(version)))
            .map(Failure::from)
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// An abort from `poll_abort` was carried out.
    fn on_abort_acked(&mut self, py: Python<'_>, now: u64, request: &RequestId) -> PyResult<()> {
        self.0
            .with(|s| s.on_abort_acked(Tick(now), id(request)))
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// An engine refused an admitted request (full): re-queued, no attempt burnt.
    fn on_admission_refused(
        &mut self,
        py: Python<'_>,
        now: u64,
        request: &RequestId,
    ) -> PyResult<Failure> {
        self.0
            .with(|s| s.on_admission_refused(Tick(now), id(request)))
            .map(Failure::from)
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// A running request was preempted or migrated: re-queued, no attempt burnt.
    fn on_request_preempted(
        &mut self,
        py: Python<'_>,
        now: u64,
        request: &RequestId,
    ) -> PyResult<Failure> {
        self.0
            .with(|s| s.on_request_preempted(Tick(now), id(request)))
            .map(Failure::from)
            .map_err(|e| raise::<RequestError>(py, e))
    }

    /// Changes the rollout slots mid-step (engines joined or left). Raises `SlotsError`.
    fn set_slots(&mut self, py: Python<'_>, now: u64, slots: u32) -> PyResult<()> {
        self.0
            .with(|s| s.set_slots(Tick(now), slots))
            .map_err(|e| raise::<SlotsError>(py, e))
    }

    /// The released micro-batch was trained; returns it. Raises `TrainError`.
    fn on_micro_batch_consumed(&mut self, py: Python<'_>, now: u64) -> PyResult<MicroBatch> {
        self.0
            .with(|s| s.on_micro_batch_consumed(Tick(now)))
            .map(MicroBatch::from)
            .map_err(|e| raise::<TrainError>(py, e))
    }

    /// The due optimizer step was applied. Raises `TrainError`.
    fn on_optimizer_step_done(&mut self, py: Python<'_>, now: u64) -> PyResult<()> {
        self.0
            .with(|s| s.on_optimizer_step_done(Tick(now)))
            .map_err(|e| raise::<TrainError>(py, e))
    }

    /// A snapshot of a group, or None if it was not drawn in this step.
    fn group(&mut self, group: u32) -> Option<GroupInfo> {
        self.0
            .with(|s| s.group(GroupId(group)))
            .map(GroupInfo::from)
    }

    /// A group's per-sample rewards (None for a sample without one yet), or None if unknown.
    /// Read them when the group is dispatched, to compute its advantages.
    fn group_rewards(&mut self, group: u32) -> Option<Vec<Option<f32>>> {
        self.0
            .with(|s| s.group_rewards(GroupId(group)).map(|it| it.collect()))
    }

    /// A group's per-sample token counts (None where not generated), or None if unknown.
    fn group_tokens(&mut self, group: u32) -> Option<Vec<Option<u32>>> {
        self.0
            .with(|s| s.group_tokens(GroupId(group)).map(|it| it.collect()))
    }

    /// (state, current attempt) of one sample's request, or None.
    fn request_state(&mut self, group: u32, sample: u16) -> Option<(String, u8)> {
        self.0
            .with(|s| s.request_state(GroupId(group), sample))
            .map(|(st, a)| (st.to_string(), a))
    }

    /// The group dispatched with sequence number `seq`, or None.
    fn dispatched_group(&mut self, seq: u32) -> Option<u32> {
        self.0.with(|s| s.dispatched_group(seq)).map(|g| g.0)
    }

    /// Re-derives every count from storage; raises `AuditError` naming a broken invariant.
    fn audit(&mut self, py: Python<'_>) -> PyResult<()> {
        self.0
            .with(|s| s.audit())
            .map_err(|e| raise::<AuditError>(py, e))
    }

    fn __repr__(&mut self) -> String {
        let (g, r) = self.0.capacity();
        format!(
            "Scheduler(groups={g}, requests={r}, phase={:?})",
            self.phase()
        )
    }
}
