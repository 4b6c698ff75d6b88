//! 16-bit weight storage (bf16 and f16) and memory-mapped loading on the CPU: a 16-bit engine
//! computes exactly what an f32 backend computes on the same weights rounded to its dtype
//! (logits, log-probs, generation, batch invariance), holds half the weight bytes, refuses
//! training with an error, and loads a checkpoint of its own dtype without conversion; f16's
//! range is checked; the mapped loader gives the same values as the in-memory parser and names
//! what is wrong with a bad checkpoint.

use std::collections::BTreeMap;
use std::path::PathBuf;

use half::{bf16, f16};
use rolloutpipe_backends::*;
use safetensors::{Dtype, tensor::TensorView};

/// A small GQA config (din = 20 exercises the kernels' scalar tails).
fn mini() -> ModelConfig {
    ModelConfig {
        vocab_size: 40,
        hidden_size: 20,
        intermediate_size: 36,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        tie_word_embeddings: true,
        max_position_embeddings: 64,
        ..ModelConfig::tiny()
    }
}

#[path = "support/half.rs"]
mod half_weights;
use half_weights::weights_in;

const HALF: [DType; 2] = [DType::Bf16, DType::F16];

/// [`weights_in`] rounded to bf16.
fn weights(cfg: &ModelConfig, seed: u64) -> (Weights, Weights) {
    weights_in(cfg, seed, DType::Bf16)
}

fn request(id: u64, prompt: Vec<u32>, seed: u64, max_new: usize) -> GenRequest {
    GenRequest {
        id: RequestKey(id),
        prompt,
        params: SamplingParams {
            temperature: 1.0,
            top_p: if id.is_multiple_of(2) { 0.9 } else { 1.0 },
            max_new_tokens: max_new,
            seed,
            ..Default::default()
        },
    }
}

fn generate(be: &mut CpuBackend, reqs: &[GenRequest]) -> BTreeMap<u64, GenOutput> {
    for r in reqs {
        be.add_request(r.clone()).unwrap();
    }
    let mut out = BTreeMap::new();
    while be.active_requests() > 0 {
        for o in be.decode_step().unwrap() {
            out.insert(o.id.0, o);
        }
    }
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn reqs(cfg: &ModelConfig) -> Vec<GenRequest> {
    (0..6u64)
        .map(|i| {
            let prompt = (0..2 + i as usize * 2)
                .map(|t| ((t as u64 * 7 + i * 3) % cfg.vocab_size as u64) as u32)
                .collect();
            request(i, prompt, 100 + i, 6 + i as usize)
        })
        .collect()
}

#[test]
fn half_engines_equal_f32_on_rounded_weights_bit_for_bit() {
    for dtype in HALF {
        half_engine_equals_f32_on_rounded_weights(dtype);
    }
}

fn half_engine_equals_f32_on_rounded_weights(dtype: DType) {
    let cfg = mini();
    let (rounded, raw) = weights_in(&cfg, 5, dtype);
    let mut f = CpuBackend::new(&cfg, &rounded, 2).unwrap();
    let mut h = CpuBackend::with_dtype(&cfg, &raw, 2, dtype).unwrap();
    assert_eq!(h.weight_dtype(), dtype);
    assert_eq!(f.weight_dtype(), DType::F32);
    // half the bytes, plus the widened norm weights
    let (fb, hb) = (f.model().param_bytes(), h.model().param_bytes());
    assert!(
        hb * 2 > fb && hb * 2 < fb + fb / 10,
        "f32 {fb} B, {dtype} {hb} B"
    );

    let ids: Vec<u32> = (0..13).map(|t| (t * 5 % 40) as u32).collect();
    assert_eq!(
        bits(&h.logits(&ids).unwrap()),
        bits(&f.logits(&ids).unwrap())
    );
    let seqs = vec![
        Sequence {
            prompt: vec![1, 2, 3],
            response: vec![4, 5, 6, 7],
        },
        Sequence {
            prompt: vec![9],
            response: vec![8, 30],
        },
    ];
    let (a, b) = (
        h.logprobs(&seqs, 0.7).unwrap(),
        f.logprobs(&seqs, 0.7).unwrap(),
    );
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(bits(x), bits(y));
    }
    // the raw (unrounded) weights give different logits: the test can tell the two apart
    let mut raw_be = CpuBackend::new(&cfg, &raw, 1).unwrap();
    assert_ne!(
        bits(&raw_be.logits(&ids).unwrap()),
        bits(&f.logits(&ids).unwrap())
    );

    let rs = reqs(&cfg);
    let (gh, gf) = (generate(&mut h, &rs), generate(&mut f, &rs));
    assert_eq!(gh.len(), rs.len());
    for (id, o) in &gh {
        assert_eq!(o.tokens, gf[id].tokens, "{dtype} request {id}");
        assert_eq!(
            bits(&o.logprobs),
            bits(&gf[id].logprobs),
            "{dtype} request {id}"
        );
    }
}

