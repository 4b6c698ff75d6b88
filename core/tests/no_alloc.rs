//! Proof that the core does not allocate: a counting global allocator, armed only on the test's
//! own thread, sees zero allocations across whole steps of 4,096 groups x 16 samples under both
//! admission and both dispatch policies (storage is allocated before counting starts).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use rolloutpipe_core::{
    AdmissionPolicy, DispatchPolicy, GroupSlot, PilotCommit, RequestSlot, Scheduler, SubmitOrder,
    Vigor,
};

#[allow(dead_code)]
#[path = "support/step.rs"]
mod step;

struct Counting;

thread_local! {
    // Const-initialized, so touching them never allocates (no lazy TLS registration). Both are
    // per thread: tests run in parallel and must not see each other's allocations.
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn note() {
    if ARMED.with(Cell::get) {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
    }
}

fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged;
// counting touches only const thread-locals, neither of which allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours; the caller upholds `layout`'s requirements.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: `ptr` was returned by this allocator (hence by `System`) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was returned by this allocator (hence by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn whole_steps_of_4096_groups_do_not_allocate() {
    const B: u32 = if cfg!(miri) { 16 } else { 4096 };
    let mut groups = vec![GroupSlot::EMPTY; 2 * B as usize];
    let mut requests = vec![RequestSlot::EMPTY; 2 * B as usize * 16];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let policies = [
        (
            AdmissionPolicy::Fifo {
                order: SubmitOrder::Interleaved,
            },
            DispatchPolicy::Sync,
        ),
        (
            AdmissionPolicy::Fifo {
                order: SubmitOrder::Shuffled { seed: 3 },
            },
            DispatchPolicy::Pipelined,
        ),
        (
            AdmissionPolicy::Frontier {
                width: 4,
                expected_filter_ppm: 200_000,
                fallback: SubmitOrder::Interleaved,
            },
            DispatchPolicy::Pipelined,
        ),
    ];
    let mut runs = [step::StepRun::default(); 3];
    ALLOCATIONS.with(|n| n.set(0));
    ARMED.with(|a| a.set(true));
    for (i, (admission, dispatch)) in policies.into_iter().enumerate() {
        let mut plan = step::plan(B);
        plan.admission = admission;
        plan.dispatch = dispatch;
        runs[i] = step::run_step(&mut s, i as u64, plan, 42 + i as u64);
    }
    ARMED.with(|a| a.set(false));
    assert_eq!(allocations(), 0, "the core allocated");
    for r in runs {
        assert_eq!(r.trained, B);
        // About a fifth of the completed groups are filtered and replaced.
        assert!(r.filtered > B / 8 && r.filtered < B / 2, "{r:?}");
        assert!(r.requests >= (B as u64 + r.filtered as u64) * 16, "{r:?}");
    }
    // The counter itself works: an allocation while armed is seen.
    ARMED.with(|a| a.set(true));
    let v = std::hint::black_box(vec![1u8; 16]);
    ARMED.with(|a| a.set(false));
    assert_eq!((v.len(), allocations()), (16, 1));
}

#[test]
fn vigor_and_pilot_commit_steps_do_not_allocate() {
    const B: u32 = if cfg!(miri) { 8 } else { 256 };
    let mut groups = vec![GroupSlot::EMPTY; 2 * B as usize];
    let mut requests = vec![RequestSlot::EMPTY; 2 * B as usize * 32];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let vigor = Vigor::new(8, 2, 8, 8 * B + 8 * B, B).unwrap();
    let pilot = PilotCommit::new(8, 8, 0.125, 0.25).unwrap();
    let mut vp = step::plan(B);
    vigor.configure(&mut vp);
    let mut pp = step::plan(B);
    pilot.configure(&mut pp);
    ALLOCATIONS.with(|n| n.set(0));
    ARMED.with(|a| a.set(true));
    let v = step::run_step_with(&mut s, 0, vp, 5, &vigor);
    let p = step::run_step_with(&mut s, 1, pp, 6, &pilot);
    ARMED.with(|a| a.set(false));
    assert_eq!(allocations(), 0, "the core allocated");
    // step::reward gives every varying group a mean of 1/2: VIGOR extends some, Pilot-Commit
    // keeps them all, and skips the all-correct ones as solved.
    assert_eq!((v.trained, p.trained), (B, B), "{v:?} {p:?}");
    assert!(p.filtered > 0, "{p:?}");
    assert!(
        v.requests > (B + v.filtered) as u64 * 8,
        "VIGOR extended nothing: {v:?}"
    );
}

#[test]
#[cfg_attr(
    miri,
    ignore = "72 MB of storage and a million requests: minutes under Miri"
)]
fn a_step_of_65536_groups_x_16_fits_without_allocating() {
    const B: u32 = 65_536;
    // Storage for the over-sampling cap (2B prompts), sized once by the caller.
    let mut groups = vec![GroupSlot::EMPTY; 2 * B as usize];
    let mut requests = vec![RequestSlot::EMPTY; 2 * B as usize * 16];
    let mut s = Scheduler::new(&mut groups, &mut requests);
    let mut plan = step::plan(B);
    plan.admission = AdmissionPolicy::Frontier {
        width: 4,
        expected_filter_ppm: 200_000,
        fallback: SubmitOrder::Interleaved,
    };
    ALLOCATIONS.with(|n| n.set(0));
    ARMED.with(|a| a.set(true));
    let run = step::run_step(&mut s, 0, plan, 11);
    ARMED.with(|a| a.set(false));
    assert_eq!(allocations(), 0, "the core allocated");
    assert_eq!(run.trained, B);
    assert!(
        run.requests >= (B as u64 + run.filtered as u64) * 16,
        "{run:?}"
    );
    assert_eq!(s.audit(), Ok(()));
}
