//! Golden test against PyTorch + transformers (`scripts/golden/make_golden.py`): for each
//! fixture under `tests/fixtures/golden/`, a tiny random `Qwen3ForCausalLM` saved by HF is
//! loaded through the model-dir loader, and the CPU backend's logits, temperature log-probs,
//! GRPO loss, clip count and the gradient of *every* parameter are compared with what torch
//! computed, llm.c `test_gpt2.c` style: `|got − ref| ≤ atol + rtol·|ref|` per element, every
//! tensor checked, the first mismatches of each failing tensor reported.
//!
//! Fixtures: `tied` (tied embeddings, Hub-style top-level `rope_theta`, old log-probs = current
//! so every ratio is 1) and `untied` (separate `lm_head`, `rope_parameters`, explicit old
//! log-probs from a perturbed model so that some tokens are clipped). Both have β > 0 with
//! reference log-probs from another perturbed model, T = 0.7, and head_dim ≠ hidden/heads.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use rolloutpipe_backends::{
    Aggregation, CpuBackend, ModelConfig, Objective, Sequence, StdMode, TrainBatch, TrainSequence,
    Trainer, Weights, advantages, load_model_dir,
};
use serde_json::Value;

#[cfg(feature = "wgpu")]
#[path = "support/device.rs"]
mod device;

/// Makes the backend under test from the fixture's model (the weights are dropped after).
type Make = fn(&ModelConfig, &Weights) -> Option<Box<dyn Trainer>>;

fn cpu(cfg: &ModelConfig, w: &Weights) -> Option<Box<dyn Trainer>> {
    // All cores: results do not depend on the thread count (see tests/cpu.rs).
    Some(Box::new(CpuBackend::new(cfg, w, 0).unwrap()))
}

/// The wgpu backend on the shared device; `None` (a skip) without an adapter.
#[cfg(feature = "wgpu")]
fn wgpu(cfg: &ModelConfig, w: &Weights) -> Option<Box<dyn Trainer>> {
    let g = device::gpu()?;
    Some(Box::new(
        rolloutpipe_backends::wgpu::WgpuBackend::with_gpu(g, cfg, w).expect("wgpu backend"),
    ))
}

/// `|got − ref| ≤ atol + rtol·|ref|`.
#[derive(Debug, Clone, Copy)]
struct Tol {
    atol: f64,
    rtol: f64,
}

// The tolerance table. Both sides compute in f32; they differ only in summation order
// (matrixmultiply vs torch's CPU GEMM blocking, softmax and RMSNorm reductions), a few ulp
// (~1e-7 relative) per op, compounded over 2 layers. Largest errors measured on both fixtures
// (torch 2.15, transformers 5.24; printed with `--nocapture`): logits 3.0e-6, log-probs 2.4e-6,
// loss 6e-8, gradients 1.4e-6 (the CPU backend's dot-product kernels move these by ~1e-6 when
// they change). Each bound leaves about 7-10x margin over that and is still far
// below what a real bug gives (a wrong RoPE pairing, norm order, temperature or clip branch moves
// values by 1e-3 or more).

/// Logits are O(1–10); measured max error 3.0e-6.
const LOGITS: Tol = Tol {
    atol: 2e-5,
    rtol: 1e-5,
};
/// Log-probs at T = 0.7 amplify logit errors by 1/T and add the log-sum-exp's rounding;
/// measured 2.4e-6.
const LOGPROBS: Tol = Tol {
    atol: 3e-5,
    rtol: 1e-5,
};
/// Token-mean of 27 O(1) terms, summed in f64 by the backend; measured 6e-8.
const LOSS: Tol = Tol {
    atol: 1e-6,
    rtol: 1e-6,
};
/// Gradients are sums over tokens and positions of products of f32 activations; entries range
/// from 1e-4 to ~1, so the absolute floor dominates for small ones. Measured 1.4e-6
/// (the tied embedding, which sums both uses).
const GRADS: Tol = Tol {
    atol: 1.5e-5,
    rtol: 1e-4,
};

/// The tolerances of one case.
#[derive(Debug, Clone, Copy)]
struct Tols {
    logits: Tol,
    logprobs: Tol,
    loss: Tol,
    grads: Tol,
}

const SMALL: Tols = Tols {
    logits: LOGITS,
    logprobs: LOGPROBS,
    loss: LOSS,
    grads: GRADS,
};

// The opt-in Qwen3-0.6B-shape case: the same f32 arithmetic as the small fixtures, but sums run
// over 1,024-3,072 terms instead of 32-64, through 28 layers instead of 2, and the vocabulary
// reduction over 151,936 logits. Rounding grows roughly with √(terms) per product and linearly
// with depth, about 6x x 14x over the small fixtures' measured errors; the bounds below keep
// ~5x margin over that estimate and stay far below what a real bug gives (≥ 1e-3 relative).

