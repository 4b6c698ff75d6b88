//! bf16 and f16 weight storage on the wgpu backend (`WgpuBackend::with_dtype`): a 16-bit
//! engine computes exactly what an f32 wgpu engine computes on the same weights rounded to its
//! dtype (logits, log-probs, greedy and seeded-sampled tokens, bit for bit), agrees with the CPU
//! backend's 16-bit engine within the conformance tolerances, decodes batch-invariantly, holds
//! about half the weight bytes, refuses training calls, and refuses an f16 snapshot value past
//! f16's range by its tensor's name. The model has odd-length tensors and an odd inner
//! dimension, so packed pairs straddle rows and the last word of a tensor is half used.
#![cfg(feature = "wgpu")]

#[path = "support/check.rs"]
#[allow(dead_code)]
mod check;
#[path = "support/device.rs"]
mod device;
#[path = "support/engine.rs"]
mod engine;
#[path = "support/half.rs"]
mod half_weights;

use std::sync::Arc;

use check::{assert_close, tol};
use engine::generate;
use rolloutpipe_backends::wgpu::{Gpu, WgpuBackend};
use rolloutpipe_backends::*;

const HALF: [DType; 2] = [DType::Bf16, DType::F16];

/// Odd sizes everywhere a packed pair could go wrong: vocab × hidden = 43 × 21 (embedding and
/// the untied lm_head, odd length), gate/up/down 37 × 21 (odd), inner dimensions 21 and 37.
fn odd() -> ModelConfig {
    ModelConfig {
        vocab_size: 43,
        hidden_size: 21,
        intermediate_size: 37,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        tie_word_embeddings: false,
        max_position_embeddings: 64,
        ..ModelConfig::tiny()
    }
}

/// Peaked random weights and the same rounded to `dtype`: `(raw, rounded)`.
fn weights(cfg: &ModelConfig, seed: u64, dtype: DType) -> (Weights, Weights) {
    let (rounded, raw) = half_weights::weights_in(cfg, seed, dtype);
    (raw, rounded)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Greedy, plain, top-k, top-p and both, with per-request seeds.
fn requests(cfg: &ModelConfig, n: u64) -> Vec<GenRequest> {
    (0..n)
        .map(|i| GenRequest {
            id: RequestKey(i),
            prompt: (0..2 + (i as usize * 3) % 7)
                .map(|t| ((t as u64 * 7 + i * 5) % cfg.vocab_size as u64) as u32)
                .collect(),
            params: SamplingParams {
                temperature: if i % 5 == 0 { 0.0 } else { 0.9 },
                top_k: if i % 5 == 2 || i % 5 == 4 { 6 } else { 0 },
                top_p: if i % 5 >= 3 { 0.85 } else { 1.0 },
                max_new_tokens: 5 + (i % 3) as usize,
                seed: 700 + i,
                ..Default::default()
            },
        })
        .collect()
}

fn seqs() -> Vec<Sequence> {
    vec![
        Sequence {
            prompt: vec![1, 2, 3],
            response: vec![4, 5, 42, 7],
        },
        Sequence {
            prompt: vec![9],
            response: vec![8, 30],
        },
    ]
}

#[test]
fn half_wgpu_engines_equal_f32_wgpu_on_rounded_weights_and_match_the_cpu() {
    let Some(g) = device::gpu() else { return };
    for dtype in HALF {
        half_engine_checks(&g, dtype);
    }
}

fn half_engine_checks(g: &Arc<Gpu>, dtype: DType) {
    let cfg = odd();
    let (raw, rounded) = weights(&cfg, 5, dtype);
    let mut h = WgpuBackend::with_gpu_dtype(Arc::clone(g), &cfg, &raw, dtype).unwrap();
    let mut f = WgpuBackend::with_gpu(Arc::clone(g), &cfg, &rounded).unwrap();
    let mut c = CpuBackend::with_dtype(&cfg, &raw, 1, dtype).unwrap();
    assert_eq!((h.weight_dtype(), f.weight_dtype()), (dtype, DType::F32));
    assert_eq!(h.sync_target().dtype, dtype);
    // The stored values are the rounded weights, exactly.
    assert_eq!(h.export_weights().unwrap(), rounded, "{dtype}");
    // Half the bytes, plus the f32 norm weights and the odd tensors' padding.
    let (hb, fb) = (h.weight_bytes(), f.weight_bytes());
    assert!(
        hb * 2 > fb && hb * 2 < fb + fb / 10,
        "{dtype}: {hb} B vs f32 {fb} B"
    );

    let ids: Vec<u32> = (0..13).map(|t| (t * 5 % 43) as u32).collect();
    let hl = h.logits(&ids).unwrap();
    assert_eq!(bits(&hl), bits(&f.logits(&ids).unwrap()), "{dtype} logits");
    assert_close(
        &format!("{dtype} logits vs cpu"),
        &hl,
        &c.logits(&ids).unwrap(),
        tol::MODEL,
    );
    let hp = h.logprobs(&seqs(), 0.7).unwrap();
    let fp = f.logprobs(&seqs(), 0.7).unwrap();
    let cp = c.logprobs(&seqs(), 0.7).unwrap();
    for ((a, b), cc) in hp.iter().zip(&fp).zip(&cp) {
        assert_eq!(bits(a), bits(b), "{dtype} log-probs");
        assert_close(&format!("{dtype} log-probs vs cpu"), a, cc, tol::MODEL);
    }

    let reqs = requests(&cfg, 10);
    let (ho, fo, co) = (
        generate(&mut h, &reqs),
        generate(&mut f, &reqs),
        generate(&mut c, &reqs),
    );
    assert_eq!(ho.len(), reqs.len());
    for ((a, b), cc) in ho.iter().zip(&fo).zip(&co) {
        assert_eq!((a.id, &a.tokens, a.finish), (b.id, &b.tokens, b.finish));
        assert_eq!(
            bits(&a.logprobs),
            bits(&b.logprobs),
            "{dtype} request {}",
            a.id
        );
        // With these fixed seeds no draw lands within rounding of a boundary (as in the
        // conformance suite's generation_matches_cpu_tokens), so tokens agree exactly.
        assert_eq!((a.id, &a.tokens), (cc.id, &cc.tokens), "{dtype} vs cpu");
        assert_close(
            &format!("{dtype} gen vs cpu"),
            &a.logprobs,
            &cc.logprobs,
            tol::MODEL,
        );
    }
}

/// With 16-bit weights each request decodes to the same tokens and log-prob bits alone (one
/// row: `matmul_fwd_gemv`) as among seven others (the tiled GEMM).
#[test]
fn half_wgpu_decoding_is_batch_invariant() {
    let Some(g) = device::gpu() else { return };
    let cfg = odd();
    let (raw, _) = weights(&cfg, 9, DType::Bf16);
    let mut be = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &raw, DType::Bf16).unwrap();
    let reqs = requests(&cfg, 9);
    let together = generate(&mut be, &reqs);
    for t in &together {
        let alone = generate(&mut be, std::slice::from_ref(&reqs[t.id.0 as usize]));
        assert_eq!(alone[0].tokens, t.tokens, "request {}", t.id);
        assert_eq!(
            bits(&alone[0].logprobs),
            bits(&t.logprobs),
            "request {}",
            t.id
        );
    }
}

