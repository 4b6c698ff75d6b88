//! Conformance of every backend against the CPU reference (issue 6).
//!
//! Two layers, as llm.c's `test_gpt2.c` and burn's backend suite:
//! - **ops**: one suite (`support/op_tests.rs`) written against the backend-neutral
//!   [`support::ops::OpRunner`] and instantiated per backend with `op_suite!`; every op on
//!   fresh seeded random inputs (never zeros) at several sizes, including sizes that are not
//!   multiples of the tiles and workgroups and the multi-chunk paths (attention over more
//!   than 64 keys), against its `cpu::ops` twin. A new backend implements `OpRunner` and adds
//!   one `op_suite!` line;
//! - **the backend**: one suite body (`backend_suite!`) instantiated per backend — logits,
//!   log-probs, a whole GRPO step (loss sums, every gradient, the updated weights) and
//!   generation with the same seeds — each compared with a fresh `CpuBackend`.
//!
//! Every comparison is `|got − want| <= atol + rtol·|want|` with the entry of [`tol`] that
//! names why the two differ; the first mismatches are printed before the assertion fails.
//!
//! Without a wgpu adapter the wgpu tests print `SKIP` and pass, unless
//! `ROLLOUTPIPE_REQUIRE_GPU=1` (set by CI, which installs lavapipe) turns the skip into a
//! failure. The CUDA instances (`--features cuda`) do the same without a CUDA device, unless
//! `ROLLOUTPIPE_REQUIRE_CUDA=1` (set by `scripts/device/cuda.sh`).

mod support;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rolloutpipe_backends::*;
#[cfg(feature = "cuda")]
use support::check::assert_close_dot;
use support::check::{assert_can_fail, assert_close, rand_ids, rand_vec, tol};
#[cfg(feature = "wgpu")]
use support::device;
use support::ops::CpuOps;
#[cfg(feature = "cuda")]
use support::ops_cuda::CudaOps;
#[cfg(feature = "wgpu")]
use support::ops_wgpu::WgpuOps;

// The op-level suite: the CPU instance checks the `OpRunner` adapter itself (packing,
// accumulation, sums); the wgpu one checks every kernel.
op_suite!(cpu_ops, CpuOps::new());
#[cfg(feature = "wgpu")]
op_suite!(wgpu_ops, WgpuOps::new());
#[cfg(feature = "cuda")]
op_suite!(cuda_ops, CudaOps::new());

/// An optimizer step's gradient norm and clip scale agree with the reference's (both are
/// reductions over every gradient).
fn assert_stats_close(
    got: &rolloutpipe_backends::optim::OptStats,
    want: &rolloutpipe_backends::optim::OptStats,
) {
    assert_eq!(got.step, want.step);
    let pair =
        |s: &rolloutpipe_backends::optim::OptStats| [s.grad_norm as f32, s.clip_scale as f32];
    assert_close(
        "grad_norm, clip_scale",
        &pair(got),
        &pair(want),
        tol::REDUCTION,
    );
}

/// Weights with some spread (the default init's std 0.02 makes every logit ~0, which would
/// hide errors): matrices ×5, norm weights 1 ± 0.3.
fn test_weights(cfg: &ModelConfig, seed: u64) -> Weights {
    let mut w = Weights::random(cfg, seed).expect("random weights");
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    for (name, t) in w.tensors.iter_mut() {
        if name.contains("norm") {
            t.data = rand_vec(&mut rng, t.data.len(), 0.3)
                .iter()
                .map(|x| 1.0 + x)
                .collect();
        } else {
            t.data.iter_mut().for_each(|x| *x *= 5.0);
        }
    }
    w
}

/// The model sizes every backend test runs at: the tiny test model (untied, head_dim 4)
/// and the default small model (tied, head_dim 32, 4 layers), plus whether sequences longer
/// than one 64-key attention chunk fit its position limit.
fn configs() -> Vec<(ModelConfig, bool)> {
    vec![(ModelConfig::tiny(), false), (ModelConfig::small(), true)]
}

/// Random `(prompt, response)` lengths, with one long sequence when allowed.
fn random_seqs(
    rng: &mut ChaCha8Rng,
    cfg: &ModelConfig,
    k: usize,
    long: bool,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..k)
        .map(|i| {
            let (pl, rl) = if long && i == 0 {
                (40, 31)
            } else {
                (
                    2 + (rng.next_u64() % 7) as usize,
                    1 + (rng.next_u64() % 12) as usize,
                )
            };
            (
                rand_ids(rng, pl, cfg.vocab_size),
                rand_ids(rng, rl, cfg.vocab_size),
            )
        })
        .collect()
}

