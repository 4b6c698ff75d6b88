//! Look-ahead decoding on wgpu (`WgpuBackend::set_lookahead`): each submission also queues
//! the next step, whose input tokens the device copies from the step before. Every request
//! must come out with the same tokens and log-prob bits as with blocking steps, through the
//! paths where the queued step differs from the one a blocking engine would run: requests
//! that stop at a stop token (their row in the queued step is dropped), requests at their
//! `max_new_tokens` (no row queued past it), requests joining and cancelled mid-run, a key
//! cancelled and added again while its old row is queued, a group's shared prompt prefilled
//! in a queued step, an export whose stream is rewound past the queued draw, and a weights
//! load after the last request finished.
#![cfg(feature = "wgpu")]

#[path = "support/device.rs"]
mod device;
#[path = "support/engine.rs"]
mod engine;
#[path = "support/wgpu_small.rs"]
mod small;

use std::collections::BTreeMap;

use engine::{assert_same_outputs as assert_same, drain, overlap_reference, params};
use rolloutpipe_backends::wgpu::WgpuBackend;
use rolloutpipe_backends::*;
use small::{engine, overlap_matches, prompt, setup};

/// Stops on any of a sixth of the vocabulary, so that some requests end before their
/// `max_new_tokens` and some do not.
fn stopping(seed: u64, max_new: usize) -> SamplingParams {
    SamplingParams {
        stop_tokens: (0..96).step_by(6).collect(),
        ..params(seed, max_new)
    }
}

fn req(id: u64, p: SamplingParams) -> GenRequest {
    GenRequest {
        id: RequestKey(id),
        prompt: vec![1 + id as u32 % 90, 5, 9, (id as u32 * 13) % 96],
        params: p,
    }
}

/// What happens before decode call `call` (0-based) of the scripted run.
fn before_call(be: &mut WgpuBackend, call: usize) {
    match call {
        0 => {
            // A group whose shared prompt is prefilled in the first step, one of its samples
            // a single token (it ends in the prefill step).
            be.add_group(GroupRequest {
                prompt: prompt(),
                samples: [(100, 9), (101, 1), (102, 14), (103, 4)]
                    .iter()
                    .map(|&(i, n)| (RequestKey(i), params(i, n)))
                    .collect(),
            })
            .unwrap();
            for (id, n) in [(1, 1), (2, 2), (3, 17), (4, 12), (5, 30)] {
                be.add_request(req(id, stopping(id, n))).unwrap();
            }
        }
        2 => {
            // Joins while the queued step runs; another group arrives whole.
            be.add_request(req(6, stopping(6, 9))).unwrap();
            be.add_group(GroupRequest {
                prompt: prompt()[3..].to_vec(),
                samples: (110..113).map(|i| (RequestKey(i), params(i, 7))).collect(),
            })
            .unwrap();
        }
        3 => {
            // Cancelled with a row queued, then the key is reused by a new request.
            be.cancel_request(RequestKey(5)).unwrap();
            be.add_request(req(5, params(55, 6))).unwrap();
        }
        _ => {}
    }
}

/// The scripted run: steps until no request is active; every output, and the decode call
/// each request finished in.
fn scripted(be: &mut WgpuBackend) -> (BTreeMap<u64, GenOutput>, BTreeMap<u64, usize>) {
    let (mut out, mut when) = (BTreeMap::new(), BTreeMap::new());
    let mut call = 0;
    while call < 4 || be.active_requests() > 0 {
        before_call(be, call);
        for o in be.decode_step().expect("step") {
            when.insert(o.id.0, call);
            assert!(out.insert(o.id.0, o).is_none(), "a request finished twice");
        }
        call += 1;
    }
    (out, when)
}

#[test]
fn lookahead_generates_the_same_bits_as_blocking_steps() {
    let Some((cfg, w, g)) = setup(7) else { return };
    let (want, want_when) = scripted(&mut engine(&cfg, &w, &g));
    // The script reaches the paths it is for.
    let stopped = (want.values())
        .filter(|o| o.finish == FinishReason::Stop && o.tokens.len() > 1)
        .count();
    assert!(
        stopped >= 2,
        "{stopped} requests stopped after their first token"
    );
    assert!(
        want.values()
            .any(|o| o.finish == FinishReason::Length && o.tokens.len() > 4)
    );

    let mut be = engine(&cfg, &w, &g);
    be.set_lookahead(true);
    assert!(be.lookahead());
    let (got, when) = scripted(&mut be);
    assert_same(&got, &want);
    // The queued steps are real: a request added after a submission finishes one decode call
    // later than with blocking steps, one added before the first does not.
    assert_eq!(when[&6], want_when[&6] + 1);
    assert_eq!(when[&110], want_when[&110] + 1);
    assert_eq!(when[&3], want_when[&3]);

    // After the last request, a queued step holds only dropped rows: weights load, and the
    // engine generates as a fresh one does.
    let snap = be
        .snapshot_weights(SyncTarget {
            device: DeviceId::Host,
            dtype: DType::F32,
        })
        .unwrap();
    be.load_weights(&snap).expect("load after the last request");
    assert!(!be.lookahead_queued());
    let again = [(40, stopping(40, 11)), (41, params(41, 3))];
    let mut fresh = engine(&cfg, &w, &g);
    for (id, p) in &again {
        be.add_request(req(*id, p.clone())).unwrap();
        fresh.add_request(req(*id, p.clone())).unwrap();
    }
    assert_same(&drain(&mut be), &drain(&mut fresh));
}

#[test]
fn lookahead_submit_and_poll_overlap_the_host_as_blocking_steps_do() {
    let Some((cfg, w, g)) = setup(4) else { return };
    let want = overlap_reference(&mut engine(&cfg, &w, &g));
    let mut be = engine(&cfg, &w, &g);
    be.set_lookahead(true);
    overlap_matches(&mut be, &want, |be| {
        assert!(be.lookahead_queued(), "the step after the first is queued")
    });
    // Turned off, the engine steps as a blocking one.
    be.set_lookahead(false);
    let mut plain = engine(&cfg, &w, &g);
    for e in [&mut be, &mut plain] {
        e.add_request(req(7, stopping(7, 8))).unwrap();
    }
    assert_same(&drain(&mut be), &drain(&mut plain));
    assert!(!be.lookahead_queued());
}

#[test]
fn an_export_with_a_queued_row_resumes_where_the_caller_saw_it() {
    let Some((cfg, w, g)) = setup(3) else { return };
    let long = |id| req(id, params(id, 12));
    let mut alone = engine(&cfg, &w, &g);
    alone.add_request(long(1)).unwrap();
    let want = drain(&mut alone);

    let mut a = engine(&cfg, &w, &g);
    a.set_lookahead(true);
    a.add_request(long(1)).unwrap();
    a.add_request(long(2)).unwrap();
    for _ in 0..3 {
        assert!(a.decode_step().unwrap().is_empty());
    }
    // The fourth step is queued and has drawn from the request's stream; the export takes
    // the three tokens the caller has seen and the stream position after them.
    assert!(a.lookahead_queued());
    let st = a.export_request(RequestKey(1)).unwrap();
    assert_eq!(st.tokens.len(), 3);
    assert_eq!(st.tokens, want[&1].tokens[..3]);
    let mut b = engine(&cfg, &w, &g);
    b.set_lookahead(true);
    b.resume_request(st).unwrap();
    assert_same(&drain(&mut b), &want);
    // The other request, whose neighbour left with a queued row, is unaffected.
    let mut other = engine(&cfg, &w, &g);
    other.add_request(long(2)).unwrap();
    assert_same(&drain(&mut a), &drain(&mut other));
}