#[test]
fn half_engine_decoding_is_batch_invariant() {
    for dtype in HALF {
        half_engine_decoding_is_batch_invariant_in(dtype);
    }
}

fn half_engine_decoding_is_batch_invariant_in(dtype: DType) {
    let cfg = mini();
    let (_, raw) = weights_in(&cfg, 8, dtype);
    let rs = reqs(&cfg);
    let mut together = CpuBackend::with_dtype(&cfg, &raw, 2, dtype).unwrap();
    let all = generate(&mut together, &rs);
    let mut distinct = std::collections::BTreeSet::new();
    for r in &rs {
        let mut alone = CpuBackend::with_dtype(&cfg, &raw, 1, dtype).unwrap();
        let one = generate(&mut alone, std::slice::from_ref(r));
        let (a, b) = (&one[&r.id.0], &all[&r.id.0]);
        assert_eq!(a.tokens, b.tokens, "request {}", r.id);
        assert_eq!(bits(&a.logprobs), bits(&b.logprobs), "request {}", r.id);
        distinct.insert(a.tokens.clone());
    }
    assert!(distinct.len() > 3, "requests differ");
}

#[test]
fn half_engines_refuse_training_and_sync_from_an_f32_trainer() {
    for dtype in HALF {
        half_engine_refuses_training_and_syncs_from_an_f32_trainer(dtype);
    }
}

fn half_engine_refuses_training_and_syncs_from_an_f32_trainer(dtype: DType) {
    let cfg = mini();
    let (rounded, raw) = weights_in(&cfg, 11, dtype);
    let mut h = CpuBackend::with_dtype(&cfg, &raw, 1, dtype).unwrap();
    let seq = TrainSequence::new(vec![1, 2], vec![3, 4], 1.0, Aggregation::TokenMean);
    let batch = TrainBatch {
        sequences: vec![seq],
    };
    let e = h.accumulate(&batch, &Objective::Sft).unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("in {dtype} for generation")),
        "{e}"
    );
    assert!(h.optimizer_step(1.0, &AdamW::default()).is_err());
    assert!(h.gradients().is_err());
    h.zero_grad().unwrap();
    // export widens exactly: the rounded weights come back
    assert_eq!(h.export_weights().unwrap(), rounded);

    // One SFT step on an f32 trainer, then a same-device sync into the bf16 engine: the engine
    // then equals an engine built from the trainer's weights.
    let mut t = CpuBackend::new(&cfg, &raw, 1).unwrap();
    t.zero_grad().unwrap();
    let st = t.accumulate(&batch, &Objective::Sft).unwrap();
    t.optimizer_step(st.tokens as f64, &AdamW::default())
        .unwrap();
    assert_eq!(t.sync_to(&mut h).unwrap(), SyncPath::SameDevice);
    let w = t.export_weights().unwrap();
    let mut fresh = CpuBackend::with_dtype(&cfg, &w, 1, dtype).unwrap();
    let ids = [3u32, 1, 4, 1, 5, 9, 2, 6];
    assert_eq!(
        bits(&h.logits(&ids).unwrap()),
        bits(&fresh.logits(&ids).unwrap())
    );
    // and a host import rounds the same way
    let mut imported = CpuBackend::with_dtype(&cfg, &raw, 1, dtype).unwrap();
    imported.import_weights(&w).unwrap();
    assert_eq!(
        bits(&imported.logits(&ids).unwrap()),
        bits(&fresh.logits(&ids).unwrap())
    );
}

