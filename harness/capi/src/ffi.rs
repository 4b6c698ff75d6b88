//! The `extern "C"` functions. Every function returns an [`RpStatus`]: `RP_OK`, `RP_EMPTY` (a poll
//! with no decision), or a negative error code whose message `rp_last_error_message` copies out.
//! A core error changes nothing (the core validates before it mutates). No panic crosses the
//! boundary: each body runs under `catch_unwind`, and a caught panic is `RP_ERR_PANIC`.
//!
//! # Safety (all functions)
//! Pointer arguments are either null (reported as `RP_ERR_NULL`, or skipped where the header
//! says an out-parameter is optional) or valid for the access the header describes; a
//! scheduler handle comes from `rp_scheduler_new` or `rp_scheduler_new_in`, is not yet freed, and is used by one thread
//! at a time.

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};

use rolloutpipe_core::{GroupId, Plan, PolicyVersion, StepId, Tick};

use crate::HeapScheduler;
use crate::types::*;

/// A status code: `RP_OK`, `RP_EMPTY`, or a negative `RP_ERR_*`.
pub type RpStatus = i32;

/// The call did what was asked (a poll wrote a decision).
pub const RP_OK: RpStatus = 0;
/// A poll had no decision to make; nothing was written.
pub const RP_EMPTY: RpStatus = 1;
/// A required pointer was null.
pub const RP_ERR_NULL: RpStatus = -1;
/// An argument was malformed (an unknown enum code, a capacity too large).
pub const RP_ERR_ARG: RpStatus = -2;
/// `begin_step` refused (step in progress, stale step id, or an invalid plan).
pub const RP_ERR_BEGIN: RpStatus = -3;
/// A draw was refused.
pub const RP_ERR_DRAW: RpStatus = -4;
/// A request event was refused (unknown, stale, duplicate, wrong version, other step).
pub const RP_ERR_REQUEST: RpStatus = -5;
/// A trainer event was refused.
pub const RP_ERR_TRAIN: RpStatus = -6;
/// `rp_extend_group` was refused.
pub const RP_ERR_EXTEND: RpStatus = -7;
/// `rp_set_slots` was refused.
pub const RP_ERR_SLOTS: RpStatus = -8;
/// `rp_audit` found a broken invariant.
pub const RP_ERR_AUDIT: RpStatus = -9;
/// An internal panic was caught (a bug); the handle's step state was reset to idle.
pub const RP_ERR_PANIC: RpStatus = -10;

/// An allocation policy's parameters were refused (`rp_poll_allocation_with`), or its kind is
/// unknown.
pub const RP_ERR_ALLOC_PARAM: RpStatus = -11;

/// The C ABI's version: bumped whenever a signature, struct layout or code changes meaning.
pub const RP_ABI_VERSION: u32 = 2;

/// An opaque scheduler handle: library-owned storage (`rp_scheduler_new`) or placed in caller
/// memory (`rp_scheduler_new_in`; the second field says so).
pub struct RpScheduler(HeapScheduler, bool);

pub(crate) type Res = Result<RpStatus, (RpStatus, String)>;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

pub(crate) fn guard(f: impl FnOnce() -> Res) -> RpStatus {
    let (code, msg) = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(code)) => return code,
        Ok(Err(e)) => e,
        Err(_) => (
            RP_ERR_PANIC,
            "internal panic (a rolloutpipe bug); the step state was reset".to_string(),
        ),
    };
    LAST_ERROR.with(|l| *l.borrow_mut() = msg);
    code
}

pub(crate) fn err<E: std::fmt::Display>(code: RpStatus) -> impl FnOnce(E) -> (RpStatus, String) {
    move |e| (code, e.to_string())
}

/// # Safety
/// See the module: `p` is null or a live handle.
pub(crate) unsafe fn handle<'a>(
    p: *mut RpScheduler,
) -> Result<&'a mut HeapScheduler, (RpStatus, String)> {
    // SAFETY: the caller passes null or a live, unaliased handle.
    match unsafe { p.as_mut() } {
        Some(h) => Ok(&mut h.0),
        None => Err((RP_ERR_NULL, "scheduler handle is null".into())),
    }
}

/// # Safety
/// `p` is null or valid for writes of a `T`.
pub(crate) unsafe fn put<T>(p: *mut T, v: T, name: &str) -> Res {
    if p.is_null() {
        return Err((RP_ERR_NULL, format!("{name} is null")));
    }
    // SAFETY: non-null and, by the caller's contract, valid for writes.
    unsafe { p.write(v) };
    Ok(RP_OK)
}

/// # Safety
/// `p` is null (then nothing is written) or valid for writes of a `T`.
pub(crate) unsafe fn put_opt<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: as above.
        unsafe { p.write(v) };
    }
}