#[test]
fn half_wgpu_engine_refuses_training_and_loads_synced_weights() {
    let Some(g) = device::gpu() else { return };
    let cfg = odd();
    let (raw, _) = weights(&cfg, 3, DType::Bf16);
    let mut be = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &raw, DType::Bf16).unwrap();
    let batch = TrainBatch {
        sequences: vec![TrainSequence::new(
            vec![1, 2],
            vec![3, 4],
            1.0,
            Aggregation::TokenMean,
        )],
    };
    let says = |e: BackendError| {
        let s = e.to_string();
        assert!(s.contains("BF16") && s.contains("generation only"), "{s}");
    };
    says(be.accumulate(&batch, &Objective::default()).unwrap_err());
    says(be.optimizer_step(1.0, &AdamW::default()).unwrap_err());
    says(be.gradients().unwrap_err());
    let n = be
        .export_weights()
        .unwrap()
        .tensors
        .values()
        .map(|t| t.data.len())
        .sum();
    let state = rolloutpipe_backends::optim::AdamState {
        m: vec![0.0; n],
        v: vec![0.0; n],
        step: 1,
    };
    says(be.restore_optimizer(state).unwrap_err());

    // A sync from an f32 wgpu trainer on the same device is rounded to bf16 on the device
    // (weight_cast) and leaves the engine computing what the trainer computes on the rounded
    // weights.
    let (next, next_rounded) = weights(&cfg, 4, DType::Bf16);
    let trainer = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &next).unwrap();
    assert_eq!(trainer.sync_to(&mut be).unwrap(), SyncPath::SameDevice);
    assert_eq!(be.export_weights().unwrap(), next_rounded);
    let mut f = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &next_rounded).unwrap();
    let ids = [3u32, 1, 4, 1, 5, 9, 2, 6];
    assert_eq!(
        bits(&be.logits(&ids).unwrap()),
        bits(&f.logits(&ids).unwrap())
    );
}