/// One suite body per backend: each test builds the backend under test and a fresh CPU
/// reference from the same weights and compares them. The CPU instantiation checks the
/// suite itself (it must pass against its own reference).
macro_rules! backend_suite {
    ($name:ident, $make:expr) => {
        backend_suite!($name, $make, configs(), ModelConfig::tiny());
    };
    // `$configs`: the model sizes (default `configs()`); `$small`: the model of the seam and
    // error tests (default the tiny model). A backend whose kernels need other head dims
    // passes its own.
    ($name:ident, $make:expr, $configs:expr, $small:expr) => {
        mod $name {
            use super::*;

            fn make(cfg: &ModelConfig, w: &Weights) -> Option<Box<dyn Policy>> {
                let f: fn(&ModelConfig, &Weights) -> Option<Box<dyn Policy>> = $make;
                f(cfg, w)
            }

            fn reference(cfg: &ModelConfig, w: &Weights) -> CpuBackend {
                CpuBackend::new(cfg, w, 1).expect("cpu reference")
            }

            /// Engine- and trainer-level seam v2 checks: a group matches the CPU's independent
            /// requests, a full engine hands the request back, submit/poll completes a step,
            /// and a trainer-to-engine sync of this backend equals the trainer's weights and
            /// takes the same-device path (CPU: host; wgpu: the suite's one shared device).
            #[test]
            fn seam_groups_limits_submit_poll_and_sync() {
                let cfg = $small;
                let w = test_weights(&cfg, 77);
                let Some(mut be) = make(&cfg, &w) else { return };
                let mut cpu = reference(&cfg, &w);
                let prompt = vec![1u32, 5, 2, 7];
                let samples: Vec<_> = (0..3u64)
                    .map(|i| {
                        let p = SamplingParams {
                            temperature: 0.8,
                            max_new_tokens: 3 + i as usize,
                            seed: 40 + i,
                            ..Default::default()
                        };
                        (RequestKey(i), p)
                    })
                    .collect();
                let group = GroupRequest {
                    prompt: prompt.clone(),
                    samples,
                };
                for r in group.clone().into_requests() {
                    cpu.add_request(r).expect("cpu add");
                }
                be.add_group(group).expect("add_group");
                assert_eq!(be.active_requests(), 3);
                let mut want = std::collections::BTreeMap::new();
                while cpu.active_requests() > 0 {
                    for o in cpu.decode_step().expect("cpu step") {
                        want.insert(o.id.0, o.tokens);
                    }
                }
                let mut got = std::collections::BTreeMap::new();
                while be.active_requests() > 0 {
                    be.submit_step().expect("submit");
                    for o in be.poll_step(true).expect("poll").expect("waited") {
                        got.insert(o.id.0, o.tokens);
                    }
                }
                assert_eq!(got, want, "group tokens against independent CPU requests");

                be.set_limits(EngineLimits {
                    max_requests: 1,
                    max_kv_tokens: 100,
                })
                .expect("limits");
                let req = |id| GenRequest {
                    id: RequestKey(id),
                    prompt: vec![1],
                    params: SamplingParams {
                        max_new_tokens: 8,
                        ..Default::default()
                    },
                };
                be.add_request(req(10)).expect("first fits");
                match be.add_request(req(11)).map_err(BackendError::into_rejected) {
                    Err(Ok(Rejected::Request(r))) => assert_eq!(r.id, RequestKey(11)),
                    other => panic!("expected the request handed back, got {other:?}"),
                }
                be.cancel_request(RequestKey(10)).expect("cancel");

                let Some(mut engine) = make(&cfg, &test_weights(&cfg, 78)) else {
                    return;
                };
                let seq = TrainSequence::new(vec![1, 2], vec![3, 4], 1.0, Aggregation::TokenMean);
                let batch = TrainBatch {
                    sequences: vec![seq],
                };
                be.zero_grad().unwrap();
                be.accumulate(&batch, &Objective::default())
                    .expect("accumulate");
                be.optimizer_step(2.0, &AdamW::default()).expect("step");
                let path = be.sync_to(engine.as_mut()).expect("sync");
                assert_eq!(path, SyncPath::SameDevice);
                assert_eq!(
                    engine.export_weights().expect("engine weights"),
                    be.export_weights().expect("trainer weights")
                );
                // The host path gives the same weights to a CPU engine.
                let snap = be
                    .snapshot_weights(cpu.sync_target())
                    .expect("host snapshot");
                let expect = if be.device() == DeviceId::Host {
                    SyncPath::SameDevice
                } else {
                    SyncPath::Host
                };
                assert_eq!(cpu.load_weights(&snap).expect("load"), expect);
                assert_eq!(cpu.export_weights().unwrap(), be.export_weights().unwrap());
            }

            #[test]
            fn logits_and_logprobs_match_cpu() {
                for (seed, (cfg, long)) in $configs.into_iter().enumerate() {
                    let w = test_weights(&cfg, seed as u64 + 1);
                    let Some(mut be) = make(&cfg, &w) else { return };
                    let mut cpu = reference(&cfg, &w);
                    let mut rng = ChaCha8Rng::seed_from_u64(100 + seed as u64);
                    let ids = rand_ids(&mut rng, if long { 70 } else { 9 }, cfg.vocab_size);
                    let (got, want) = (
                        be.logits(&ids).expect("logits"),
                        cpu.logits(&ids).expect("cpu logits"),
                    );
                    assert_close("logits", &got, &want, tol::MODEL);
                    assert_can_fail("logits", &want, tol::MODEL);
                    let seqs: Vec<Sequence> = random_seqs(&mut rng, &cfg, 5, long)
                        .into_iter()
                        .map(|(prompt, response)| Sequence { prompt, response })
                        .collect();
                    for temp in [1.0f32, 0.7] {
                        let got = be.logprobs(&seqs, temp).expect("logprobs");
                        let want = cpu.logprobs(&seqs, temp).expect("cpu logprobs");
                        for (g, w) in got.iter().zip(&want) {
                            assert_close("logprobs", g, w, tol::MODEL);
                        }
                    }
                }
            }

            #[test]
            fn grpo_step_matches_cpu() {
                for (seed, (cfg, long)) in $configs.into_iter().enumerate() {
                    let w = test_weights(&cfg, 10 + seed as u64);
                    let Some(mut be) = make(&cfg, &w) else { return };
                    let mut cpu = reference(&cfg, &w);
                    let mut rng = ChaCha8Rng::seed_from_u64(200 + seed as u64);
                    // Two micro-batches; some sequences carry rollout and reference log-probs
                    // (perturbed so that ρ ≠ 1 and both clip branches occur), others use the
                    // current weights' (ρ = 1, no KL).
                    let mut batches = Vec::new();
                    for b in 0..2 {
                        let seqs = random_seqs(&mut rng, &cfg, 4, long && b == 0);
                        let pairs: Vec<Sequence> = seqs
                            .iter()
                            .map(|(p, r)| Sequence {
                                prompt: p.clone(),
                                response: r.clone(),
                            })
                            .collect();
                        let cur = cpu.logprobs(&pairs, 1.0).expect("current logprobs");
                        let sequences = seqs
                            .into_iter()
                            .zip(cur)
                            .enumerate()
                            .map(|(i, ((prompt, response), lp))| {
                                let adv = rand_vec(&mut rng, 1, 1.5)[0] as f64;
                                let mut s = TrainSequence::new(
                                    prompt,
                                    response,
                                    adv,
                                    Aggregation::TokenMean,
                                );
                                let noise = rand_vec(&mut rng, lp.len(), 0.4);
                                if i % 2 == 0 {
                                    s.old_logprobs = Some(
                                        lp.iter()
                                            .zip(&noise)
                                            .map(|(l, n)| (l + n).min(0.0))
                                            .collect(),
                                    );
                                }
                                if i % 3 != 2 {
                                    s.ref_logprobs = Some(
                                        lp.iter()
                                            .zip(&noise)
                                            .map(|(l, n)| (l - 0.5 * n).min(0.0))
                                            .collect(),
                                    );
                                }
                                s
                            })
                            .collect();
                        batches.push(TrainBatch { sequences });
                    }
                    let obj = Objective::Grpo {
                        eps_low: 0.2,
                        eps_high: 0.28,
                        beta: 0.04,
                        temperature: 1.0,
                    };
                    be.zero_grad().unwrap();
                    cpu.zero_grad().unwrap();
                    for batch in &batches {
                        let g = be.accumulate(batch, &obj).expect("accumulate");
                        let c = cpu.accumulate(batch, &obj).expect("cpu accumulate");
                        assert_eq!((g.tokens, g.sequences), (c.tokens, c.sequences));
                        // Sums over ~30-100 tokens of quantities computed from MODEL-accurate
                        // log-probs: their errors add up, hence a looser absolute part.
                        let sums = tol::Tol(1e-3, 1e-3);
                        assert_close("loss_sum", &[g.loss_sum as f32], &[c.loss_sum as f32], sums);
                        assert_close("kl_sum", &[g.kl_sum as f32], &[c.kl_sum as f32], sums);
                        assert_close(
                            "entropy_sum",
                            &[g.entropy_sum as f32],
                            &[c.entropy_sum as f32],
                            sums,
                        );
                        // A token flips branch only if ρ sits within ~1e-4 of 1 ± ε.
                        assert!(
                            g.clipped.abs_diff(c.clipped) <= 1,
                            "clipped {} vs {}",
                            g.clipped,
                            c.clipped
                        );
                    }
                    let (gg, cg) = (
                        be.gradients().expect("grads"),
                        cpu.gradients().expect("cpu grads"),
                    );
                    for (name, t) in &cg.tensors {
                        let what = format!("grad {name}");
                        assert_close(&what, &gg.tensors[name].data, &t.data, tol::GRAD);
                        assert_can_fail(&what, &t.data, tol::GRAD);
                    }
                    let opt = AdamW {
                        lr: 1e-3,
                        max_grad_norm: Some(0.5),
                        exclude_norms_from_decay: true,
                        ..Default::default()
                    };
                    let norm = normalizer(Aggregation::TokenMean, &batches);
                    let (gs, cs) = (
                        be.optimizer_step(norm, &opt).expect("step"),
                        cpu.optimizer_step(norm, &opt).expect("cpu step"),
                    );
                    assert_eq!(gs.step, cs.step);
                    assert_stats_close(&gs, &cs);
                    let (gw, cw) = (
                        be.export_weights().expect("weights"),
                        cpu.export_weights().expect("cpu weights"),
                    );
                    for (name, t) in &cw.tensors {
                        let g = &cg.tensors[name].data;
                        // Adam's first step is lr·g/(|g| + eps): where the reference gradient is
                        // within the gradient tolerance of zero its sign (and so the step, up to
                        // ±lr) is not determined by f32 arithmetic; elsewhere STEP applies.
                        for (i, (gv, cv)) in gw.tensors[name].data.iter().zip(&t.data).enumerate() {
                            let gtol = tol::GRAD.0 + tol::GRAD.1 * g[i].abs();
                            let slack = if g[i].abs() <= gtol {
                                2.0 * opt.lr as f32
                            } else {
                                0.0
                            };
                            let lim = tol::STEP.0 + tol::STEP.1 * cv.abs() + slack;
                            assert!(
                                (gv - cv).abs() <= lim,
                                "weight {name}[{i}]: {gv} vs {cv} (grad {}, limit {lim:e})",
                                g[i]
                            );
                        }
                    }
                }
            }

            #[test]
            fn generation_matches_cpu_tokens() {
                for (seed, (cfg, _)) in $configs.into_iter().enumerate() {
                    let w = test_weights(&cfg, 20 + seed as u64);
                    let Some(mut be) = make(&cfg, &w) else { return };
                    let mut cpu = reference(&cfg, &w);
                    let mut rng = ChaCha8Rng::seed_from_u64(300 + seed as u64);
                    let v = cfg.vocab_size;
                    let params = |i: u64| match i % 5 {
                        0 => SamplingParams {
                            temperature: 0.0,
                            ..Default::default()
                        },
                        1 => SamplingParams {
                            temperature: 1.0,
                            ..Default::default()
                        },
                        2 => SamplingParams {
                            temperature: 0.8,
                            top_k: 4,
                            ..Default::default()
                        },
                        3 => SamplingParams {
                            temperature: 1.1,
                            top_p: 0.85,
                            ..Default::default()
                        },
                        _ => SamplingParams {
                            temperature: 0.9,
                            top_k: 6,
                            top_p: 0.9,
                            stop_tokens: vec![1, 2],
                            ..Default::default()
                        },
                    };
                    let reqs: Vec<GenRequest> = (0..20u64)
                        .map(|i| GenRequest {
                            id: RequestKey(i),
                            prompt: rand_ids(
                                &mut rng,
                                if i == 19 && cfg.max_position_embeddings >= 128 {
                                    70
                                } else {
                                    2 + (i % 5) as usize
                                },
                                v,
                            ),
                            params: SamplingParams {
                                max_new_tokens: 6 + (i % 4) as usize * 3,
                                seed: 1000 + i,
                                ..params(i)
                            },
                        })
                        .collect();
                    // Continuous batching: 6 join, 2 steps run, 14 more join and one leaves. On
                    // wgpu the joins grow the paged KV pool (16 pages at first, doubled while
                    // requests are mid-generation, the pool copied) and the cancel frees pages.
                    let run = |b: &mut dyn Policy| {
                        let mut done = Vec::new();
                        for r in &reqs[..6] {
                            b.add_request(r.clone()).expect("add");
                        }
                        for _ in 0..2 {
                            done.extend(b.decode_step().expect("step"));
                        }
                        for r in &reqs[6..] {
                            b.add_request(r.clone()).expect("add");
                        }
                        b.cancel_request(RequestKey(3)).expect("cancel");
                        while b.active_requests() > 0 {
                            done.extend(b.decode_step().expect("step"));
                        }
                        done.sort_by_key(|o: &GenOutput| o.id);
                        done
                    };
                    let (got, want) = (run(be.as_mut()), run(&mut cpu));
                    assert_eq!(got.len(), want.len());
                    for (g, c) in got.iter().zip(&want) {
                        // Tokens can only differ where a draw lands within ~1e-5 of a
                        // cumulative boundary (see sample_matches_cpu_draws): with these
                        // fixed seeds none does, so any difference here is a bug.
                        assert_eq!(
                            (g.id, &g.tokens, g.finish),
                            (c.id, &c.tokens, c.finish),
                            "request {}",
                            c.id
                        );
                        assert_close(
                            &format!("logprobs of {}", c.id),
                            &g.logprobs,
                            &c.logprobs,
                            tol::MODEL,
                        );
                    }
                }
            }

            #[test]
            fn bad_input_is_a_typed_error() {
                let cfg = $small;
                let w = test_weights(&cfg, 5);
                let Some(mut be) = make(&cfg, &w) else { return };
                let bad_tok = cfg.vocab_size as u32;
                let r = be.logits(&[0, bad_tok]);
                assert!(matches!(r, Err(BackendError::UnknownToken { .. })), "{r:?}");
                assert!(matches!(
                    be.logprobs(&[], 1.0),
                    Err(BackendError::EmptyBatch(_))
                ));
                let mut s =
                    TrainSequence::new(vec![1, 2], vec![3], f64::NAN, Aggregation::TokenMean);
                let r = be.accumulate(
                    &TrainBatch {
                        sequences: vec![s.clone()],
                    },
                    &Objective::default(),
                );
                assert!(matches!(r, Err(BackendError::NonFinite { .. })), "{r:?}");
                s.advantage = 1.0;
                s.old_logprobs = Some(vec![-1.0, -2.0]);
                let r = be.accumulate(&TrainBatch { sequences: vec![s] }, &Objective::default());
                assert!(matches!(r, Err(BackendError::Shape { .. })), "{r:?}");
                assert!(matches!(
                    be.cancel_request(RequestKey(9)),
                    Err(BackendError::UnknownRequest(_))
                ));
                let params = SamplingParams {
                    max_new_tokens: 4,
                    ..Default::default()
                };
                let req = GenRequest {
                    id: RequestKey(1),
                    prompt: vec![1],
                    params,
                };
                be.add_request(req.clone()).expect("add");
                assert!(matches!(
                    be.add_request(req),
                    Err(BackendError::DuplicateRequest(_))
                ));
                assert!(matches!(
                    be.import_weights(&w),
                    Err(BackendError::InvalidArgument { .. })
                ));
                assert!(matches!(
                    be.optimizer_step(0.0, &AdamW::default()),
                    Err(BackendError::InvalidArgument { .. })
                ));
            }
        }
    };
}