/// The ABI version the library was built with; compare it with `RP_ABI_VERSION` from the header.
#[unsafe(no_mangle)]
pub extern "C" fn rp_abi_version() -> u32 {
    RP_ABI_VERSION
}

/// Copies the calling thread's last error message (NUL-terminated, truncated to fit) into
/// `buf` of `len` bytes; returns the message's full length in bytes, without the NUL.
///
/// # Safety
/// `buf` is null (only the length is returned) or valid for `len` bytes of writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_last_error_message(buf: *mut c_char, len: usize) -> usize {
    LAST_ERROR.with(|l| {
        let msg = l.borrow();
        if !buf.is_null() && len > 0 {
            let n = msg.len().min(len - 1);
            // SAFETY: `buf` is valid for `len > n` bytes; the source is a live String.
            unsafe {
                std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        msg.len()
    })
}

/// Fills `out` with the core's default plan for B groups of G samples.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_plan_default(
    batch_groups: u32,
    group_size: u16,
    out: *mut RpPlan,
) -> RpStatus {
    guard(|| unsafe { put(out, plan_to_c(&Plan::new(batch_groups, group_size)), "out") })
}

/// Creates a scheduler owning `groups` group slots and `requests` request slots (library-owned
/// storage, freed by `rp_scheduler_free`) and stores the handle in `*out`.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_scheduler_new(
    groups: usize,
    requests: usize,
    out: *mut *mut RpScheduler,
) -> RpStatus {
    guard(|| {
        if out.is_null() {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        check_capacity(groups, requests)?;
        let h = Box::into_raw(Box::new(RpScheduler(
            HeapScheduler::new(groups, requests),
            false,
        )));
        unsafe { put(out, h, "out") }
    })
}

/// The core indexes at most 2^24 groups and u32::MAX - 1 requests; refuse what it would
/// silently ignore.
fn check_capacity(groups: usize, requests: usize) -> Result<(), (RpStatus, String)> {
    if groups > 1 << 24 || requests >= u32::MAX as usize {
        return Err((
            RP_ERR_ARG,
            format!("capacity {groups} groups / {requests} requests exceeds 2^24 / 2^32 - 2"),
        ));
    }
    Ok(())
}

/// Bytes `rp_scheduler_new_in` needs for `groups` group slots and `requests` request slots
/// (the handle included, at any alignment of the memory); 0 when the capacity is refused.
#[unsafe(no_mangle)]
pub extern "C" fn rp_scheduler_storage_size(groups: usize, requests: usize) -> usize {
    if check_capacity(groups, requests).is_err() {
        return 0;
    }
    HeapScheduler::storage_bytes(groups, requests)
        .and_then(|b| b.checked_add(size_of::<RpScheduler>() + align_of::<RpScheduler>() - 1))
        .unwrap_or(0)
}

/// Creates a scheduler whose handle and slots live in `mem` (`bytes` long, any alignment;
/// `rp_scheduler_storage_size` says how much): caller-owned storage, so the scheduler allocates
/// nothing. `rp_scheduler_free` ends it without freeing `mem`; the caller frees `mem` after.
///
/// # Safety
/// See the module; `mem` is valid for reads and writes of `bytes` bytes, not otherwise accessed
/// until `rp_scheduler_free`, and outlives the handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_scheduler_new_in(
    mem: *mut std::ffi::c_void,
    bytes: usize,
    groups: usize,
    requests: usize,
    out: *mut *mut RpScheduler,
) -> RpStatus {
    guard(|| {
        if out.is_null() || mem.is_null() {
            let what = if out.is_null() { "out" } else { "mem" };
            return Err((RP_ERR_NULL, format!("{what} is null")));
        }
        check_capacity(groups, requests)?;
        let need = rp_scheduler_storage_size(groups, requests);
        if need == 0 || bytes < need {
            return Err((
                RP_ERR_ARG,
                format!("mem has {bytes} bytes; {groups} groups / {requests} requests need {need}"),
            ));
        }
        let mem = mem.cast::<u8>();
        let at = mem.align_offset(align_of::<RpScheduler>());
        let slots_at = at + size_of::<RpScheduler>();
        // SAFETY: `need` counts the handle, its alignment slack and the slots, so every offset
        // below stays inside `mem`; the caller's contract gives us the memory exclusively.
        unsafe {
            let inner =
                HeapScheduler::new_in(mem.add(slots_at), bytes - slots_at, groups, requests)
                    .ok_or((RP_ERR_ARG, "mem is too short for the slots".to_string()))?;
            let h = mem.add(at).cast::<RpScheduler>();
            h.write(RpScheduler(inner, true));
            put(out, h, "out")
        }
    })
}

