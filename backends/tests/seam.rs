//! Seam v2 at the engine and trainer level on the CPU backend: group prefix sharing gives the
//! tokens each sample would generate alone, a full engine hands submissions back, submit/poll
//! lets the host add requests while a step runs, weight sync takes the same-device path and
//! equals the host path, and optimizer state round-trips for checkpoints.

#[path = "support/engine.rs"]
mod engine;

use std::collections::BTreeMap;

use engine::{
    assert_same_output, drain, overlap_reference, overlap_start, params, peaked_weights as weights,
    poll_until_done,
};
use rolloutpipe_backends::*;

fn mini() -> ModelConfig {
    ModelConfig {
        vocab_size: 32,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        max_position_embeddings: 128,
        ..ModelConfig::tiny()
    }
}

#[test]
fn group_shares_its_prefill_and_matches_independent_requests_bit_for_bit() {
    let cfg = mini();
    let w = weights(&cfg, 1);
    let prompt: Vec<u32> = vec![3, 1, 4, 1, 5, 9, 2, 6];
    // Different lengths and a one-token sample (it finishes in the prefill step).
    let samples: Vec<(RequestKey, SamplingParams)> = [(0, 7), (1, 1), (2, 12), (3, 5)]
        .iter()
        .map(|&(i, n)| (RequestKey(i), params(100 + i, n)))
        .collect();
    let mut alone = CpuBackend::new(&cfg, &w, 2).unwrap();
    for (id, p) in &samples {
        alone
            .add_request(GenRequest {
                id: *id,
                prompt: prompt.clone(),
                params: p.clone(),
            })
            .unwrap();
    }
    let want = drain(&mut alone);
    let mut grouped = CpuBackend::new(&cfg, &w, 2).unwrap();
    grouped
        .add_group(GroupRequest {
            prompt: prompt.clone(),
            samples: samples.clone(),
        })
        .unwrap();
    assert_eq!(grouped.active_requests(), 4);
    assert_eq!(grouped.load().kv_tokens, 4 * prompt.len() + 7 + 1 + 12 + 5);
    let got = drain(&mut grouped);
    assert_eq!(got.len(), 4);
    for (id, o) in &want {
        assert_same_output(*id, &got[id], o);
    }
    assert_eq!(grouped.load(), EngineLoad::default());
}

#[test]
fn cancelling_a_group_leader_before_prefill_keeps_the_rest() {
    let cfg = mini();
    let w = weights(&cfg, 2);
    let prompt = vec![7u32, 8, 9];
    let samples: Vec<_> = (0..3).map(|i| (RequestKey(i), params(i, 4))).collect();
    let mut alone = CpuBackend::new(&cfg, &w, 1).unwrap();
    for r in (GroupRequest {
        prompt: prompt.clone(),
        samples: samples[1..].to_vec(),
    })
    .into_requests()
    {
        alone.add_request(r).unwrap();
    }
    let want = drain(&mut alone);
    let mut be = CpuBackend::new(&cfg, &w, 1).unwrap();
    be.add_group(GroupRequest { prompt, samples }).unwrap();
    be.cancel_request(RequestKey(0)).unwrap();
    assert!(matches!(
        be.cancel_request(RequestKey(0)),
        Err(BackendError::UnknownRequest(_))
    ));
    let got = drain(&mut be);
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
    for (id, o) in &want {
        assert_eq!(got[id].tokens, o.tokens, "sample {id}");
    }
}

#[test]
fn a_full_engine_hands_the_submission_back() {
    let cfg = mini();
    let mut be = CpuBackend::new(&cfg, &weights(&cfg, 3), 1).unwrap();
    assert!(
        be.set_limits(EngineLimits {
            max_requests: 0,
            max_kv_tokens: 1
        })
        .is_err()
    );
    be.set_limits(EngineLimits {
        max_requests: 2,
        max_kv_tokens: 20,
    })
    .unwrap();
    let req = |id, n| GenRequest {
        id: RequestKey(id),
        prompt: vec![1, 2],
        params: params(id, n),
    };
    be.add_request(req(0, 8)).unwrap(); // 10 KV positions
    // 12 more positions exceed 20: refused, and handed back intact.
    let e = be.add_request(req(1, 10)).unwrap_err();
    assert!(e.to_string().starts_with("engine full:"), "{e}");
    match e.into_rejected() {
        Ok(Rejected::Request(r)) => assert_eq!(r, req(1, 10)),
        other => panic!("expected the request back, got {other:?}"),
    }
    // A group that does not fit comes back whole; nothing of it was admitted.
    let g = GroupRequest {
        prompt: vec![4],
        samples: vec![(RequestKey(5), params(5, 2)), (RequestKey(6), params(6, 2))],
    };
    match be.add_group(g.clone()).unwrap_err().into_rejected() {
        Ok(Rejected::Group(back)) => assert_eq!(back, g),
        other => panic!("expected the group back, got {other:?}"),
    }
    assert_eq!(be.active_requests(), 1);
    be.add_request(req(1, 8)).unwrap();
    assert!(matches!(
        be.add_request(req(2, 1)),
        Err(BackendError::EngineFull { .. })
    ));
    // Invalid input is its own error, not back-pressure.
    assert!(matches!(
        be.add_request(req(0, 1)),
        Err(BackendError::DuplicateRequest(_))
    ));
    drain(&mut be);
    be.add_request(req(2, 1)).unwrap();
}