backend_suite!(cpu_reference, |cfg, w| Some(
    Box::new(CpuBackend::new(cfg, w, 1).expect("cpu")) as Box<dyn Policy>
));

#[cfg(feature = "wgpu")]
backend_suite!(wgpu_backend, |cfg, w| {
    device::gpu().map(|g| {
        Box::new(
            rolloutpipe_backends::wgpu::WgpuBackend::with_gpu(g, cfg, w).expect("wgpu backend"),
        ) as Box<dyn Policy>
    })
});

/// The wgpu backend's optimizer state (for checkpoints) matches the CPU's after a step and
/// survives a round trip.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_optimizer_state_matches_cpu_and_round_trips() {
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig::tiny();
    let w = test_weights(&cfg, 42);
    let mut be = rolloutpipe_backends::wgpu::WgpuBackend::with_gpu(g, &cfg, &w).expect("wgpu");
    let mut cpu = CpuBackend::new(&cfg, &w, 1).expect("cpu");
    assert_eq!(be.optimizer_state().expect("state").step, 0);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let sequences = random_seqs(&mut rng, &cfg, 3, false)
        .into_iter()
        .enumerate()
        .map(|(i, (p, r))| {
            TrainSequence::new(
                p,
                r,
                if i % 2 == 0 { 1.0 } else { -0.5 },
                Aggregation::TokenMean,
            )
        })
        .collect();
    let batch = TrainBatch { sequences };
    let opt = AdamW::default();
    let norm = normalizer(Aggregation::TokenMean, std::slice::from_ref(&batch));
    for b in [&mut be as &mut dyn Policy, &mut cpu] {
        b.zero_grad().unwrap();
        b.accumulate(&batch, &Objective::default())
            .expect("accumulate");
        b.optimizer_step(norm, &opt).expect("step");
    }
    let (gs, cs) = (
        be.optimizer_state().expect("state"),
        cpu.optimizer_state().clone(),
    );
    assert_eq!(gs.step, cs.step);
    // Moments of GRAD-accurate gradients (see ADAM_M, ADAM_V).
    assert_close("adam m", &gs.m, &cs.m, tol::ADAM_M);
    assert_close("adam v", &gs.v, &cs.v, tol::ADAM_V);
    be.set_optimizer_state(cs.clone()).expect("set");
    let back = be.optimizer_state().expect("state");
    assert_eq!((back.step, &back.m, &back.v), (cs.step, &cs.m, &cs.v));
    let bad = rolloutpipe_backends::optim::AdamState {
        m: vec![0.0; 3],
        v: vec![0.0; 3],
        step: 1,
    };
    assert!(matches!(
        be.set_optimizer_state(bad),
        Err(BackendError::Shape { .. })
    ));
}