/// Ends a scheduler. Library-owned storage (`rp_scheduler_new`) is freed; caller-owned memory
/// (`rp_scheduler_new_in`) is left to the caller. Null is a no-op.
///
/// # Safety
/// `s` is null or a live handle, not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_scheduler_free(s: *mut RpScheduler) {
    if s.is_null() {
        return;
    }
    // SAFETY: a live handle by contract; the flag says where it came from.
    unsafe {
        if (*s).1 {
            std::ptr::drop_in_place(s); // placed by `rp_scheduler_new_in`
        } else {
            drop(Box::from_raw(s)); // from `Box::into_raw` in `rp_scheduler_new`
        }
    }
}

/// Begins a step with `plan` (see the core's `begin_step`).
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_begin_step(
    s: *mut RpScheduler,
    now: u64,
    step: u64,
    version: u64,
    plan: *const RpPlan,
) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        // SAFETY: null or valid for reads, by contract.
        let plan = unsafe { plan.as_ref() }.ok_or((RP_ERR_NULL, "plan is null".into()))?;
        let plan = plan_from_c(plan).map_err(|m| (RP_ERR_ARG, m))?;
        h.with(|s| s.begin_step(Tick(now), StepId(step), PolicyVersion(version), plan))
            .map_err(err(RP_ERR_BEGIN))?;
        Ok(RP_OK)
    })
}

/// How many prompts to draw now: `RP_OK` with `*n`, or `RP_EMPTY`.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_poll_draw(s: *mut RpScheduler, now: u64, n: *mut u32) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        if n.is_null() {
            return Err((RP_ERR_NULL, "n is null".into()));
        }
        match h.with(|s| s.poll_draw(Tick(now))) {
            Some(v) => unsafe { put(n, v, "n") },
            None => Ok(RP_EMPTY),
        }
    })
}

/// Reports `n` prompts drawn with `samples` initial samples each (0: the plan's G); the first
/// new group's id goes to `*first_group` (optional).
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_prompts_drawn(
    s: *mut RpScheduler,
    now: u64,
    n: u32,
    samples: u16,
    first_group: *mut u32,
) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        let g = h
            .with(|s| match samples {
                0 => s.on_prompts_drawn(Tick(now), n),
                k => s.on_prompts_drawn_with(Tick(now), n, k),
            })
            .map_err(err(RP_ERR_DRAW))?;
        unsafe { put_opt(first_group, g.0) };
        Ok(RP_OK)
    })
}

/// Reports that the data source has no more prompts.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_on_data_exhausted(s: *mut RpScheduler, now: u64) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        h.with(|s| s.on_data_exhausted(Tick(now)))
            .map_err(err(RP_ERR_DRAW))?;
        Ok(RP_OK)
    })
}

/// Extends a group by `extra` samples.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_extend_group(
    s: *mut RpScheduler,
    now: u64,
    group: u32,
    extra: u16,
) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        h.with(|s| s.extend_group(Tick(now), GroupId(group), extra))
            .map_err(err(RP_ERR_EXTEND))?;
        Ok(RP_OK)
    })
}

/// Changes the rollout slots mid-step.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_set_slots(s: *mut RpScheduler, now: u64, slots: u32) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        h.with(|s| s.set_slots(Tick(now), slots))
            .map_err(err(RP_ERR_SLOTS))?;
        Ok(RP_OK)
    })
}

/// Copies the step's counters into `*out`.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_counters(s: *mut RpScheduler, out: *mut RpCounters) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        let c = h.with(|s| counters_to_c(s.counters()));
        unsafe { put(out, c, "out") }
    })
}

/// Re-derives every count from storage: `RP_OK`, or `RP_ERR_AUDIT` with the broken invariant.
///
/// # Safety
/// See the module.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_audit(s: *mut RpScheduler) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        h.with(|s| s.audit()).map_err(err(RP_ERR_AUDIT))?;
        Ok(RP_OK)
    })
}

/// Copies up to `cap` rewards of a group's samples into `out` (NaN for a sample without a
/// reward yet) and its sample count into `*n` (which may exceed `cap`).
///
/// # Safety
/// See the module; `out` is valid for `cap` floats (or null with `cap == 0`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rp_group_rewards(
    s: *mut RpScheduler,
    group: u32,
    out: *mut f32,
    cap: usize,
    n: *mut usize,
) -> RpStatus {
    guard(|| {
        let h = unsafe { handle(s)? };
        if out.is_null() && cap > 0 {
            return Err((RP_ERR_NULL, "out is null".into()));
        }
        let count = h
            .with(|s| {
                let rewards = s.group_rewards(GroupId(group))?;
                let mut count = 0usize;
                for (i, r) in rewards.enumerate() {
                    if i < cap {
                        // SAFETY: `i < cap` and `out` is valid for `cap` floats.
                        unsafe { out.add(i).write(r.unwrap_or(f32::NAN)) };
                    }
                    count += 1;
                }
                Some(count)
            })
            .ok_or((RP_ERR_ARG, format!("g{group} was not drawn in this step")))?;
        unsafe { put(n, count, "n") }
    })
}
