//! The step's decisions (`rp_poll_*`, single and batched) and request/trainer events. Same
//! contract as `ffi`: status codes, `catch_unwind`, pointers null or valid.

use rolloutpipe_core::{Allocated, Allocation, PilotCommit, PolicyVersion, Tick, Vigor};

use crate::ffi::*;
use crate::types::*;

macro_rules! body {
    ($s:ident, $h:ident => $e:expr) => {
        guard(|| {
            let $h = unsafe { handle($s)? };
            $e
        })
    };
}

/// The next request to start: `RP_OK` with `*out`, or `RP_EMPTY`.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_admit(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpAdmission,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        match h.with(|s| s.poll_admit(Tick(now))) {
            Some(a) => unsafe {
                put(out, RpAdmission { request: id_to_c(a.request), version: a.version.0 }, "out")
            },
            None => Ok(RP_EMPTY),
        }
    })
}

/// Up to `cap` admissions into `out`; their count into `*n` (`RP_OK` even when 0).
///
/// # Safety
/// See the `ffi` module; `out` is valid for `cap` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_admit_batch(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpAdmission,
    cap: usize,
    n: *mut usize,
) -> RpStatus {
    body!(s, h => {
        check_out(out, cap, n)?;
        let mut buf = vec![rolloutpipe_core::Admission { request: Default::default(), version: PolicyVersion(0) }; cap.min(h.capacity().1)];
        let k = h.with(|s| s.poll_admit_into(Tick(now), &mut buf));
        let items: Vec<RpAdmission> = buf[..k].iter().map(|a| RpAdmission { request: id_to_c(a.request), version: a.version.0 }).collect();
        unsafe { copy_out(&items, out, n) }
    })
}

/// The next request to abort: `RP_OK` with `*out`, or `RP_EMPTY`. Acknowledge it with
/// `rp_on_abort_acked` once the engine has dropped it.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_abort(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpRequestId,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        match h.with(|s| s.poll_abort(Tick(now))) {
            Some(r) => unsafe { put(out, id_to_c(r), "out") },
            None => Ok(RP_EMPTY),
        }
    })
}

/// Up to `cap` aborts into `out`; their count into `*n`.
///
/// # Safety
/// See the `ffi` module; `out` is valid for `cap` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_abort_batch(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpRequestId,
    cap: usize,
    n: *mut usize,
) -> RpStatus {
    body!(s, h => {
        check_out(out, cap, n)?;
        let mut buf = vec![rolloutpipe_core::RequestId::default(); cap.min(h.capacity().1)];
        let k = h.with(|s| s.poll_abort_into(Tick(now), &mut buf));
        let items: Vec<RpRequestId> = buf[..k].iter().map(|r| id_to_c(*r)).collect();
        unsafe { copy_out(&items, out, n) }
    })
}

/// The next group for the trainer: `RP_OK` with `*out`, or `RP_EMPTY`.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_dispatch(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpDispatch,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        match h.with(|s| s.poll_dispatch(Tick(now))) {
            Some(d) => unsafe { put(out, RpDispatch { group: d.group.0, seq: d.seq }, "out") },
            None => Ok(RP_EMPTY),
        }
    })
}

/// Up to `cap` dispatches into `out`; their count into `*n`.
///
/// # Safety
/// See the `ffi` module; `out` is valid for `cap` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_dispatch_batch(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpDispatch,
    cap: usize,
    n: *mut usize,
) -> RpStatus {
    body!(s, h => {
        check_out(out, cap, n)?;
        let mut buf = vec![rolloutpipe_core::Dispatch { group: Default::default(), seq: 0 }; cap.min(h.capacity().1)];
        let k = h.with(|s| s.poll_dispatch_into(Tick(now), &mut buf));
        let items: Vec<RpDispatch> = buf[..k].iter().map(|d| RpDispatch { group: d.group.0, seq: d.seq }).collect();
        unsafe { copy_out(&items, out, n) }
    })
}

/// The next micro-batch to train: `RP_OK` with `*out`, or `RP_EMPTY`.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_micro_batch(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpMicroBatch,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        match h.with(|s| s.poll_micro_batch(Tick(now))) {
            Some(m) => unsafe { put(out, mb_to_c(m), "out") },
            None => Ok(RP_EMPTY),
        }
    })
}

/// The due optimizer step: `RP_OK` with its index in `*index`, or `RP_EMPTY`.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_optimizer_step(
    s: *mut RpScheduler,
    now: u64,
    index: *mut u32,
) -> RpStatus {
    body!(s, h => {
        if index.is_null() {
            return Err((RP_ERR_NULL, "index is null".into()));
        }
        match h.with(|s| s.poll_optimizer_step(Tick(now))) {
            Some(o) => unsafe { put(index, o.index, "index") },
            None => Ok(RP_EMPTY),
        }
    })
}

/// The next held group's allocation under the default policy (fixed G): `RP_OK` with `*out`,
/// or `RP_EMPTY`.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_allocation(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpAllocated,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        put_allocated(out, h.with(|s| s.poll_allocation(Tick(now))))
    })
}