/// Tensors above the storage-binding limit run in chunks: the embedding and lm_head ops by
/// rows, AdamW and the gradient norm elementwise from 256-byte-aligned offsets. A backend
/// capped at 4 KiB bindings (every tensor of the small model but the norms is split) takes the
/// same GRPO step as an uncapped one: log-probs, gradients, the grad norm and the updated
/// weights agree (an ignored chunk offset would leave most of each tensor un-stepped). Its
/// reads back are batched small too, so the batched read-back is checked on the same values.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_chunked_bindings_match_unchunked() {
    use rolloutpipe_backends::wgpu::WgpuBackend;
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig::small();
    let w = test_weights(&cfg, 77);
    let mut whole = WgpuBackend::with_gpu(std::sync::Arc::clone(&g), &cfg, &w).expect("wgpu");
    let mut split = WgpuBackend::with_gpu(g, &cfg, &w).expect("wgpu");
    split.cap_storage_binding(4096).expect("cap");
    // Whole-tensor reads (gradients, weights) in submissions of at most 64 KiB: several
    // tensors per submission, and the larger ones alone.
    split.cap_read_batch(64 << 10).expect("read cap");
    assert!(split.cap_read_batch(0).is_err());
    for bad in [0, 100, 4097] {
        assert!(
            matches!(
                split.cap_storage_binding(bad),
                Err(BackendError::InvalidArgument { .. })
            ),
            "cap {bad}"
        );
    }
    let mut rng = ChaCha8Rng::seed_from_u64(71);
    let seqs = random_seqs(&mut rng, &cfg, 4, true);
    let pairs: Vec<Sequence> = seqs
        .iter()
        .map(|(p, r)| Sequence {
            prompt: p.clone(),
            response: r.clone(),
        })
        .collect();
    let (lw, ls) = (
        whole.logprobs(&pairs, 1.0).expect("logprobs"),
        split.logprobs(&pairs, 1.0).expect("logprobs"),
    );
    for (a, b) in lw.iter().zip(&ls) {
        assert_close("logprobs", b, a, tol::REDUCTION);
    }
    let sequences = seqs
        .into_iter()
        .enumerate()
        .map(|(i, (p, r))| {
            TrainSequence::new(
                p,
                r,
                [1.0, -0.5, 0.75, -1.25][i % 4],
                Aggregation::TokenMean,
            )
        })
        .collect();
    let batch = TrainBatch { sequences };
    let norm = normalizer(Aggregation::TokenMean, std::slice::from_ref(&batch));
    let opt = AdamW {
        lr: 1e-2,
        max_grad_norm: Some(0.5),
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut stats = Vec::new();
    for be in [&mut whole, &mut split] {
        be.zero_grad().unwrap();
        be.accumulate(&batch, &Objective::default())
            .expect("accumulate");
        let grads = be.gradients().expect("grads");
        stats.push((grads, be.optimizer_step(norm, &opt).expect("step")));
    }
    let ((gw, sw), (gs, ss)) = (&stats[0], &stats[1]);
    for (name, t) in &gw.tensors {
        assert_close(
            &format!("grad {name}"),
            &gs.tensors[name].data,
            &t.data,
            tol::REDUCTION,
        );
    }
    assert_stats_close(ss, sw);
    assert!(
        sw.clip_scale < 1.0,
        "the norm clips, so every partial counts"
    );
    // The chunked AdamW against the host's, on the capped backend's own gradients (the
    // lm_head backward sums its vocabulary chunks in another order, so the two backends'
    // gradients differ in the last bits, and Adam's first step, lr·g/(|g| + eps), turns
    // that into ±lr where a gradient is near zero).
    let names: Vec<&String> = w.tensors.keys().collect();
    let flat = |ws: &Weights| -> Vec<f32> {
        names
            .iter()
            .flat_map(|n| ws.tensors[*n].data.iter().copied())
            .collect()
    };
    let mut want = flat(&w);
    let groups = [rolloutpipe_backends::optim::ParamGroup {
        offset: 0,
        len: want.len(),
        decay: true,
    }];
    let mut state = rolloutpipe_backends::optim::AdamState::default();
    let host = rolloutpipe_backends::cpu::optim::step(
        &mut want,
        &flat(gs),
        &mut state,
        &groups,
        norm,
        &opt,
    )
    .expect("host step");
    assert_stats_close(ss, &host);
    let got = flat(&split.export_weights().expect("weights"));
    let moved = got.iter().zip(&flat(&w)).filter(|(a, b)| a != b).count();
    assert!(
        moved * 10 >= got.len() * 9,
        "the step moves {moved} of {} weights",
        got.len()
    );
    assert_close("weights after the chunked AdamW", &got, &want, tol::ADAMW);
}