/// Logits of a 28-layer model.
const LARGE_LOGITS: Tol = Tol {
    atol: 2e-3,
    rtol: 5e-4,
};
/// Log-probs: logit errors divided by T = 0.7, plus the 151,936-term log-sum-exp.
const LARGE_LOGPROBS: Tol = Tol {
    atol: 3e-3,
    rtol: 5e-4,
};
/// Token-mean of 27 O(1) terms.
const LARGE_LOSS: Tol = Tol {
    atol: 1e-4,
    rtol: 1e-4,
};
/// Gradients: the absolute floor covers the many near-zero entries of wide matrices.
const LARGE_GRADS: Tol = Tol {
    atol: 5e-4,
    rtol: 2e-2,
};

const LARGE: Tols = Tols {
    logits: LARGE_LOGITS,
    logprobs: LARGE_LOGPROBS,
    loss: LARGE_LOSS,
    grads: LARGE_GRADS,
};

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

/// Compares element-wise; `Err` describes the first mismatches and the worst error.
fn compare(what: &str, got: &[f32], want: &[f32], tol: Tol) -> Result<f64, String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    let mut bad = Vec::new();
    let mut nbad = 0usize;
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (f64::from(g), f64::from(w));
        let err = (g - w).abs();
        // A NaN on either side makes `err` NaN, which must fail too.
        if err.is_nan() || err > tol.atol + tol.rtol * w.abs() {
            nbad += 1;
            if bad.len() < 5 {
                bad.push(format!("[{i}] got {g:.7e} want {w:.7e} (err {err:.2e})"));
            }
        }
        if err.is_finite() {
            worst = worst.max(err);
        } else {
            worst = f64::INFINITY;
        }
    }
    if nbad > 0 {
        Err(format!(
            "{what}: {nbad}/{} outside atol {:.0e} + rtol {:.0e}·|ref|; first: {}",
            want.len(),
            tol.atol,
            tol.rtol,
            bad.join(", ")
        ))
    } else {
        Ok(worst)
    }
}

fn expected_tensor<'a>(exp: &'a Weights, name: &str) -> &'a [f32] {
    &exp.tensors
        .get(name)
        .unwrap_or_else(|| panic!("fixture lacks tensor {name}"))
        .data
}

fn f32s(v: &Value) -> Option<Vec<f32>> {
    v.as_array().map(|a| {
        a.iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect()
    })
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token array")
        .iter()
        .map(|x| x.as_u64().expect("token id") as u32)
        .collect()
}

fn run_fixture(name: &str, make: Make) {
    run_dir(name, &fixture_dir(name), SMALL, make);
}