#[test]
fn an_f16_value_out_of_range_is_refused_naming_its_tensor() {
    let Some(g) = device::gpu() else { return };
    let cfg = odd();
    let (raw, _) = weights(&cfg, 6, DType::F16);
    let mut be = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &raw, DType::F16).unwrap();
    let before = be.export_weights().unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let mut bad = raw.clone();
    bad.tensors.get_mut(name).unwrap().data[5] = 1e6;
    let snap = WeightSnapshot::host(&cfg, &bad, DType::F32).unwrap();
    let e = be.load_weights(&snap).unwrap_err().to_string();
    assert!(e.contains(name) && e.contains("f16"), "{e}");
    assert_eq!(
        be.export_weights().unwrap(),
        before,
        "a refused snapshot changed weights"
    );
    let e = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &bad, DType::F16).unwrap_err();
    assert!(e.to_string().contains(name), "{e}");
    // bf16 has f32's range: the same weights load.
    WgpuBackend::with_gpu_dtype(g, &cfg, &bad, DType::Bf16).unwrap();
}

/// The weight buffers' bytes as `WgpuBackend::with_dtype` allocates them, computed from the
/// same function (`param_buffer_bytes`) without a device: the default model and Qwen3-0.6B's
/// shape. 16-bit storage halves every 2-D tensor; the f32 norm weights stay.
#[test]
fn weight_buffer_bytes_halve_at_the_default_model_and_qwen3_0_6b() {
    use rolloutpipe_backends::model::Layout;
    use rolloutpipe_backends::wgpu::model::param_buffer_bytes;
    use rolloutpipe_kernels::WeightFormat;
    let qwen3_0_6b = ModelConfig::qwen3_0_6b();
    for (what, cfg, f32_bytes, bf16_bytes) in [
        (
            "default model",
            ModelConfig::small(),
            3_184_128u64,
            1_594_880u64,
        ),
        ("Qwen3-0.6B", qwen3_0_6b, 2_384_199_680, 1_192_230_912),
    ] {
        let layout = Layout::new(&cfg);
        let (f, b, h) = (
            param_buffer_bytes(&layout, WeightFormat::F32),
            param_buffer_bytes(&layout, WeightFormat::Bf16),
            param_buffer_bytes(&layout, WeightFormat::F16),
        );
        eprintln!(
            "{what}: f32 {f} B, bf16 {b} B ({:.4}x), f16 {h} B",
            b as f64 / f as f64
        );
        assert_eq!((f, b, h), (f32_bytes, bf16_bytes, bf16_bytes), "{what}");
    }
}

/// Values where a rounding goes wrong: ties to even at both formats' precision, just past
/// them, f16's subnormals and its underflow to zero, its largest finite value and the first
/// that overflows, bf16's largest, signed zeros, infinities and NaN, then random values over
/// many exponents.
fn tricky(n_random: usize) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1.0 + 2f32.powi(-8),       // bf16 tie: to even (1.0)
        1.0 + 3.0 * 2f32.powi(-8), // bf16 tie: to even (up)
        1.0 + 2f32.powi(-8) + 2f32.powi(-20),
        1.0 + 2f32.powi(-11), // f16 tie
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-11) + 2f32.powi(-22),
        6.1e-5,  // f16 smallest normal is 6.104e-5
        3.0e-5,  // f16 subnormal
        5.96e-8, // f16 smallest subnormal (2^-24)
        2.98e-8, // half of it: a tie to zero
        3.0e-8,  // just past the tie: rounds up
        1.0e-9,  // underflows to zero
        -4.1e-6,
        65504.0,
        65519.0, // still rounds to 65504
        -65519.0,
        1.0e-38,      // f32 subnormal territory
        3.3895314e38, // bf16's largest finite
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let mut x = 0x1234_5678u32;
    for _ in 0..n_random {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        // Exponents 2^-30 .. 2^15 and any mantissa: both formats' normal and subnormal ranges.
        let e = (x % 46) as i32 - 30;
        let m = 1.0 + (x >> 8) as f32 / (1u32 << 24) as f32;
        v.push(if x & 1 == 1 { -m } else { m } * 2f32.powi(e));
    }
    v
}