/// The fused lm_head (`wgpu::lm_head`) against the CPU reference's (`cpu::lm_head`), per
/// element: log-probs, entropies and log-sum-exps, the hidden states' gradient and
/// lm_head's. At 4 KiB bindings the plan is 256-token chunks and 64-row blocks, so a
/// 700-token vocabulary spans three chunks (the last one 188 wide, holding target 699 and
/// others) and 100 scored rows two blocks; uncapped the vocabulary is one chunk.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_lm_head_matches_cpu_across_chunks() {
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig {
        vocab_size: 700,
        num_hidden_layers: 1,
        tie_word_embeddings: false,
        ..ModelConfig::small()
    };
    for cap in [None, Some(4096)] {
        fused_lm_head_case(&g, &cfg, 100, cap, cap.is_some());
    }
}

/// The same at Qwen3-0.6B's lm_head (151,936 × 1,024: 622 MB, above a 128 MiB binding
/// limit, so every chunk must bind only its window of W), 3 rows; opt-in with the other
/// production shapes (`ROLLOUTPIPE_PROD_SHAPES=1`).
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_lm_head_matches_cpu_at_qwen3_vocab() {
    if !std::env::var("ROLLOUTPIPE_PROD_SHAPES").is_ok_and(|v| v == "1") {
        eprintln!(
            "wgpu_fused_lm_head_matches_cpu_at_qwen3_vocab: skipped (ROLLOUTPIPE_PROD_SHAPES)"
        );
        return;
    }
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig {
        vocab_size: 151_936,
        hidden_size: 1024,
        intermediate_size: 64,
        num_hidden_layers: 1,
        tie_word_embeddings: true,
        ..ModelConfig::small()
    };
    fused_lm_head_case(&g, &cfg, 3, None, true);
}

