//! Every check the interpreter promises, each provoked by a small kernel: the fault names
//! the kernel, the line, the instruction, the block and the thread, and the launch, module
//! and argument errors say what is wrong.

use rolloutpipe_ptx_interp::{
    Access, Arg, Config, Device, Error, Fault, FaultKind, Hazard, LaunchConfig,
};

/// A module with entry `k(.param .u64 p0, .param .u64 p1, .param .u32 n)`: `body` runs after
/// %rd1 = p0, %rd2 = p1, %r1 = n, %r2 = tid.x, %r3 = ctaid.x, with `decls` declared.
fn kernel(decls: &str, body: &str) -> String {
    format!(
        ".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry k(.param .u64 p0, .param .u64 p1, .param .u32 n)\n{{\n    \
         .reg .pred %p<8>;\n    .reg .b32 %r<16>;\n    .reg .b64 %rd<16>;\n    .reg .f32 %f<8>;\n    {decls}\n    \
         ld.param.u64 %rd1, [p0];\n    ld.param.u64 %rd2, [p1];\n    ld.param.u32 %r1, [n];\n    mov.u32 %r2, %tid.x;\n    \
         mov.u32 %r3, %ctaid.x;\n{body}\nDONE:\n    ret;\n}}\n"
    )
}

/// Launches `kernel(decls, body)` with p0 = a 64-float buffer (initialised), p1 = 64 floats
/// (uninitialised), n = 64, on `grid` blocks of `block` threads; returns the fault.
fn fault(decls: &str, body: &str, grid: u32, block: u32) -> Fault {
    let dev = Device::new();
    let m = dev
        .load_module("checks", &kernel(decls, body))
        .unwrap_or_else(|e| panic!("{e}"));
    let a = dev.upload(&[1.0f32; 64]).unwrap();
    let b = dev.alloc(256).unwrap();
    match dev.launch(
        m,
        "k",
        &LaunchConfig::linear(grid, block),
        &[Arg::Ptr(a), Arg::Ptr(b), Arg::U32(64)],
    ) {
        Err(Error::Fault(f)) => *f,
        other => panic!("expected a fault, got {other:?}"),
    }
}

const IDX: &str = "    mul.wide.u32 %rd3, %r2, 4;\n    add.u64 %rd4, %rd1, %rd3;\n";

#[test]
fn out_of_bounds_global_access_names_the_allocation() {
    // Thread 64 reads a[64] of a 64-float buffer.
    let f = fault("", &format!("{IDX}    ld.global.f32 %f1, [%rd4];"), 1, 96);
    assert_eq!(
        (f.kernel.as_str(), f.line, f.thread, f.block),
        ("k", 18, [64, 0, 0], [0, 0, 0])
    );
    assert_eq!(f.text, "ld.global.f32 %f1, [%rd4];");
    let FaultKind::OutOfBounds {
        space: "global",
        size: 4,
        access: Access::Read,
        detail,
        ..
    } = &f.kind
    else {
        panic!("{f}")
    };
    assert!(
        detail.contains("0 bytes past the end of the 256-byte allocation")
            || detail.contains("4 bytes past"),
        "{detail}"
    );
    let f = fault("", &format!("{IDX}    st.global.f32 [%rd4+4], %f1;"), 1, 64);
    assert!(
        matches!(
            f.kind,
            FaultKind::OutOfBounds {
                access: Access::Write,
                ..
            }
        ),
        "{f}"
    );
    assert_eq!(f.thread, [63, 0, 0]);
}

#[test]
fn misaligned_accesses_fault() {
    let f = fault("", "    ld.global.f32 %f1, [%rd1+2];", 1, 32);
    assert!(
        matches!(
            f.kind,
            FaultKind::Misaligned {
                space: "global",
                align: 4,
                ..
            }
        ),
        "{f}"
    );
    let f = fault(
        "",
        "    ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd1+8];",
        1,
        32,
    );
    assert!(
        matches!(f.kind, FaultKind::Misaligned { align: 16, .. }),
        "{f}"
    );
}