/// f16 tops out at 65504: a weight beyond it is refused with a message, not stored as inf
/// (bf16 has f32's range and takes it).
#[test]
fn f16_storage_refuses_values_beyond_its_range() {
    let cfg = mini();
    let (_, mut raw) = weights(&cfg, 4);
    raw.tensors
        .get_mut("model.layers.0.mlp.down_proj.weight")
        .unwrap()
        .data[2] = 7.0e4;
    let e = CpuBackend::with_dtype(&cfg, &raw, 1, DType::F16).unwrap_err();
    assert!(e.to_string().contains("does not fit in f16"), "{e}");
    CpuBackend::with_dtype(&cfg, &raw, 1, DType::Bf16).unwrap();
    let dir = half_dir("f16-range", &cfg, &raw, &[], DType::Bf16);
    let e = CpuBackend::from_model_dir(&dir, 1, DType::F16).unwrap_err();
    assert!(e.to_string().contains("down_proj"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model directory whose safetensors hold `w` in bf16 (with `extra` tensors appended).
fn bf16_dir(tag: &str, cfg: &ModelConfig, w: &Weights, extra: &[(&str, Vec<f32>)]) -> PathBuf {
    half_dir(tag, cfg, w, extra, DType::Bf16)
}

/// A model directory whose safetensors hold `w` in `dtype` (Bf16 or F16).
fn half_dir(
    tag: &str,
    cfg: &ModelConfig,
    w: &Weights,
    extra: &[(&str, Vec<f32>)],
    dtype: DType,
) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rolloutpipe-bf16-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_json().to_string()).unwrap();
    let mut named: Vec<(String, Vec<usize>, Vec<f32>)> = w
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.shape.clone(), t.data.clone()))
        .collect();
    for (n, d) in extra {
        let shape = w.get("model.embed_tokens.weight").unwrap().shape.clone();
        named.push((n.to_string(), shape, d.clone()));
    }
    let bytes: Vec<Vec<u8>> = named
        .iter()
        .map(|(_, _, d)| {
            d.iter()
                .flat_map(|x| match dtype {
                    DType::F16 => f16::from_f32(*x).to_le_bytes(),
                    _ => bf16::from_f32(*x).to_le_bytes(),
                })
                .collect()
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = named
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            (
                n.as_str(),
                TensorView::new(
                    if dtype == DType::F16 {
                        Dtype::F16
                    } else {
                        Dtype::BF16
                    },
                    s.clone(),
                    b,
                )
                .unwrap(),
            )
        })
        .collect();
    let file = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
    dir
}