/// One comparison of [`wgpu_fused_lm_head_matches_cpu_across_chunks`]: `m` rows, the
/// backend's bindings capped at `cap` bytes, and whether the plan must split the vocabulary.
#[cfg(feature = "wgpu")]
fn fused_lm_head_case(
    g: &std::sync::Arc<rolloutpipe_backends::wgpu::Gpu>,
    cfg: &ModelConfig,
    m: usize,
    cap: Option<usize>,
    split: bool,
) {
    use rolloutpipe_backends::cpu::lm_head::{lm_head_logprob_bwd, lm_head_logprob_fwd};
    use rolloutpipe_backends::model::Layout;
    use rolloutpipe_backends::wgpu::Exec;
    use rolloutpipe_backends::wgpu::lm_head::{LmHead, LmPlan};
    use rolloutpipe_backends::wgpu::model::DeviceModel;
    use rolloutpipe_backends::wgpu::ops::LogprobBufs;
    let (d, v, temp) = (cfg.hidden_size, cfg.vocab_size, 0.7);
    let layout = Layout::new(cfg);
    let mut rng = ChaCha8Rng::seed_from_u64(91);
    let flat = rand_vec(&mut rng, layout.total, 0.5);
    let w = flat[layout.range(layout.ids.lm_head)].to_vec();
    let x = rand_vec(&mut rng, m * d, 2.0);
    let dlogp = rand_vec(&mut rng, m, 1.0);
    let mut targets = rand_ids(&mut rng, m, v);
    for (r, t) in targets.iter_mut().enumerate().take(12) {
        *t = (v - 1 - 17 * r) as u32; // the last chunk, its last token first
    }
    let (mut lp, mut ent, mut lse) = (vec![0.0f32; m], vec![0.0; m], vec![0.0; m]);
    let mut scratch = Vec::new();
    lm_head_logprob_fwd(
        &mut lp,
        &mut ent,
        &mut lse,
        &x,
        &w,
        &targets,
        m,
        d,
        v,
        temp,
        &mut scratch,
    );
    let (mut dx, mut dw) = (vec![0.0f32; m * d], vec![0.0; v * d]);
    lm_head_logprob_bwd(
        &mut dx,
        &mut dw,
        &dlogp,
        &x,
        &w,
        &targets,
        &lse,
        m,
        d,
        v,
        temp,
        &mut scratch,
    );
    drop(scratch);
    let mut ex = Exec::new(std::sync::Arc::clone(g));
    if let Some(c) = cap {
        ex.cap_binding(c);
    }
    let plan = LmPlan::new(ex.binding_limit());
    let chunks = v.div_ceil(plan.chunk);
    assert_eq!(chunks > 1, split, "{plan:?}");
    let md = DeviceModel::new(
        g,
        cfg,
        layout,
        &flat,
        rolloutpipe_kernels::WeightFormat::F32,
    )
    .expect("model");
    drop(flat);
    let b = |name: &str, len: usize| g.buffer(name, len);
    let (hsel, dhsel, tb, dlb) = (
        b("x", m * d),
        b("dx", m * d),
        b("targets", m),
        b("dlogp", m),
    );
    let (logp, entropy, lse_b, state) = (
        b("logp", m),
        b("entropy", m),
        b("lse", m),
        b("state", 4 * m),
    );
    let scratch = b("lm_head chunk", plan.scratch_len(m));
    g.write(&hsel, &x);
    g.write(&tb, &targets);
    g.write(&dlb, &dlogp);
    let lm = md.layout.ids.lm_head.0;
    let (wb, dwb) = (&md.params[lm], &md.grads[lm]);
    let head = LmHead {
        w: wb,
        format: rolloutpipe_kernels::WeightFormat::F32,
        plan,
        d,
        v,
    };
    let out = LogprobBufs {
        state: &state,
        logp: &logp,
        entropy: &entropy,
        lse: &lse_b,
    };
    head.logprob_fwd(&mut ex, &scratch, out, &hsel, &tb, m, temp);
    head.logprob_bwd(
        &mut ex, &scratch, &dhsel, dwb, &dlb, &lse_b, &hsel, &tb, m, temp,
    );
    ex.submit().expect("submit");
    let get = |b: &::wgpu::Buffer, n: usize| g.read::<f32>(b, n).expect("read");
    let what = format!("{chunks} chunk(s) of {}", plan.chunk);
    // Vocabulary reductions in f32 trees against the reference's f64.
    assert_close(
        &format!("logp, {what}"),
        &get(&logp, m),
        &lp,
        tol::REDUCTION,
    );
    assert_close(
        &format!("entropy, {what}"),
        &get(&entropy, m),
        &ent,
        tol::REDUCTION,
    );
    assert_close(
        &format!("lse, {what}"),
        &get(&lse_b, m),
        &lse,
        tol::REDUCTION,
    );
    // dx sums v products per element, dW m (GRAD's per-element bound).
    assert_close(&format!("dx, {what}"), &get(&dhsel, m * d), &dx, tol::GRAD);
    let gw = get(&md.grads[lm], v * d);
    assert_close(&format!("dW, {what}"), &gw, &dw, tol::GRAD);
}