#[test]
fn submit_poll_overlaps_host_work_and_matches_decode_step() {
    let cfg = mini();
    let w = weights(&cfg, 4);
    let want = overlap_reference(&mut CpuBackend::new(&cfg, &w, 2).unwrap());
    let mut be = CpuBackend::new(&cfg, &w, 2).unwrap();
    // While the step runs: add and cancel for the next one; the engine refuses what needs
    // it idle.
    overlap_start(&mut be);
    let mut got: BTreeMap<u64, GenOutput> = (poll_until_done(&mut be).into_iter())
        .map(|o| (o.id.0, o))
        .collect();
    got.extend(drain(&mut be));
    assert_eq!(got, want);
    assert_eq!(be.poll_step(false).unwrap(), Some(vec![]));
}

#[test]
fn weight_sync_takes_the_same_device_path_and_equals_the_host_path() {
    let cfg = mini();
    let w0 = weights(&cfg, 5);
    let mut trainer = CpuBackend::new(&cfg, &w0, 1).unwrap();
    let seq = TrainSequence::new(vec![1, 2, 3], vec![4, 5], 1.0, Aggregation::TokenMean);
    let batch = TrainBatch {
        sequences: vec![seq],
    };
    trainer.zero_grad().unwrap();
    trainer.accumulate(&batch, &Objective::default()).unwrap();
    trainer.optimizer_step(2.0, &AdamW::default()).unwrap();
    let trained = trainer.export_weights().unwrap();
    assert_ne!(trained, w0);

    let mut fast = CpuBackend::new(&cfg, &w0, 1).unwrap();
    assert_eq!(trainer.sync_to(&mut fast).unwrap(), SyncPath::SameDevice);
    let mut slow = CpuBackend::new(&cfg, &w0, 1).unwrap();
    let host = WeightSnapshot::host(&cfg, &trained, DType::F32).unwrap();
    assert_eq!(slow.load_weights(&host).unwrap(), SyncPath::Host);
    assert_eq!(fast.export_weights().unwrap(), trained);
    assert_eq!(slow.export_weights().unwrap(), trained);

    // A bf16 target gets bf16 values (rounded once), widened exactly by an f32 engine.
    let snap = trainer
        .snapshot_weights(SyncTarget {
            device: DeviceId::Host,
            dtype: DType::Bf16,
        })
        .unwrap();
    fast.load_weights(&snap).unwrap();
    let got = fast.export_weights().unwrap();
    for (name, t) in &trained.tensors {
        for (a, b) in t.data.iter().zip(&got.tensors[name].data) {
            assert_eq!(*b, half::bf16::from_f32(*a).to_f32(), "{name}");
        }
    }

    // Refused under active requests and for another model.
    fast.add_request(GenRequest {
        id: RequestKey(1),
        prompt: vec![1],
        params: params(1, 2),
    })
    .unwrap();
    assert!(trainer.sync_to(&mut fast).is_err());
    let mut other_cfg = cfg.clone();
    other_cfg.num_hidden_layers = 1;
    let mut other =
        CpuBackend::new(&other_cfg, &Weights::random(&other_cfg, 0).unwrap(), 1).unwrap();
    assert!(trainer.sync_to(&mut other).is_err());
}

#[test]
fn optimizer_state_leaves_the_trainer_only_for_checkpoints_and_round_trips() {
    let cfg = mini();
    let w = weights(&cfg, 6);
    let mut t = CpuBackend::new(&cfg, &w, 1).unwrap();
    assert!(t.checkpoint_optimizer().unwrap().m.is_empty());
    let seq = TrainSequence::new(vec![1, 2], vec![3], 0.5, Aggregation::TokenMean);
    let batch = TrainBatch {
        sequences: vec![seq],
    };
    t.zero_grad().unwrap();
    t.accumulate(&batch, &Objective::Sft).unwrap();
    t.optimizer_step(1.0, &AdamW::default()).unwrap();
    let st = t.checkpoint_optimizer().unwrap();
    assert_eq!(st.step, 1);
    let mut u = CpuBackend::new(&cfg, &t.export_weights().unwrap(), 1).unwrap();
    u.restore_optimizer(st.clone()).unwrap();
    assert_eq!(u.checkpoint_optimizer().unwrap(), st);
    let bad = AdamState {
        m: vec![0.0; 2],
        v: vec![0.0; 2],
        step: 1,
    };
    assert!(matches!(
        u.restore_optimizer(bad),
        Err(BackendError::Shape { .. })
    ));
}