#[test]
fn uninitialised_global_and_shared_reads_fault() {
    let f = fault("", "    ld.global.f32 %f1, [%rd2];", 1, 32);
    assert!(
        matches!(
            f.kind,
            FaultKind::Uninitialized {
                space: "global",
                ..
            }
        ),
        "{f}"
    );
    let f = fault(
        ".shared .align 4 .f32 s[32];",
        "    mov.u32 %r4, s;\n    ld.shared.f32 %f1, [%r4];",
        1,
        32,
    );
    assert!(
        matches!(
            f.kind,
            FaultKind::Uninitialized {
                space: "shared",
                addr: 0
            }
        ),
        "{f}"
    );
}

/// Thread t writes s[t]; then every thread reads s[(t + 1) % 32], with or without a barrier.
fn neighbour(barrier: bool) -> String {
    format!(
        "    mov.u32 %r4, s;\n    shl.b32 %r5, %r2, 2;\n    add.u32 %r6, %r4, %r5;\n    st.shared.f32 [%r6], %f1;\n{}    \
         add.u32 %r7, %r2, 1;\n    and.b32 %r7, %r7, 31;\n    shl.b32 %r7, %r7, 2;\n    add.u32 %r7, %r4, %r7;\n    ld.shared.f32 %f2, [%r7];\n    \
         st.global.f32 [%rd1], %f2;",
        if barrier { "    bar.sync 0;\n" } else { "" }
    )
}