/// Scoring on wgpu is batch-invariant bit for bit: a sequence's log-probs are the same alone
/// as packed among others, because the fused lm_head reduces every row over the same
/// vocabulary chunks in the same order whatever the number of rows (checked with the
/// vocabulary in several chunks and the rows in several blocks).
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_scoring_is_batch_invariant() {
    use rolloutpipe_backends::wgpu::WgpuBackend;
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig {
        vocab_size: 700,
        ..ModelConfig::small()
    };
    let w = test_weights(&cfg, 93);
    let mut be = WgpuBackend::with_gpu(g, &cfg, &w).expect("wgpu");
    be.cap_storage_binding(4096).expect("cap");
    let mut rng = ChaCha8Rng::seed_from_u64(94);
    let seqs: Vec<Sequence> = (0..5)
        .map(|i| Sequence {
            prompt: rand_ids(&mut rng, 3 + 2 * i, cfg.vocab_size),
            response: rand_ids(&mut rng, 9 + 11 * i, cfg.vocab_size),
        })
        .collect();
    let together = be.logprobs(&seqs, 0.8).expect("logprobs");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (s, t) in seqs.iter().zip(&together) {
        let alone = be.logprobs(std::slice::from_ref(s), 0.8).expect("logprobs");
        assert_eq!(bits(&alone[0]), bits(t), "log-probs bit for bit");
    }
}

/// Decoding on wgpu is batch-invariant bit for bit: each request's tokens and log-probs are
/// the same alone (every decode product has one row: `matmul_fwd_gemv`) as among 11 others
/// (12 rows: the tiled GEMM of the `gemm` prelude), because both sum every output in the same
/// order. Prompts of different lengths make the joint prefill pack rows differently too.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_decoding_is_batch_invariant() {
    let Some(g) = device::gpu() else { return };
    let cfg = ModelConfig::small();
    let w = test_weights(&cfg, 31);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let reqs: Vec<GenRequest> = (0..12u64)
        .map(|i| GenRequest {
            id: RequestKey(i),
            prompt: rand_ids(&mut rng, 2 + (i as usize * 5) % 11, cfg.vocab_size),
            params: SamplingParams {
                temperature: 1.0,
                top_k: if i % 3 == 0 { 8 } else { 0 },
                top_p: if i % 2 == 0 { 0.9 } else { 1.0 },
                max_new_tokens: 8,
                seed: 500 + i,
                ..Default::default()
            },
        })
        .collect();
    let run = |reqs: &[GenRequest]| {
        let mut be =
            rolloutpipe_backends::wgpu::WgpuBackend::with_gpu(std::sync::Arc::clone(&g), &cfg, &w)
                .expect("wgpu");
        for r in reqs {
            be.add_request(r.clone()).expect("add");
        }
        let mut done = Vec::new();
        while be.active_requests() > 0 {
            done.extend(be.decode_step().expect("step"));
        }
        done
    };
    let together = run(&reqs);
    assert_eq!(together.len(), reqs.len());
    let mut distinct = std::collections::BTreeSet::new();
    for t in &together {
        let alone = run(std::slice::from_ref(&reqs[t.id.0 as usize]));
        assert_eq!(alone[0].tokens, t.tokens, "request {}", t.id);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&alone[0].logprobs),
            bits(&t.logprobs),
            "request {}: log-probs bit for bit",
            t.id
        );
        distinct.insert(t.tokens.clone());
    }
    assert!(
        distinct.len() > 6,
        "requests produce different continuations"
    );
}

/// The CUDA attention kernels take head dims 32, 64, 96 and 128: the CUDA instance runs the
/// tiny model with 32-wide heads (everything else as `ModelConfig::tiny`).
#[cfg(feature = "cuda")]
fn cuda_tiny() -> ModelConfig {
    ModelConfig {
        head_dim: 32,
        ..ModelConfig::tiny()
    }
}

#[cfg(feature = "cuda")]
backend_suite!(
    cuda_backend,
    |cfg, w| {
        support::ops_cuda::cuda().map(|c| {
            Box::new(
                rolloutpipe_backends::cuda::CudaBackend::with_cuda(c, cfg, w)
                    .expect("cuda backend"),
            ) as Box<dyn Policy>
        })
    },
    vec![(cuda_tiny(), false), (ModelConfig::small(), true)],
    cuda_tiny()
);

