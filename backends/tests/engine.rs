//! The engine contract, one suite body (`engine_suite!`) instantiated for every backend: a
//! group's samples equal independent requests, limits hand submissions back whole,
//! submit/poll lets the host add and cancel while a step runs, a request exported
//! mid-generation and resumed on another engine of the same backend finishes with the
//! uninterrupted run's bits, optimizer state round-trips through a checkpoint, scoring and
//! decoding are batch-invariant, and look-ahead decoding gives the same bits or is refused as
//! [`BackendError::Unsupported`] where the backend runs one step at a time.
//!
//! Each instance states what its backend supports (`Expect`); what it does not support is an
//! expected result checked here, never a missing test. Without a wgpu adapter or a CUDA
//! device the instance prints `SKIP` and passes, unless `ROLLOUTPIPE_REQUIRE_GPU=1` /
//! `ROLLOUTPIPE_REQUIRE_CUDA=1` make that a failure (as in `conformance.rs`).

#[path = "support/engine.rs"]
mod engine;

use std::collections::BTreeMap;

use engine::{assert_same_output, assert_same_outputs, drain, params, peaked_weights};
use rolloutpipe_backends::*;

/// What a backend is expected to support.
#[derive(Debug, Clone, Copy)]
struct Expect {
    /// Look-ahead decoding (`set_lookahead(true)` accepted).
    lookahead: bool,
}

fn cfg() -> ModelConfig {
    // Prompts past one 16-position page, so paged stores share a group prefix.
    ModelConfig {
        vocab_size: 48,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        max_position_embeddings: 128,
        ..ModelConfig::tiny()
    }
}

fn request(id: u64, prompt: Vec<u32>, max_new: usize) -> GenRequest {
    GenRequest {
        id: RequestKey(id),
        prompt,
        params: params(100 + id, max_new),
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + seed) % 48).collect()
}