/// `weight_cast` on the device gives the host's (`half`'s) bits for every value, packed and
/// widened, in bf16 and f16, at an odd length, whole and in 128-value chunks; under f16 a
/// non-finite result flags its tensor, and only under f16.
#[test]
fn weight_cast_rounds_as_the_host_does() {
    use rolloutpipe_backends::wgpu::{Exec, ops};
    use rolloutpipe_kernels::WeightFormat;
    let Some(g) = device::gpu() else { return };
    let src = tricky(4001);
    let n = src.len();
    assert_eq!(n % 2, 0);
    let src = &src[..n - 1]; // odd
    let n = src.len();
    let sb = g.upload("cast src", src);
    for (format, host) in [
        (
            WeightFormat::Bf16,
            src.iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect::<Vec<u16>>(),
        ),
        (
            WeightFormat::F16,
            src.iter()
                .map(|&v| half::f16::from_f32(v).to_bits())
                .collect::<Vec<u16>>(),
        ),
    ] {
        let widened: Vec<u32> = host
            .iter()
            .map(|&h| match format {
                WeightFormat::Bf16 => half::bf16::from_bits(h).to_f32().to_bits(),
                _ => half::f16::from_bits(h).to_f32().to_bits(),
            })
            .collect();
        for cap in [None, Some(512usize)] {
            let mut ex = Exec::new(Arc::clone(&g));
            if let Some(c) = cap {
                ex.cap_binding(c); // 128 values per chunk
            }
            let packed = g.buffer("cast packed", n.div_ceil(2));
            let wide = g.buffer("cast wide", n);
            let flags = g.buffer("cast flags", 3);
            ops::weight_cast(&mut ex, &packed, &sb, &flags, n, format, 1, true);
            ops::weight_cast(&mut ex, &wide, &sb, &flags, n, format, 2, false);
            ex.submit().unwrap();
            let got = g.read::<u32>(&packed, n.div_ceil(2)).unwrap();
            let want = ops::pack_half(&host);
            for (j, (a, b)) in got.iter().zip(&want).enumerate() {
                // NaN payloads: both quiet NaNs of the same sign suffice.
                let nan = |w: u32, k: u32| {
                    let h = (w >> (16 * k)) & 0xffff;
                    match format {
                        WeightFormat::Bf16 => half::bf16::from_bits(h as u16).is_nan(),
                        _ => half::f16::from_bits(h as u16).is_nan(),
                    }
                };
                if a != b && !(nan(*a, 0) && nan(*b, 0)) && !(nan(*a, 1) && nan(*b, 1)) {
                    panic!(
                        "{format:?} cap {cap:?}: word {j} = {a:#010x}, host {b:#010x} (values {:?})",
                        &src[2 * j..(2 * j + 2).min(n)]
                    );
                }
            }
            let got = g.read::<u32>(&wide, n).unwrap();
            for (i, (a, b)) in got.iter().zip(&widened).enumerate() {
                let both_nan = f32::from_bits(*a).is_nan() && f32::from_bits(*b).is_nan();
                assert!(
                    a == b || both_nan,
                    "{format:?} cap {cap:?}: widened {} = {a:#010x}, host {b:#010x}",
                    src[i]
                );
            }
            let f = g.read::<u32>(&flags, 3).unwrap();
            let over = u32::from(format == WeightFormat::F16);
            assert_eq!(f, [0, over, over], "{format:?} overflow flags");
        }
    }
}

/// A same-device sync to a 16-bit engine is rounded on the device and gives the bits of the
/// host path (the engine's weights and logits after each are equal), in bf16 and f16 and with
/// the trainer's tensors bound in chunks; an f16 value out of range is refused naming its
/// tensor, leaving the engine's weights as they were.
#[test]
fn same_device_half_sync_equals_the_host_path() {
    let Some(g) = device::gpu() else { return };
    let cfg = odd();
    for dtype in HALF {
        let (raw, _) = weights(&cfg, 31, dtype);
        let (next, next_rounded) = weights(&cfg, 32, dtype);
        for cap in [None, Some(1024usize)] {
            let mut trainer = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &next).unwrap();
            if let Some(c) = cap {
                trainer.cap_storage_binding(c).unwrap();
            }
            let mut dev = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &raw, dtype).unwrap();
            let mut host = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &raw, dtype).unwrap();
            assert_eq!(trainer.sync_to(&mut dev).unwrap(), SyncPath::SameDevice);
            let snap = WeightSnapshot::host(&cfg, &next, dtype).unwrap();
            assert_eq!(host.load_weights(&snap).unwrap(), SyncPath::Host);
            assert_eq!(
                dev.export_weights().unwrap(),
                next_rounded,
                "{dtype} {cap:?}"
            );
            assert_eq!(
                host.export_weights().unwrap(),
                next_rounded,
                "{dtype} {cap:?}"
            );
            let ids = [3u32, 1, 4, 1, 5, 9, 2, 6];
            assert_eq!(
                bits(&dev.logits(&ids).unwrap()),
                bits(&host.logits(&ids).unwrap()),
                "{dtype} {cap:?}"
            );
        }
    }
    let (raw, _) = weights(&cfg, 33, DType::F16);
    let mut engine = WgpuBackend::with_gpu_dtype(Arc::clone(&g), &cfg, &raw, DType::F16).unwrap();
    let before = engine.export_weights().unwrap();
    let name = "model.layers.0.self_attn.o_proj.weight";
    let mut bad = raw.clone();
    bad.tensors.get_mut(name).unwrap().data[3] = -7e4;
    let trainer = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &bad).unwrap();
    let e = trainer.sync_to(&mut engine).unwrap_err().to_string();
    assert!(
        e.contains(name) && e.contains("f16") && !e.contains('\n'),
        "{e}"
    );
    assert_eq!(engine.export_weights().unwrap(), before);
}
