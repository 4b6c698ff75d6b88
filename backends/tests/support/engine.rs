//! Helpers of the engine-level tests (`seam.rs`, `wgpu_kv.rs`, `wgpu_half.rs`,
//! `wgpu_coop.rs`): peaked random weights, sampling settings, draining and polling an engine,
//! and comparing outputs bit for bit.
#![allow(dead_code)] // each test crate uses a subset

use std::collections::BTreeMap;

use rolloutpipe_backends::*;

/// Random weights with the matrices ×4, so that sampling is peaked and any numerical
/// difference changes tokens.
pub fn peaked_weights(cfg: &ModelConfig, seed: u64) -> Weights {
    let mut w = Weights::random(cfg, seed).expect("random weights");
    for (name, t) in w.tensors.iter_mut() {
        if !name.ends_with("norm.weight") {
            t.data.iter_mut().for_each(|x| *x *= 4.0);
        }
    }
    w
}

/// Temperature 0.9, top-k 12.
pub fn params(seed: u64, max_new: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 12,
        max_new_tokens: max_new,
        seed,
        ..Default::default()
    }
}

/// Steps until no request is active; every output by request id (each exactly once).
pub fn drain(be: &mut dyn RolloutEngine) -> BTreeMap<u64, GenOutput> {
    let mut out = BTreeMap::new();
    while be.active_requests() > 0 {
        for o in be.decode_step().expect("step") {
            assert!(out.insert(o.id.0, o).is_none(), "a request finished twice");
        }
    }
    out
}

/// Adds every request, steps until none is active, and returns the outputs in request order.
pub fn generate(be: &mut dyn RolloutEngine, reqs: &[GenRequest]) -> Vec<GenOutput> {
    for r in reqs {
        be.add_request(r.clone()).unwrap();
    }
    drain(be).into_values().collect()
}

/// Polls the submitted step without blocking until its outputs come back.
pub fn poll_until_done(be: &mut dyn RolloutEngine) -> Vec<GenOutput> {
    loop {
        if let Some(out) = be.poll_step(false).expect("poll") {
            return out;
        }
        std::thread::yield_now();
    }
}

/// The same tokens, finish and log-prob bits.
pub fn assert_same_output(id: u64, got: &GenOutput, want: &GenOutput) {
    assert_eq!(got.tokens, want.tokens, "request {id} tokens");
    assert_eq!(got.finish, want.finish, "request {id} finish");
    let bits = |o: &GenOutput| o.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(got) == bits(want),
        "request {id} log-probs differ: {:?} vs {:?}",
        got.logprobs,
        want.logprobs
    );
}

/// The same request ids, each with [`assert_same_output`]'s outputs.
pub fn assert_same_outputs(got: &BTreeMap<u64, GenOutput>, want: &BTreeMap<u64, GenOutput>) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (id, o) in want {
        assert_same_output(*id, &got[id], o);
    }
}

/// Request `id` of the submit/poll scenario ([`overlap_reference`], [`overlap_start`]).
pub fn overlap_request(id: u64) -> GenRequest {
    GenRequest {
        id: RequestKey(id),
        prompt: vec![1 + id as u32, 2, 3],
        params: params(id, 6),
    }
}

/// The submit/poll scenario with blocking steps, the reference: requests 0 and 2 start,
/// request 1 joins before the second step and request 2 is cancelled then. Every output.
pub fn overlap_reference(sync: &mut dyn RolloutEngine) -> BTreeMap<u64, GenOutput> {
    sync.add_request(overlap_request(0)).unwrap();
    sync.add_request(overlap_request(2)).unwrap();
    let mut want = BTreeMap::new();
    for o in sync.decode_step().unwrap() {
        want.insert(o.id.0, o);
    }
    sync.add_request(overlap_request(1)).unwrap();
    sync.cancel_request(RequestKey(2)).unwrap();
    want.extend(drain(sync));
    want
}

/// The same scenario with the first step submitted and, while it runs, the join and the
/// cancel for the next one; a second submission is refused. The caller collects the step.
pub fn overlap_start(be: &mut dyn RolloutEngine) {
    be.add_request(overlap_request(0)).unwrap();
    be.add_request(overlap_request(2)).unwrap();
    be.submit_step().unwrap();
    be.add_request(overlap_request(1)).unwrap();
    be.cancel_request(RequestKey(2)).unwrap();
    assert!(matches!(
        be.submit_step(),
        Err(BackendError::StepInFlight(_))
    ));
}
