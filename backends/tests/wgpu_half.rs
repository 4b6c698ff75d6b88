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
#[path = "support/half.rs"]
mod half_weights;

use std::sync::Arc;

use check::{assert_close, tol};
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

fn generate(be: &mut dyn RolloutEngine, reqs: &[GenRequest]) -> Vec<GenOutput> {
    for r in reqs {
        be.add_request(r.clone()).unwrap();
    }
    let mut out = Vec::new();
    while be.active_requests() > 0 {
        out.extend(be.decode_step().unwrap());
    }
    out.sort_by_key(|o| o.id);
    out
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

    // A sync from an f32 wgpu trainer on the same device goes through the host in bf16 and
    // leaves the engine computing what the trainer computes on the rounded weights.
    let (next, next_rounded) = weights(&cfg, 4, DType::Bf16);
    let trainer = WgpuBackend::with_gpu(Arc::clone(&g), &cfg, &next).unwrap();
    assert_eq!(trainer.sync_to(&mut be).unwrap(), SyncPath::Host);
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
    use rolloutpipe_backends::cpu::model::Layout;
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