fn run_dir(name: &str, dir: &Path, tol: Tols, make: Make) {
    let (cfg, weights) = load_model_dir(dir).expect("fixture model loads");
    let batch: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let exp = Weights::load_safetensors(&dir.join("expected.safetensors")).unwrap();
    assert_eq!(
        meta["tied"].as_bool(),
        Some(cfg.tie_word_embeddings),
        "{name}: config tie flag"
    );
    assert_eq!(meta["agg"], "token-mean");
    assert_eq!(meta["std"], "sample");
    let temperature = meta["temperature"].as_f64().unwrap();

    let Some(mut be) = make(&cfg, &weights) else {
        return;
    };
    drop(weights);
    let mut failures = Vec::new();
    let mut report = Vec::new();
    let mut record = |res: Result<f64, String>, what: String| match res {
        Ok(worst) => report.push(format!("{what}: max err {worst:.2e}")),
        Err(e) => failures.push(e),
    };

    let mut train = TrainBatch::default();
    for (gi, group) in batch["groups"].as_array().unwrap().iter().enumerate() {
        let prompt = u32s(&group["prompt"]);
        let responses = group["responses"].as_array().unwrap();
        let rewards: Vec<f64> = responses
            .iter()
            .map(|r| r["reward"].as_f64().unwrap())
            .collect();
        let adv = advantages(&rewards, StdMode::Sample).unwrap();
        for (j, resp) in responses.iter().enumerate() {
            let tokens = u32s(&resp["tokens"]);
            let ids: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
            let logits = be.logits(&ids).unwrap();
            let key = format!("{gi}.{j}");
            record(
                compare(
                    &format!("logits.{key}"),
                    &logits,
                    expected_tensor(&exp, &format!("logits.{key}")),
                    tol.logits,
                ),
                format!("logits.{key}"),
            );
            let seq = Sequence {
                prompt: prompt.clone(),
                response: tokens.clone(),
            };
            let lps = be.logprobs(&[seq], temperature as f32).unwrap();
            record(
                compare(
                    &format!("logprobs.{key}"),
                    &lps[0],
                    expected_tensor(&exp, &format!("logprobs.{key}")),
                    tol.logprobs,
                ),
                format!("logprobs.{key}"),
            );
            let mut ts = TrainSequence::new(prompt.clone(), tokens, adv[j], Aggregation::TokenMean);
            ts.old_logprobs = f32s(&resp["old_logprobs"]);
            ts.ref_logprobs = f32s(&resp["ref_logprobs"]);
            train.sequences.push(ts);
        }
    }

    let obj = Objective::Grpo {
        eps_low: meta["eps_low"].as_f64().unwrap(),
        eps_high: meta["eps_high"].as_f64().unwrap(),
        beta: meta["beta"].as_f64().unwrap(),
        temperature,
    };
    assert!(
        meta["beta"].as_f64().unwrap() > 0.0,
        "the fixture must exercise the KL term"
    );
    be.zero_grad().unwrap();
    let stats = be.accumulate(&train, &obj).unwrap();
    let n = train.response_tokens() as f64;
    assert_eq!(stats.tokens, meta["tokens"].as_u64().unwrap() as usize);
    assert_eq!(
        stats.clipped,
        meta["clip_active_tokens"].as_u64().unwrap() as usize,
        "{name}: clip count"
    );
    let loss = stats.loss_sum / n;
    let want_loss = meta["loss"].as_f64().unwrap();
    record(
        compare("loss", &[loss as f32], &[want_loss as f32], tol.loss),
        format!("loss {loss:.7} (torch {want_loss:.7})"),
    );

    // The backend accumulates unnormalised sums (SPEC §2); torch's are of the token-mean loss.
    let grads = be.gradients().unwrap();
    let want_names: BTreeSet<String> = exp
        .tensors
        .keys()
        .filter_map(|k| k.strip_prefix("grad.").map(str::to_owned))
        .collect();
    let got_names: BTreeSet<String> = grads.tensors.keys().cloned().collect();
    assert_eq!(got_names, want_names, "{name}: the parameter sets differ");
    for (pname, t) in &grads.tensors {
        let want = &exp.tensors[&format!("grad.{pname}")];
        assert_eq!(t.shape, want.shape, "{name}: grad shape of {pname}");
        let scaled: Vec<f32> = t.data.iter().map(|&g| (f64::from(g) / n) as f32).collect();
        record(
            compare(&format!("grad {pname}"), &scaled, &want.data, tol.grads),
            format!("grad {pname}"),
        );
    }

    println!("golden {name}:\n  {}", report.join("\n  "));
    assert!(
        failures.is_empty(),
        "golden {name}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn golden_tied() {
    run_fixture("tied", cpu);
}

#[test]
fn golden_untied() {
    run_fixture("untied", cpu);
}

/// The wgpu backend against transformers directly (conformance checks it against the CPU).
#[cfg(feature = "wgpu")]
#[test]
fn golden_tied_wgpu() {
    run_fixture("tied", wgpu);
}

#[cfg(feature = "wgpu")]
#[test]
fn golden_untied_wgpu() {
    run_fixture("untied", wgpu);
}

/// The real-size case, opt-in because its fixture is ~5 GB and is not committed: generate it
/// with `python scripts/golden/make_golden.py --qwen3-0.6b DIR`, then run
/// `ROLLOUTPIPE_GOLDEN_LARGE=DIR/qwen3-0.6b cargo test --release -p rolloutpipe-backends
/// --no-default-features --test golden -- --nocapture golden_qwen3_06b_shape` (about 10 GB of
/// memory; a debug build takes minutes per forward). Without the variable it only says so.
#[test]
fn golden_qwen3_06b_shape() {
    match std::env::var_os("ROLLOUTPIPE_GOLDEN_LARGE") {
        Some(dir) => run_dir("qwen3-0.6b", Path::new(&dir), LARGE, cpu),
        None => println!(
            "golden_qwen3_06b_shape: skipped (set ROLLOUTPIPE_GOLDEN_LARGE to the directory \
             that `make_golden.py --qwen3-0.6b DIR` wrote, DIR/qwen3-0.6b)"
        ),
    }
}

/// The real-size case on the wgpu backend (`ROLLOUTPIPE_GOLDEN_LARGE` as above, same
/// fixture): the 622 MB embedding / lm_head and every parameter-sized AdamW and gradient-norm
/// binding exceed lavapipe's 128 MiB storage bindings, so this runs their chunked paths.
/// About 13 GB of memory.
#[cfg(feature = "wgpu")]
#[test]
fn golden_qwen3_06b_shape_wgpu() {
    match std::env::var_os("ROLLOUTPIPE_GOLDEN_LARGE") {
        Some(dir) => run_dir("qwen3-0.6b (wgpu)", Path::new(&dir), LARGE, wgpu),
        None => println!("golden_qwen3_06b_shape_wgpu: skipped (see golden_qwen3_06b_shape)"),
    }
}

#[test]
fn fixtures_are_real() {
    // Guard against a regenerated fixture whose gradients vanished (a test that cannot fail):
    // every parameter must get a non-trivial gradient, and the logits must be far from uniform.
    for name in ["tied", "untied"] {
        let exp =
            Weights::load_safetensors(&fixture_dir(name).join("expected.safetensors")).unwrap();
        for (k, t) in &exp.tensors {
            let max = t.data.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            if k.starts_with("grad.") {
                assert!(max > 1e-4, "{name}: {k} has max |grad| {max}");
            } else if k.starts_with("logits.") {
                assert!(max > 1.0, "{name}: {k} has max |logit| {max}");
            }
        }
    }
}