/// The next held group's allocation under `policy` (fixed G, VIGOR or Pilot-Commit):
/// `RP_OK` with `*out`, or `RP_EMPTY`. Bad parameters are `RP_ERR_ALLOC_PARAM`, whose message
/// names the parameter; nothing changes then.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_allocation_with(
    s: *mut RpScheduler,
    now: u64,
    policy: *const RpAllocPolicy,
    out: *mut RpAllocated,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() || policy.is_null() {
            let what = if out.is_null() { "out" } else { "policy" };
            return Err((RP_ERR_NULL, format!("{what} is null")));
        }
        // SAFETY: non-null and, by the module's contract, valid for reads.
        let now = Tick(now);
        let a = match policy_from_c(unsafe { &*policy })? {
            CPolicy::Fixed => h.with(|s| s.poll_allocation(now)),
            CPolicy::Vigor(v) => h.with(|s| s.poll_allocation_with(now, &v)),
            CPolicy::PilotCommit(pc) => h.with(|s| s.poll_allocation_with(now, &pc)),
        };
        put_allocated(out, a)
    })
}

/// Configures `plan` for `policy`, as the core's `configure` does: VIGOR sets the group size to
/// `n0`, the step's sample budget and holds scored groups; Pilot-Commit sets the group size to
/// `n_pilot`, holds scored groups and reserves `n_commit` of the budget for each drawn prompt's
/// commit (`commit_reserve`); fixed G leaves the plan as it is. Bad parameters are
/// `RP_ERR_ALLOC_PARAM` and leave `plan` untouched.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_plan_apply_policy(
    policy: *const RpAllocPolicy,
    plan: *mut RpPlan,
) -> RpStatus {
    guard(|| {
        if policy.is_null() || plan.is_null() {
            let what = if plan.is_null() { "plan" } else { "policy" };
            return Err((RP_ERR_NULL, format!("{what} is null")));
        }
        // SAFETY: both non-null and valid by the module's contract.
        let (p, c) = unsafe { (&*policy, &mut *plan) };
        let mut core_plan = plan_from_c(c).map_err(|m| (RP_ERR_ARG, m))?;
        match policy_from_c(p)? {
            CPolicy::Fixed => {}
            CPolicy::Vigor(v) => v.configure(&mut core_plan),
            CPolicy::PilotCommit(pc) => pc.configure(&mut core_plan),
        }
        *c = plan_to_c(&core_plan);
        Ok(RP_OK)
    })
}

enum CPolicy {
    Fixed,
    Vigor(Vigor),
    PilotCommit(PilotCommit),
}

fn policy_from_c(p: &RpAllocPolicy) -> Result<CPolicy, (RpStatus, String)> {
    Ok(match p.kind {
        RP_POLICY_FIXED => CPolicy::Fixed,
        RP_POLICY_VIGOR => CPolicy::Vigor(
            Vigor::new(p.n0, p.rounds, p.increment, p.budget, p.batch_groups)
                .map_err(err(RP_ERR_ALLOC_PARAM))?,
        ),
        RP_POLICY_PILOT_COMMIT => CPolicy::PilotCommit(
            PilotCommit::new(p.n_pilot, p.n_commit, p.lower, p.upper)
                .map_err(err(RP_ERR_ALLOC_PARAM))?,
        ),
        k => {
            return Err((
                RP_ERR_ALLOC_PARAM,
                format!(
                    "RpAllocPolicy.kind: unknown code {k} (RP_POLICY_FIXED, RP_POLICY_VIGOR or RP_POLICY_PILOT_COMMIT)"
                ),
            ));
        }
    })
}

fn put_allocated(out: *mut RpAllocated, a: Option<Allocated>) -> Res {
    match a {
        Some(a) => {
            let mut c = RpAllocated {
                group: a.group.0,
                ..Default::default()
            };
            match a.applied {
                Allocation::Extend(k) => (c.applied, c.extra) = (RP_ALLOC_EXTEND, k),
                Allocation::Skip(r) => (c.applied, c.skip_reason) = (RP_ALLOC_SKIP, skip_code(r)),
                _ => c.applied = RP_ALLOC_COMMIT,
            }
            // SAFETY: the callers checked `out` is non-null; valid for writes by contract.
            unsafe { put(out, c, "out") }
        }
        None => Ok(RP_EMPTY),
    }
}

/// The step's summary once it is done: `RP_OK` with `*out`, or `RP_EMPTY`.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_step_done(
    s: *mut RpScheduler,
    out: *mut RpStepSummary,
) -> RpStatus {
    body!(s, h => {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        match h.with(|s| s.poll_step_done()) {
            Some(sum) => unsafe { put(out, summary_to_c(&sum), "out") },
            None => Ok(RP_EMPTY),
        }
    })
}

/// A request finished with `tokens` generated and its reward; `*out` (optional) says what it did.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_request_finished(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
    version: u64,
    tokens: u32,
    reward: f32,
    out: *mut RpCompletion,
) -> RpStatus {
    body!(s, h => {
        let c = h
            .with(|s| s.on_request_finished(Tick(now), id_from_c(id), PolicyVersion(version), tokens, reward))
            .map_err(err(RP_ERR_REQUEST))?;
        unsafe { put_opt(out, completion_to_c(c)) };
        Ok(RP_OK)
    })
}