macro_rules! engine_suite {
    ($name:ident, $make:expr, $expect:expr) => {
        mod $name {
            use super::*;

            fn make(cfg: &ModelConfig, w: &Weights) -> Option<Box<dyn Policy>> {
                let f: fn(&ModelConfig, &Weights) -> Option<Box<dyn Policy>> = $make;
                f(cfg, w)
            }

            const EXPECT: Expect = $expect;

            #[test]
            fn group_samples_equal_independent_requests_and_share_their_prefix() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 1));
                let (Some(mut alone), Some(mut grouped)) = (make(&c, &w), make(&c, &w)) else {
                    return;
                };
                let p = prompt(37, 3);
                let samples: Vec<_> = [(0, 5), (1, 1), (2, 9)]
                    .iter()
                    .map(|&(i, n)| (RequestKey(i), params(100 + i, n)))
                    .collect();
                let group = GroupRequest {
                    prompt: p.clone(),
                    samples,
                };
                for r in group.clone().into_requests() {
                    alone.add_request(r).unwrap();
                }
                let independent = alone.load().kv_tokens;
                grouped.add_group(group).unwrap();
                assert_eq!(grouped.active_requests(), 3);
                // A store that shares reserves the prefix once; one that does not, each time.
                assert!(grouped.load().kv_tokens <= independent);
                assert_same_outputs(&drain(grouped.as_mut()), &drain(alone.as_mut()));
                assert_eq!(grouped.load(), EngineLoad::default());
            }

            #[test]
            fn limits_hand_submissions_back_whole() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 2));
                let Some(mut be) = make(&c, &w) else { return };
                let limits = EngineLimits {
                    max_requests: 2,
                    max_kv_tokens: 20,
                };
                be.set_limits(limits).unwrap();
                assert_eq!(be.limits(), limits);
                be.add_request(request(0, vec![1, 2], 8)).unwrap();
                let back = request(1, vec![1, 2], 11);
                match be
                    .add_request(back.clone())
                    .map_err(BackendError::into_rejected)
                {
                    Err(Ok(Rejected::Request(r))) => assert_eq!(r, back),
                    other => panic!("expected the request back, got {other:?}"),
                }
                let g = GroupRequest {
                    prompt: vec![4],
                    samples: vec![(RequestKey(5), params(5, 2)), (RequestKey(6), params(6, 2))],
                };
                match be.add_group(g.clone()).map_err(BackendError::into_rejected) {
                    Err(Ok(Rejected::Group(r))) => assert_eq!(r, g),
                    other => panic!("expected the group back, got {other:?}"),
                }
                assert!(matches!(
                    be.add_request(request(0, vec![3], 1)),
                    Err(BackendError::DuplicateRequest(_))
                ));
                assert_eq!(be.active_requests(), 1);
                be.cancel_request(RequestKey(0)).unwrap();
                assert_eq!(be.load(), EngineLoad::default());
            }

            #[test]
            fn submit_poll_takes_adds_and_cancels_while_a_step_runs() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 3));
                let (Some(mut sync), Some(mut be)) = (make(&c, &w), make(&c, &w)) else {
                    return;
                };
                let want = engine::overlap_reference(sync.as_mut());
                engine::overlap_start(be.as_mut());
                let mut got: BTreeMap<u64, GenOutput> = BTreeMap::new();
                loop {
                    if let Some(out) = be.poll_step(false).unwrap() {
                        got.extend(out.into_iter().map(|o| (o.id.0, o)));
                        if be.active_requests() == 0 {
                            break;
                        }
                        be.submit_step().unwrap();
                    }
                }
                assert_same_outputs(&got, &want);
            }

            #[test]
            fn an_exported_request_resumes_with_the_same_bits() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 4));
                let (Some(mut a), Some(mut b), Some(mut whole)) =
                    (make(&c, &w), make(&c, &w), make(&c, &w))
                else {
                    return;
                };
                let req = request(7, prompt(20, 5), 12);
                let want = drain({
                    whole.add_request(req.clone()).unwrap();
                    whole.as_mut()
                });
                a.add_request(req).unwrap();
                for _ in 0..4 {
                    assert!(a.decode_step().unwrap().is_empty());
                }
                let st = a.export_request(RequestKey(7)).expect("export");
                assert_eq!(st.tokens.len(), 4);
                assert_eq!(a.load(), EngineLoad::default());
                b.resume_request(st).expect("resume");
                let got = drain(b.as_mut());
                assert_same_output(7, &got[&7], &want[&7]);
            }

            #[test]
            fn optimizer_state_round_trips_through_a_checkpoint() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 5));
                let (Some(mut a), Some(mut b)) = (make(&c, &w), make(&c, &w)) else {
                    return;
                };
                let seq =
                    TrainSequence::new(vec![1, 2, 3], vec![4, 5], 0.7, Aggregation::TokenMean);
                let batch = TrainBatch {
                    sequences: vec![seq],
                };
                let step = |be: &mut dyn Policy| {
                    be.zero_grad().unwrap();
                    let st = be.accumulate(&batch, &Objective::default()).unwrap();
                    be.optimizer_step(st.tokens as f64, &AdamW::default())
                        .unwrap()
                };
                step(a.as_mut());
                let state = a.checkpoint_optimizer().unwrap();
                assert_eq!(state.step, 1);
                b.import_weights(&a.export_weights().unwrap()).unwrap();
                b.restore_optimizer(state.clone()).unwrap();
                assert_eq!(b.checkpoint_optimizer().unwrap(), state);
                // The next step from the restored state equals the uninterrupted one.
                let (sa, sb) = (step(a.as_mut()), step(b.as_mut()));
                assert_eq!(sa, sb);
                assert_eq!(a.export_weights().unwrap(), b.export_weights().unwrap());
            }

            #[test]
            fn scoring_and_decoding_are_batch_invariant() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 6));
                let (Some(mut be), Some(mut other)) = (make(&c, &w), make(&c, &w)) else {
                    return;
                };
                let seqs: Vec<Sequence> = (0..4)
                    .map(|i| Sequence {
                        prompt: prompt(3 + 5 * i, i as u32),
                        response: prompt(2 + 3 * i, 9 + i as u32),
                    })
                    .collect();
                let batch = be.logprobs(&seqs, 0.8).unwrap();
                for (i, s) in seqs.iter().enumerate() {
                    let one = be.logprobs(std::slice::from_ref(s), 0.8).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&one[0]), bits(&batch[i]), "sequence {i}");
                }
                let reqs: Vec<GenRequest> = (0..4)
                    .map(|i| request(i, prompt(2 + 7 * i as usize, 1), 6))
                    .collect();
                let together = engine::generate(be.as_mut(), &reqs);
                for (i, r) in reqs.iter().enumerate() {
                    let alone = engine::generate(other.as_mut(), std::slice::from_ref(r));
                    assert_same_output(i as u64, &alone[0], &together[i]);
                }
            }

            #[test]
            fn look_ahead_gives_the_same_bits_or_is_refused() {
                let (c, w) = (cfg(), peaked_weights(&cfg(), 7));
                let (Some(mut plain), Some(mut ahead)) = (make(&c, &w), make(&c, &w)) else {
                    return;
                };
                assert_eq!(ahead.admission_lag(), 0);
                let on = ahead.set_lookahead(true);
                if !EXPECT.lookahead {
                    assert!(
                        matches!(on, Err(BackendError::Unsupported { .. })),
                        "{on:?}"
                    );
                    assert_eq!(ahead.admission_lag(), 0);
                    ahead.set_lookahead(false).expect("off is always accepted");
                    return;
                }
                on.expect("look-ahead");
                assert_eq!(ahead.admission_lag(), 1);
                let reqs: Vec<GenRequest> = (0..3)
                    .map(|i| request(i, prompt(4 + 9 * i as usize, 2), 7))
                    .collect();
                let want = engine::generate(plain.as_mut(), &reqs);
                let got = engine::generate(ahead.as_mut(), &reqs);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_same_output(i as u64, g, w);
                }
            }
        }
    };
}

engine_suite!(
    cpu,
    |cfg, w| Some(Box::new(CpuBackend::new(cfg, w, 2).expect("cpu"))),
    Expect { lookahead: false }
);

#[cfg(feature = "wgpu")]
#[path = "support/device.rs"]
mod device;

#[cfg(feature = "wgpu")]
engine_suite!(
    wgpu,
    |cfg, w| {
        let g = device::gpu()?;
        let be = rolloutpipe_backends::wgpu::WgpuBackend::with_gpu(g, cfg, w).expect("wgpu");
        Some(Box::new(be))
    },
    Expect { lookahead: true }
);

#[cfg(feature = "cuda")]
#[path = "support/cuda_device.rs"]
mod cuda_device;

#[cfg(feature = "cuda")]
engine_suite!(
    cuda,
    |cfg, w| {
        let c = cuda_device::cuda()?;
        let be = rolloutpipe_backends::cuda::CudaBackend::with_cuda(c, cfg, w).expect("cuda");
        Some(Box::new(be))
    },
    Expect { lookahead: false }
);