#[test]
fn mapped_bf16_checkpoint_loads_into_either_storage() {
    let cfg = mini();
    let (rounded, raw) = weights(&cfg, 2);
    let dir = bf16_dir("load", &cfg, &raw, &[]);
    // the named loader (mapped) widens exactly
    let (c2, w2) = load_model_dir(&dir).unwrap();
    assert_eq!(c2, cfg);
    assert_eq!(w2, rounded);
    let ids = [1u32, 7, 3, 39, 0, 12];
    let mut reference = CpuBackend::new(&cfg, &rounded, 1).unwrap();
    let want = bits(&reference.logits(&ids).unwrap());
    for dtype in [DType::F32, DType::Bf16] {
        let mut be = CpuBackend::from_model_dir(&dir, 1, dtype).unwrap();
        assert_eq!(be.weight_dtype(), dtype);
        assert_eq!(bits(&be.logits(&ids).unwrap()), want, "{dtype}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An f16 checkpoint loads into f16 storage without conversion and into f32 exactly; both give
/// the logits of an f32 backend on the f16-rounded weights.
#[test]
fn mapped_f16_checkpoint_loads_exactly() {
    let cfg = mini();
    let (rounded, raw) = weights_in(&cfg, 6, DType::F16);
    let dir = half_dir("f16", &cfg, &raw, &[], DType::F16);
    let (_, w2) = load_model_dir(&dir).unwrap();
    assert_eq!(w2, rounded);
    let ids = [2u32, 9, 33, 0, 5];
    let want = bits(
        &CpuBackend::new(&cfg, &rounded, 1)
            .unwrap()
            .logits(&ids)
            .unwrap(),
    );
    for dtype in [DType::F32, DType::F16] {
        let mut be = CpuBackend::from_model_dir(&dir, 1, dtype).unwrap();
        assert_eq!(be.weight_dtype(), dtype);
        assert_eq!(bits(&be.logits(&ids).unwrap()), want, "{dtype}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mapped_loader_names_what_is_wrong() {
    let cfg = mini();
    let (_, raw) = weights(&cfg, 3);
    let emb = raw.get("model.embed_tokens.weight").unwrap().data.clone();

    // a tied checkpoint's lm_head equal to the embedding is dropped; a different one refused
    let dir = bf16_dir("tied-same", &cfg, &raw, &[("lm_head.weight", emb.clone())]);
    CpuBackend::from_model_dir(&dir, 1, DType::Bf16).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let mut other = emb.clone();
    other[5] += 1.0;
    let dir = bf16_dir("tied-diff", &cfg, &raw, &[("lm_head.weight", other)]);
    let e = CpuBackend::from_model_dir(&dir, 1, DType::Bf16).unwrap_err();
    assert!(e.to_string().contains("lm_head.weight"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    // a non-finite value is named, in either storage
    let mut bad = raw.clone();
    bad.tensors
        .get_mut("model.layers.1.mlp.up_proj.weight")
        .unwrap()
        .data[3] = f32::INFINITY;
    let dir = bf16_dir("inf", &cfg, &bad, &[]);
    for dtype in [DType::F32, DType::Bf16] {
        let e = CpuBackend::from_model_dir(&dir, 1, dtype).unwrap_err();
        assert!(e.to_string().contains("up_proj"), "{e}");
    }
    assert!(load_model_dir(&dir).is_err());
    std::fs::remove_dir_all(&dir).unwrap();

    // a missing tensor, a wrong shape, an unknown tensor, a truncated file
    let mut missing = raw.clone();
    missing.tensors.remove("model.norm.weight");
    let dir = bf16_dir("missing", &cfg, &missing, &[]);
    let e = CpuBackend::from_model_dir(&dir, 1, DType::F32).unwrap_err();
    assert!(
        matches!(&e, BackendError::MissingTensor(n) if n == "model.norm.weight"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let mut misshaped = raw.clone();
    misshaped.tensors.insert(
        "model.norm.weight".into(),
        Tensor::new(vec![3], vec![1.0; 3]).unwrap(),
    );
    let dir = bf16_dir("shape", &cfg, &misshaped, &[]);
    let e = CpuBackend::from_model_dir(&dir, 1, DType::Bf16).unwrap_err();
    assert!(
        matches!(&e, BackendError::Shape { what, .. } if what == "model.norm.weight"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = bf16_dir("extra", &cfg, &raw, &[("model.extra.weight", emb)]);
    let e = load_model_dir(&dir).unwrap_err();
    assert!(
        matches!(&e, BackendError::UnexpectedTensor(n) if n == "model.extra.weight"),
        "{e}"
    );
    let file = dir.join("model.safetensors");
    let good = std::fs::read(&file).unwrap();
    std::fs::write(&file, &good[..good.len() / 2]).unwrap();
    assert!(matches!(
        CpuBackend::from_model_dir(&dir, 1, DType::F32),
        Err(BackendError::Safetensors { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}
