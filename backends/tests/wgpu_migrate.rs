//! Long-tail migration on the wgpu engine: a request exported mid-generation (a group's
//! sample on shared prompt pages included) and resumed on another engine re-prefills prompt +
//! generated tokens on pages of its own and continues the same seeded stream, so its output is
//! the uninterrupted run's bit for bit; export and resume refuse what they cannot do with a
//! one-line error, and a full pool hands the state back.
#![cfg(feature = "wgpu")]

#[path = "support/device.rs"]
mod device;
#[path = "support/engine.rs"]
mod engine;
#[path = "support/wgpu_small.rs"]
mod small;

use std::collections::BTreeMap;
use std::sync::Arc;

use engine::{assert_same_outputs as assert_same, drain, params};
use rolloutpipe_backends::wgpu::{Gpu, WgpuBackend};
use rolloutpipe_backends::*;
use small::{engine, prompt, setup};

/// Engine `a` runs a group of three samples (0-2) on shared prompt pages, engine `b` a lone
/// request (3). Every `hop` steps sample 0 (or else sample 2) moves from `a` to `b` and
/// request 3 (or else request 1) from `b` to `a`, so requests move back and forth and a moved
/// sample's group goes on without it.
fn run_with_moves(
    cfg: &ModelConfig,
    w: &Weights,
    g: &Arc<Gpu>,
    group: &GroupRequest,
    lone: &GenRequest,
    hop: usize,
) -> (BTreeMap<u64, GenOutput>, u32) {
    let (mut a, mut b) = (engine(cfg, w, g), engine(cfg, w, g));
    a.add_group(group.clone()).expect("group");
    b.add_request(lone.clone()).expect("lone");
    let mut got = BTreeMap::new();
    let mut moves = 0;
    for step in 1.. {
        if a.active_requests() + b.active_requests() == 0 {
            break;
        }
        for be in [&mut a, &mut b] {
            for o in be.decode_step().expect("step") {
                assert!(got.insert(o.id.0, o).is_none(), "finished twice");
            }
        }
        if step % hop != 0 {
            continue;
        }
        moves += move_one(&mut a, &mut b, [0, 2]);
        moves += move_one(&mut b, &mut a, [3, 1]);
    }
    assert_eq!(
        a.load(),
        EngineLoad::default(),
        "hop {hop}: a holds nothing"
    );
    assert_eq!(
        b.load(),
        EngineLoad::default(),
        "hop {hop}: b holds nothing"
    );
    (got, moves)
}

/// Moves the first of `ids` that `from` can export to `to`; 1 when one moved.
fn move_one(from: &mut WgpuBackend, to: &mut WgpuBackend, ids: [u64; 2]) -> u32 {
    let Some(st) = ids
        .iter()
        .find_map(|&id| from.export_request(RequestKey(id)).ok())
    else {
        return 0;
    };
    assert_eq!(st.tokens.len(), st.logprobs.len());
    to.resume_request(st).expect("resume");
    1
}

#[test]
fn an_exported_request_resumes_on_another_wgpu_engine_bit_for_bit() {
    let Some((cfg, w, g)) = setup(11) else { return };
    let prompt = prompt();
    let sp = |i: u64, n| SamplingParams {
        stop_tokens: vec![95],
        ..params(200 + i, n)
    };
    let group = GroupRequest {
        prompt: prompt.clone(),
        samples: (0..3)
            .map(|i| (RequestKey(i), sp(i, 20 + i as usize)))
            .collect(),
    };
    let lone = GenRequest {
        id: RequestKey(3),
        prompt: prompt[..9].to_vec(),
        params: sp(3, 24),
    };
    let mut alone = engine(&cfg, &w, &g);
    alone.add_group(group.clone()).expect("group");
    alone.add_request(lone.clone()).expect("lone");
    let want = drain(&mut alone);
    assert!(
        want.values().any(|o| o.tokens.len() > 9),
        "some request outlives the moves"
    );
    for hop in [1, 3, 4, 9] {
        let (got, moves) = run_with_moves(&cfg, &w, &g, &group, &lone, hop);
        assert!(moves >= 2, "hop {hop}: {moves} moves");
        assert_same(&got, &want);
    }
}

#[test]
fn wgpu_export_and_resume_refuse_what_they_cannot_do() {
    let Some((cfg, w, g)) = setup(12) else { return };
    let req = |id: u64, n| GenRequest {
        id: RequestKey(id),
        prompt: vec![2, 4],
        params: params(id, n),
    };
    let one_line = |e: BackendError| {
        let s = e.to_string();
        assert_eq!(s.lines().count(), 1, "{s}");
        s
    };
    let mut a = engine(&cfg, &w, &g);
    assert!(matches!(
        a.export_request(RequestKey(9)),
        Err(BackendError::UnknownRequest(_))
    ));
    a.add_request(req(1, 10)).unwrap();
    let e = one_line(a.export_request(RequestKey(1)).unwrap_err());
    assert!(e.contains("has not generated a token"), "{e}");
    a.decode_step().unwrap();
    // The submitted step has drawn from the request's stream: no export until it is polled.
    a.submit_step().unwrap();
    assert!(matches!(
        a.export_request(RequestKey(1)),
        Err(BackendError::StepInFlight(_))
    ));
    while a.poll_step(true).unwrap().is_none() {}
    let st = a.export_request(RequestKey(1)).unwrap();
    assert_eq!((st.tokens.len(), a.active_requests()), (2, 0));
    assert_eq!(a.load(), EngineLoad::default());
    assert_eq!(st.request, req(1, 10));
    let mut bad = st.clone();
    bad.logprobs.pop();
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("logprobs"));
    let mut bad = st.clone();
    bad.request.params.max_new_tokens = 2;
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("max_new_tokens"));
    let mut bad = st.clone();
    bad.tokens[0] = 999;
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("out of range"));
    // A pool with too few free pages hands the state back, progress included.
    a.set_kv_pages(1).unwrap();
    a.add_request(req(2, 3)).unwrap();
    match a.resume_request(st.clone()).unwrap_err().into_rejected() {
        Ok(Rejected::Resume(back)) => assert_eq!(*back, st),
        other => panic!("expected the state back, got {other:?}"),
    }
    drain(&mut a);
    a.resume_request(st.clone()).unwrap();
    assert_eq!(
        a.load().kv_tokens,
        12,
        "the prompt and max_new_tokens, as asked"
    );
    assert!(matches!(
        a.resume_request(st),
        Err(BackendError::DuplicateRequest(_))
    ));
    assert_eq!(drain(&mut a).len(), 1);
}