/// The tensor-core products (bf16 operands, f32 accumulation) against the CPU reference
/// on the same bf16-rounded operands, at widths that are multiples of 8 (their contract)
/// and token counts that are not multiples of the 64-row tile.
#[cfg(feature = "cuda")]
#[test]
fn cuda_tensor_core_matmul_matches_cpu_on_bf16_operands() {
    let Some(mut b) = CudaOps::new() else { return };
    let bf = |v: Vec<f32>| -> Vec<f32> {
        v.into_iter()
            .map(|x| half::bf16::from_f32(x).to_f32())
            .collect()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    for &(n, din, dout) in &[(1, 8, 8), (65, 136, 72), (200, 1024, 128), (7, 64, 3000)] {
        let x = bf(rand_vec(&mut rng, n * din, 1.0));
        let w = bf(rand_vec(&mut rng, dout * din, 1.0));
        let dy = bf(rand_vec(&mut rng, n * dout, 1.0));
        let (dx0, dw0) = (
            rand_vec(&mut rng, n * din, 1.0),
            rand_vec(&mut rng, dout * din, 1.0),
        );
        let mut y = vec![0.0; n * dout];
        cpu::ops::matmul_fwd(&mut y, &x, &w, n, din, dout);
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        cpu::ops::matmul_bwd(Some(&mut dx), &mut dw, &dy, &x, &w, n, din, dout);
        // The same sums over the terms' absolute values: each element's own error scale.
        let ab = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
        let mut ay = vec![0.0; n * dout];
        cpu::ops::matmul_fwd(&mut ay, &ab(&x), &ab(&w), n, din, dout);
        let (mut adx, mut adw) = (ab(&dx0), ab(&dw0));
        cpu::ops::matmul_bwd(
            Some(&mut adx),
            &mut adw,
            &ab(&dy),
            &ab(&x),
            &ab(&w),
            n,
            din,
            dout,
        );
        let gy = b.matmul_fwd_bf16(&x, &w, n, din, dout);
        let (mut gdx, mut gdw) = (dx0, dw0);
        b.matmul_bwd_bf16(&mut gdx, &mut gdw, &dy, &x, &w, n, din, dout);
        // Products of bf16 values are exact in f32; only the summation order differs. dx and
        // dW add their sums to the previous gradient: one more term each.
        let what = format!("tensor-core matmul {n}x{din}->{dout}");
        assert_close_dot(&format!("{what} y"), &gy, &y, &ay, din);
        assert_close_dot(&format!("{what} dx"), &gdx, &dx, &adx, dout + 1);
        assert_close_dot(&format!("{what} dw"), &gdw, &dw, &adw, n + 1);
    }
}

/// `embedding_bwd` gives the CPU reference's bits however its touched rows are spread over
/// workgroups (the spread follows the adapter: few on lavapipe, many on a GPU, so CI's
/// lavapipe run would otherwise test only one), with rows repeated many times, once, and
/// in runs longer than one workgroup's share.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_embedding_bwd_matches_cpu_bits_at_every_spread() {
    use rolloutpipe_backends::wgpu::{Exec, ops};
    let Some(g) = device::gpu() else { return };
    let mut ex = Exec::new(std::sync::Arc::clone(&g));
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    for &(vocab, dim, n) in &[
        (7usize, 33usize, 300usize),
        (300, 130, 200),
        (40, 200, 1000),
    ] {
        let ids = rand_ids(&mut rng, n, vocab);
        let dout = rand_vec(&mut rng, n * dim, 1.0);
        let table0 = rand_vec(&mut rng, vocab * dim, 1.0);
        let mut want = table0.clone();
        cpu::ops::embedding_bwd(&mut want, &dout, &ids, dim);
        let ix = ops::ScatterIndex::new(&ids, vocab);
        let (db, sb, pb) = (
            g.upload("dout", &dout),
            g.upload("starts", &ix.starts),
            g.upload("pairs", &ix.pairs),
        );
        for spread in [1, 2, 16, 1024, 1 << 20] {
            let tb = g.upload("dtable", &table0);
            ops::embedding_bwd_spread(
                &mut ex,
                &tb,
                &db,
                &sb,
                &pb,
                ix.touched(),
                dim,
                vocab,
                spread,
            );
            ex.submit().expect("submit");
            let got = g.read::<f32>(&tb, vocab * dim).expect("read");
            let what = format!("embedding_bwd {vocab}x{dim} n {n} spread {spread}");
            assert_close(&what, &got, &want, tol::EXACT);
        }
    }
}

/// `rmsnorm_bwd`'s dw is summed in two fixed-order stages: the same bits on every run, at a
/// size with many chunks (4,096 rows: 64 chunks of 64).
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_rmsnorm_dw_is_bit_reproducible() {
    use rolloutpipe_backends::wgpu::{Exec, ops};
    let Some(g) = device::gpu() else { return };
    let mut ex = Exec::new(std::sync::Arc::clone(&g));
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    let (rows, dim) = (4096usize, 96usize);
    let x = g.upload("x", &rand_vec(&mut rng, rows * dim, 2.0));
    let w = g.upload("w", &rand_vec(&mut rng, dim, 1.5));
    let rstd = g.upload("rstd", &rand_vec(&mut rng, rows, 1.0));
    let dout = g.upload("dout", &rand_vec(&mut rng, rows * dim, 1.0));
    let part = g.buffer("part", ops::rmsnorm_dw_scratch(rows, dim));
    let runs: Vec<Vec<u32>> = (0..3)
        .map(|_| {
            let (dx, dw) = (g.buffer("dx", rows * dim), g.buffer("dw", dim));
            ops::rmsnorm_bwd(
                &mut ex, &dx, &dw, &part, &dout, &x, &w, &rstd, rows, dim, false,
            );
            ex.submit().expect("submit");
            g.read::<u32>(&dw, dim).expect("read")
        })
        .collect();
    assert!(
        runs.iter().all(|r| r == &runs[0]),
        "dw bits differ between runs"
    );
    assert!(runs[0].iter().any(|&b| b != 0), "dw was computed");
}