#[test]
fn shared_races_between_barriers_are_found_and_barriers_order_them() {
    let decl = ".shared .align 4 .f32 s[32];";
    let f = fault(decl, &neighbour(false), 1, 32);
    let FaultKind::SharedRace {
        hazard: Hazard::ReadAfterWrite,
        addr: 4,
        other_thread: Some(1),
        other_line: Some(19),
    } = f.kind
    else {
        panic!("{f}")
    };
    assert_eq!(f.thread, [0, 0, 0]);
    // With the barrier the reads are ordered, but then every thread stores to p0[0]: a write
    // race in global memory is not checked within a block, so it runs.
    let dev = Device::new();
    let m = dev
        .load_module("ok", &kernel(decl, &neighbour(true)))
        .unwrap();
    let a = dev.upload(&[1.0f32; 64]).unwrap();
    dev.launch(
        m,
        "k",
        &LaunchConfig::linear(1, 32),
        &[Arg::Ptr(a), Arg::Ptr(a), Arg::U32(64)],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    // Write after write: two threads store the same word.
    let f = fault(
        decl,
        "    mov.u32 %r4, s;\n    st.shared.f32 [%r4], %f1;",
        1,
        32,
    );
    assert!(
        matches!(
            f.kind,
            FaultKind::SharedRace {
                hazard: Hazard::WriteAfterWrite,
                ..
            }
        ),
        "{f}"
    );
    // Write after read: thread 0 reads s[1] after thread 1 wrote it behind a barrier, then
    // thread 1 writes it again without one.
    let body = "    mov.u32 %r4, s;\n    shl.b32 %r5, %r2, 2;\n    add.u32 %r6, %r4, %r5;\n    st.shared.f32 [%r6], %f1;\n    bar.sync 0;\n    \
                ld.shared.f32 %f2, [%r4+4];\n    st.shared.f32 [%r6], %f2;";
    let f = fault(decl, body, 1, 32);
    assert!(
        matches!(
            f.kind,
            FaultKind::SharedRace {
                hazard: Hazard::WriteAfterRead,
                ..
            }
        ),
        "{f}"
    );
}

#[test]
fn barriers_not_reached_by_every_thread_fault() {
    // Thread 5 leaves before the barrier.
    let body = "    setp.eq.u32 %p1, %r2, 5;\n    @%p1 bra DONE;\n    bar.sync 0;";
    let f = fault("", body, 1, 64);
    let FaultKind::Barrier(msg) = &f.kind else {
        panic!("{f}")
    };
    assert!(
        msg.contains("1 thread(s) of the block exited") && msg.contains("thread 5"),
        "{msg}"
    );
    // Lanes of one warp at two different barriers.
    let body = "    setp.lt.u32 %p1, %r2, 16;\n    @%p1 bra L2;\n    bar.sync 0;\n    bra.uni DONE;\nL2:\n    bar.sync 0;";
    let FaultKind::Barrier(msg) = fault("", body, 1, 32).kind else {
        panic!()
    };
    assert!(msg.contains("different barriers"), "{msg}");
    // A guard predicate that lets half of the warp skip it.
    let FaultKind::Barrier(msg) = fault(
        "",
        "    setp.lt.u32 %p1, %r2, 16;\n    @%p1 bar.sync 0;",
        1,
        32,
    )
    .kind
    else {
        panic!()
    };
    assert!(msg.contains("skip it through their guard"), "{msg}");
}

#[test]
fn warp_synchronous_instructions_need_all_their_lanes() {
    // Lanes 16.. exit before a full-mask shuffle.
    let body = "    setp.ge.u32 %p1, %r2, 16;\n    @%p1 bra DONE;\n    shfl.sync.bfly.b32 %r5, %r2, 1, 31, -1;";
    let FaultKind::WarpSync(msg) = fault("", body, 1, 32).kind else {
        panic!()
    };
    assert!(msg.contains("never arrives (lanes 16,17,"), "{msg}");
    assert!(msg.ends_with("exited)"), "{msg}");
    // A partial warp (48 threads) cannot use a full membermask.
    let FaultKind::WarpSync(msg) =
        fault("", "    shfl.sync.bfly.b32 %r5, %r2, 1, 31, -1;", 1, 48).kind
    else {
        panic!()
    };
    assert!(msg.contains("16,17"), "{msg}");
    // Lanes that diverge to two different shuffles never meet.
    let body = "    setp.lt.u32 %p1, %r2, 16;\n    @%p1 bra L2;\n    shfl.sync.bfly.b32 %r5, %r2, 1, 31, -1;\n    bra.uni DONE;\nL2:\n    shfl.sync.bfly.b32 %r5, %r2, 1, 31, -1;";
    let FaultKind::WarpSync(msg) = fault("", body, 1, 32).kind else {
        panic!()
    };
    assert!(msg.contains("never arrives"), "{msg}");
    // A shuffle that reads a lane outside the participating ones.
    let body = "    setp.ge.u32 %p1, %r2, 16;\n    @%p1 bra DONE;\n    shfl.sync.idx.b32 %r5, %r2, 20, 31, 0xffff;";
    let FaultKind::WarpSync(msg) = fault("", body, 1, 32).kind else {
        panic!()
    };
    assert!(msg.contains("reads lane 20"), "{msg}");
}

#[test]
fn divergent_uniform_branch_and_division_by_zero_fault() {
    let f = fault(
        "",
        "    setp.lt.u32 %p1, %r2, 3;\n    @%p1 bra.uni DONE;",
        1,
        32,
    );
    assert_eq!(f.kind, FaultKind::DivergentUniformBranch);
    let f = fault(
        "",
        "    sub.u32 %r5, %r2, 7;\n    div.u32 %r6, 100, %r5;",
        1,
        32,
    );
    assert_eq!((f.kind, f.thread), (FaultKind::DivideByZero, [7, 0, 0]));
}

#[test]
fn blocks_touching_each_others_global_writes_fault() {
    // Every block writes p0[tid]: block 1 overwrites block 0's bytes.
    let f = fault("", &format!("{IDX}    st.global.f32 [%rd4], %f1;"), 2, 32);
    let FaultKind::BlockRace {
        access: Access::Write,
        other_block: 0,
        ..
    } = f.kind
    else {
        panic!("{f}")
    };
    assert_eq!(f.block, [1, 0, 0]);
    // Block 0 writes, block 1 reads the same bytes.
    let body = format!(
        "{IDX}    setp.eq.u32 %p1, %r3, 0;\n    @%p1 st.global.f32 [%rd4], %f1;\n    @!%p1 ld.global.f32 %f2, [%rd4];"
    );
    assert!(matches!(
        fault("", &body, 2, 32).kind,
        FaultKind::BlockRace {
            access: Access::Read,
            ..
        }
    ));
    // ld.global.nc of bytes this launch wrote (the same thread: still not coherent).
    let body = format!("{IDX}    st.global.f32 [%rd4], %f1;\n    ld.global.nc.f32 %f2, [%rd4];");
    assert!(matches!(
        fault("", &body, 1, 32).kind,
        FaultKind::NonCoherentRead { .. }
    ));
}

#[test]
fn an_endless_loop_stops_at_the_step_budget() {
    let dev = Device::with_config(Config {
        max_warp_steps: 10_000,
        ..Config::default()
    });
    let m = dev
        .load_module("loop", &kernel("", "L:\n    bra.uni L;"))
        .unwrap();
    let a = dev.upload(&[0f32; 64]).unwrap();
    let e = dev
        .launch(
            m,
            "k",
            &LaunchConfig::linear(1, 32),
            &[Arg::Ptr(a), Arg::Ptr(a), Arg::U32(1)],
        )
        .unwrap_err();
    let Error::Fault(f) = e else { panic!("{e}") };
    assert_eq!(f.kind, FaultKind::StepLimit(10_000));
}

#[test]
fn unimplemented_instructions_refuse_to_launch() {
    let dev = Device::new();
    let m = dev
        .load_module(
            "atom",
            &kernel("", "    atom.global.add.u32 %r5, [%rd1], 1;"),
        )
        .unwrap();
    let a = dev.upload(&[0u32; 64]).unwrap();
    let e = dev
        .launch(
            m,
            "k",
            &LaunchConfig::linear(1, 32),
            &[Arg::Ptr(a), Arg::Ptr(a), Arg::U32(1)],
        )
        .unwrap_err();
    let Error::Unimplemented {
        kernel: name,
        line,
        text,
        reason,
    } = &e
    else {
        panic!("{e}")
    };
    assert_eq!(
        (name.as_str(), *line, text.as_str()),
        ("k", 16, "atom.global.add.u32 %r5, [%rd1], 1;")
    );
    assert!(reason.contains("`atom` is not implemented"), "{reason}");
    // An unknown modifier is not ignored either.
    let m = dev
        .load_module("mod", &kernel("", "    add.cc.u32 %r5, %r1, 1;"))
        .unwrap();
    let e = dev
        .launch(
            m,
            "k",
            &LaunchConfig::linear(1, 32),
            &[Arg::Ptr(a), Arg::Ptr(a), Arg::U32(1)],
        )
        .unwrap_err();
    assert!(e.to_string().contains("modifier `.cc`"), "{e}");
    assert_eq!(dev.memory_used(), 256, "nothing ran");
}

#[test]
fn launch_module_and_argument_errors_say_what_is_wrong() {
    let dev = Device::new();
    let e = dev
        .load_module(
            "bad",
            ".version 8.0\n.entry k()\n{\n    mov.u32 %r1, 1;\n}\n",
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "PTX module `bad`, line 4: `mov.u32`: undeclared register `%r1`"
    );
    let m = dev.load_module("ok", &kernel("", "")).unwrap();
    let a = Arg::Ptr(dev.alloc(4).unwrap());
    let cfg = LaunchConfig::linear(1, 32);
    let e = dev
        .launch(m, "k", &cfg, &[a.clone(), a.clone()])
        .unwrap_err()
        .to_string();
    assert_eq!(e, "launch of `k`: 2 arguments for 3 parameters");
    let e = dev
        .launch(m, "k", &cfg, &[a.clone(), Arg::F32(1.0), Arg::U32(1)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("parameter `p1` is `.u64`"), "{e}");
    let e = dev
        .launch(
            m,
            "k",
            &LaunchConfig::linear(1, 2048),
            &[a.clone(), a.clone(), Arg::U32(1)],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("block (2048,1,1)"), "{e}");
    let e = dev.launch(m, "nope", &cfg, &[]).unwrap_err().to_string();
    assert_eq!(e, "module `ok` has no entry `nope` (it has: k)");
    let e = dev
        .copy_htod(rolloutpipe_ptx_interp::DevicePtr(0x1234), &[0; 4])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("device memory: 4 bytes at 0x1234"), "{e}");
}