/// A request's response was generated (its reward follows with `rp_on_reward`).
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_request_generated(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
    version: u64,
    tokens: u32,
    out: *mut RpCompletion,
) -> RpStatus {
    body!(s, h => {
        let c = h
            .with(|s| s.on_request_generated(Tick(now), id_from_c(id), PolicyVersion(version), tokens))
            .map_err(err(RP_ERR_REQUEST))?;
        unsafe { put_opt(out, completion_to_c(c)) };
        Ok(RP_OK)
    })
}

/// A generated response's reward.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_reward(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
    reward: f32,
    out: *mut RpCompletion,
) -> RpStatus {
    body!(s, h => {
        let c = h
            .with(|s| s.on_reward(Tick(now), id_from_c(id), reward))
            .map_err(err(RP_ERR_REQUEST))?;
        unsafe { put_opt(out, completion_to_c(c)) };
        Ok(RP_OK)
    })
}

/// A request failed; `*out` (optional) says whether it was retried.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_request_failed(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
    version: u64,
    out: *mut RpFailure,
) -> RpStatus {
    body!(s, h => {
        let f = h
            .with(|s| s.on_request_failed(Tick(now), id_from_c(id), PolicyVersion(version)))
            .map_err(err(RP_ERR_REQUEST))?;
        unsafe { put_opt(out, failure_to_c(f)) };
        Ok(RP_OK)
    })
}

/// An engine refused an admitted request (full); it is re-queued without burning an attempt.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_admission_refused(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
    out: *mut RpFailure,
) -> RpStatus {
    body!(s, h => {
        let f = h
            .with(|s| s.on_admission_refused(Tick(now), id_from_c(id)))
            .map_err(err(RP_ERR_REQUEST))?;
        unsafe { put_opt(out, failure_to_c(f)) };
        Ok(RP_OK)
    })
}

/// A running request was preempted or migrated; it is re-queued without burning an attempt.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_request_preempted(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
    out: *mut RpFailure,
) -> RpStatus {
    body!(s, h => {
        let f = h
            .with(|s| s.on_request_preempted(Tick(now), id_from_c(id)))
            .map_err(err(RP_ERR_REQUEST))?;
        unsafe { put_opt(out, failure_to_c(f)) };
        Ok(RP_OK)
    })
}

/// An abort named by `rp_poll_abort` was carried out.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_abort_acked(
    s: *mut RpScheduler,
    now: u64,
    id: RpRequestId,
) -> RpStatus {
    body!(s, h => {
        h.with(|s| s.on_abort_acked(Tick(now), id_from_c(id)))
            .map_err(err(RP_ERR_REQUEST))?;
        Ok(RP_OK)
    })
}

/// The released micro-batch was trained; `*out` (optional) is the one consumed.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_micro_batch_consumed(
    s: *mut RpScheduler,
    now: u64,
    out: *mut RpMicroBatch,
) -> RpStatus {
    body!(s, h => {
        let m = h
            .with(|s| s.on_micro_batch_consumed(Tick(now)))
            .map_err(err(RP_ERR_TRAIN))?;
        unsafe { put_opt(out, mb_to_c(m)) };
        Ok(RP_OK)
    })
}

/// The due optimizer step was applied.
///
/// # Safety
/// See the `ffi` module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_optimizer_step_done(s: *mut RpScheduler, now: u64) -> RpStatus {
    body!(s, h => {
        h.with(|s| s.on_optimizer_step_done(Tick(now)))
            .map_err(err(RP_ERR_TRAIN))?;
        Ok(RP_OK)
    })
}

fn mb_to_c(m: rolloutpipe_core::MicroBatch) -> RpMicroBatch {
    RpMicroBatch {
        index: m.index,
        first_seq: m.first_seq,
        len: m.len,
        ends_optimizer_step: m.ends_optimizer_step,
    }
}

/// Refuses null out-pointers before a batch poll runs: a poll hands its decisions out once, so
/// they must have somewhere to go.
fn check_out<T>(out: *mut T, cap: usize, n: *mut usize) -> Result<(), (RpStatus, String)> {
    if n.is_null() {
        return Err((RP_ERR_NULL, "n is null".into()));
    }
    if out.is_null() && cap > 0 {
        return Err((RP_ERR_NULL, "out is null".into()));
    }
    Ok(())
}

/// # Safety
/// `out` is valid for `items.len()` entries (or null when empty); `n` null or writable.
unsafe fn copy_out<T: Copy>(
    items: &[T],
    out: *mut T,
    n: *mut usize,
) -> Result<RpStatus, (RpStatus, String)> {
    if n.is_null() {
        return Err((RP_ERR_NULL, "n is null".into()));
    }
    if !items.is_empty() {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        // SAFETY: the items came from a buffer of the caller's `cap`, so `out` has room.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), out, items.len()) };
    }
    unsafe { put(n, items.len(), "n") }
}