/// Moves request 0 or else 3, whichever `from` holds, to `to`.
fn move_one(from: &mut CpuBackend, to: &mut CpuBackend) {
    for id in [0, 3] {
        if let Ok(st) = from.export_request(RequestKey(id)) {
            assert_eq!(st.tokens.len(), st.logprobs.len());
            to.resume_request(st).unwrap();
            return;
        }
    }
}

/// Long-tail migration: a request exported mid-generation and resumed on another engine (which
/// runs requests of its own) re-prefills prompt + generated tokens and continues the same
/// seeded stream, so its output is the uninterrupted run's bit for bit, however often it moves.
#[test]
fn an_exported_request_resumes_on_another_engine_bit_for_bit() {
    let cfg = mini();
    let w = weights(&cfg, 6);
    let req = |id: u64, n| GenRequest {
        id: RequestKey(id),
        prompt: vec![5, 3, 1 + id as u32, 7],
        params: SamplingParams {
            stop_tokens: vec![31],
            ..params(40 + id, n)
        },
    };
    let mut alone = CpuBackend::new(&cfg, &w, 1).unwrap();
    for id in 0..4 {
        alone.add_request(req(id, 24)).unwrap();
    }
    let want = drain(&mut alone);
    // Moved after 1, 3, 5 and 9 tokens; request 3 moves back and forth.
    for hop in [1, 3, 5, 9] {
        let mut a = CpuBackend::new(&cfg, &w, 1).unwrap();
        let mut b = CpuBackend::new(&cfg, &w, 2).unwrap();
        for id in 0..3 {
            a.add_request(req(id, 24)).unwrap();
        }
        b.add_request(req(3, 24)).unwrap();
        let mut got = BTreeMap::new();
        let mut done = |o: GenOutput| assert!(got.insert(o.id.0, o).is_none());
        for step in 1.. {
            if a.active_requests() + b.active_requests() == 0 {
                break;
            }
            a.decode_step().unwrap().into_iter().for_each(&mut done);
            b.decode_step().unwrap().into_iter().for_each(&mut done);
            if step % hop != 0 {
                continue;
            }
            move_one(&mut a, &mut b);
            move_one(&mut b, &mut a);
        }
        assert_eq!(got.len(), 4, "hop {hop}");
        for (id, o) in &want {
            assert_same_output(*id, &got[id], o);
        }
        assert_eq!(a.load(), EngineLoad::default());
        assert_eq!(b.load(), EngineLoad::default());
    }
}

#[test]
fn export_and_resume_refuse_what_they_cannot_do() {
    let cfg = mini();
    let w = weights(&cfg, 7);
    let req = |id: u64, n| GenRequest {
        id: RequestKey(id),
        prompt: vec![2, 4],
        params: params(id, n),
    };
    let mut a = CpuBackend::new(&cfg, &w, 1).unwrap();
    let one_line = |e: BackendError| {
        let s = e.to_string();
        assert_eq!(s.lines().count(), 1, "{s}");
        s
    };
    assert!(matches!(
        a.export_request(RequestKey(9)),
        Err(BackendError::UnknownRequest(_))
    ));
    a.add_request(req(1, 10)).unwrap();
    let e = one_line(a.export_request(RequestKey(1)).unwrap_err());
    assert!(e.contains("has not generated a token"), "{e}");
    a.decode_step().unwrap();
    a.decode_step().unwrap();
    let st = a.export_request(RequestKey(1)).unwrap();
    assert_eq!((st.tokens.len(), a.active_requests()), (2, 0));
    assert_eq!(st.request, req(1, 10));
    let mut bad = st.clone();
    bad.logprobs.pop();
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("logprobs"));
    let mut bad = st.clone();
    bad.tokens.clear();
    bad.logprobs.clear();
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("tokens"));
    let mut bad = st.clone();
    bad.request.params.max_new_tokens = 2;
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("max_new_tokens"));
    let mut bad = st.clone();
    bad.tokens[0] = 999;
    assert!(one_line(a.resume_request(bad).unwrap_err()).contains("out of range"));
    // A full engine hands the state back, progress included.
    a.set_limits(EngineLimits {
        max_requests: 1,
        max_kv_tokens: 100,
    })
    .unwrap();
    a.add_request(req(2, 3)).unwrap();
    match a.resume_request(st.clone()).unwrap_err().into_rejected() {
        Ok(Rejected::Resume(back)) => assert_eq!(*back, st),
        other => panic!("expected the state back, got {other:?}"),
    }
    drain(&mut a);
    a.resume_request(st.clone()).unwrap();
    assert!(matches!(
        a.resume_request(st),
        Err(BackendError::DuplicateRequest(_))
    ));
    assert_eq!(a.active_requests(), 1);
}
