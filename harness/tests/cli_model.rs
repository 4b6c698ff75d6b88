//! The inspection and parity subcommands (`logits`, `grpo-step`) run as a user would, on a tiny
//! model and on the golden fixture, and their JSON is checked against the backend API and
//! against PyTorch's numbers.

use std::path::Path;

use rolloutpipe_backends::{
    Aggregation, CpuBackend, ModelConfig, Objective, StdMode, TrainBatch, TrainSequence, Trainer,
    Weights, advantages, load_model_dir, save_model_dir,
};
use serde_json::{Value, json};

mod support;
use support::cli::{bin, run_err, run_ok, tempdir};

fn tiny_model(dir: &Path) -> (ModelConfig, Weights) {
    let cfg = ModelConfig::tiny();
    let w = Weights::random(&cfg, 3).unwrap();
    save_model_dir(dir, &cfg, &w).unwrap();
    (cfg, w)
}

#[test]
fn logits_match_the_backend_and_reject_bad_ids() {
    let dir = tempdir("logits");
    let (cfg, w) = tiny_model(&dir);
    let out = run_ok(
        bin()
            .args(["logits", "--model"])
            .arg(&dir)
            .args(["--ids", "1,2,3,4"]),
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ids"], json!([1, 2, 3, 4]));
    assert_eq!(v["vocab_size"], json!(cfg.vocab_size));
    let rows = v["logits"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let mut be = CpuBackend::new(&cfg, &w, 1).unwrap();
    let want = be.logits(&[1, 2, 3, 4]).unwrap();
    let got: Vec<f32> = rows
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect();
    // JSON carries f32 values exactly (printed as their shortest f64 round-trip).
    assert_eq!(got, want);

    let err = run_err(
        bin()
            .args(["logits", "--model"])
            .arg(&dir)
            .args(["--ids", "1,99"]),
    );
    assert!(err.contains("99") && err.contains("vocab"), "{err}");
    let err = run_err(bin().args(["logits", "--model", "/nonexistent/model", "--ids", "1"]));
    assert!(err.contains("/nonexistent/model"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tiny_batch() -> Value {
    json!({"groups": [
        {"prompt": [1, 2], "responses": [
            {"tokens": [3, 4, 5], "reward": 1.0, "old_logprobs": null, "ref_logprobs": null},
            {"tokens": [6], "reward": 0.0, "old_logprobs": null, "ref_logprobs": [-2.0]},
            {"tokens": [7, 8], "reward": 0.0}
        ]},
        {"prompt": [9], "responses": [
            {"tokens": [10, 1], "reward": 0.5, "old_logprobs": [-2.5, -2.2], "ref_logprobs": null},
            {"tokens": [2, 2, 2, 2], "reward": 2.0, "old_logprobs": null, "ref_logprobs": null}
        ]}
    ]})
}

#[test]
fn grpo_step_matches_the_backend_api() {
    let dir = tempdir("grpo");
    let model = dir.join("model");
    let out_dir = dir.join("out");
    let (cfg, w) = tiny_model(&model);
    let batch_path = dir.join("batch.json");
    std::fs::write(&batch_path, tiny_batch().to_string()).unwrap();
    let out = run_ok(
        bin()
            .args(["grpo-step", "--model"])
            .arg(&model)
            .arg("--batch")
            .arg(&batch_path)
            .arg("--out")
            .arg(&out_dir)
            .args([
                "--save-grads",
                "--lr",
                "0.01",
                "--beta",
                "0.1",
                "--temperature",
                "0.8",
                "--agg",
                "seq-mean",
            ])
            .args(["--std", "pop", "--clip", "0.5", "--eps-high", "0.28"]),
    );
    let stdout: Value = serde_json::from_slice(&out.stdout).unwrap();
    let result: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("result.json")).unwrap())
            .unwrap();
    assert_eq!(stdout, result);

    // The same step through the API.
    let b = tiny_batch();
    let mut train = TrainBatch::default();
    for g in b["groups"].as_array().unwrap() {
        let prompt: Vec<u32> = g["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let rs = g["responses"].as_array().unwrap();
        let rewards: Vec<f64> = rs.iter().map(|r| r["reward"].as_f64().unwrap()).collect();
        let adv = advantages(&rewards, StdMode::Population).unwrap();
        for (r, a) in rs.iter().zip(adv) {
            let toks: Vec<u32> = r["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let lp = |k: &str| {
                r.get(k)
                    .and_then(Value::as_array)
                    .map(|a| a.iter().map(|x| x.as_f64().unwrap() as f32).collect())
            };
            let mut s = TrainSequence::new(prompt.clone(), toks, a, Aggregation::SeqMean);
            s.old_logprobs = lp("old_logprobs");
            s.ref_logprobs = lp("ref_logprobs");
            train.sequences.push(s);
        }
    }
    let mut be = CpuBackend::new(&cfg, &w, 1).unwrap();
    let obj = Objective::Grpo {
        eps_low: 0.2,
        eps_high: 0.28,
        beta: 0.1,
        temperature: 0.8,
    };
    let stats = be.accumulate(&train, &obj).unwrap();
    // seq-mean: the normalizer is the number of sequences.
    assert_eq!(result["normalizer"], json!(5.0));
    let loss = result["loss"].as_f64().unwrap();
    assert!(
        (loss - stats.loss_sum / 5.0).abs() < 1e-9,
        "{loss} vs {}",
        stats.loss_sum / 5.0
    );
    assert_eq!(result["groups"], json!(2));
    assert_eq!(result["tokens"], json!(12));

    // grads.safetensors is the normalized pre-clip gradient: its norm is the reported one.
    let grads = Weights::load_safetensors(&out_dir.join("grads.safetensors")).unwrap();
    let raw = be.gradients().unwrap();
    assert_eq!(
        grads.tensors.keys().collect::<Vec<_>>(),
        raw.tensors.keys().collect::<Vec<_>>()
    );
    let norm: f64 = grads
        .tensors
        .values()
        .flat_map(|t| &t.data)
        .map(|&g| f64::from(g).powi(2))
        .sum::<f64>()
        .sqrt();
    let reported = result["grad_norm"].as_f64().unwrap();
    assert!(
        (norm - reported).abs() <= 1e-5 * reported,
        "{norm} vs {reported}"
    );
    assert!(reported > 0.5, "clip 0.5 should be active, norm {reported}");
    assert!((result["clip_scale"].as_f64().unwrap() - 0.5 / (reported + 1e-6)).abs() < 1e-9);

    // The updated model loads and differs from the original in every tensor that got a gradient.
    let (cfg2, w2) = load_model_dir(&out_dir).unwrap();
    assert_eq!(cfg2, cfg);
    let moved = w2
        .tensors
        .iter()
        .filter(|(k, t)| t.data != w.tensors[*k].data)
        .count();
    assert_eq!(moved, w.tensors.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn grpo_step_errors_name_the_culprit() {
    let dir = tempdir("grpo-err");
    let model = dir.join("model");
    tiny_model(&model);
    let cases = [
        (json!({"groups": []}), "no groups"),
        (
            json!({"groups": [{"prompt": [1], "responses": []}]}),
            "group 0: no responses",
        ),
        (
            json!({"groups": [{"prompt": [1], "responses": [{"tokens": [2], "reward": 1.0}, {"tokens": [3, 4], "reward": 0.0, "old_logprobs": [-1.0]}]}]}),
            "group 0 response 1: old_logprobs has 1 values for 2 tokens",
        ),
        (
            json!({"groups": [{"prompt": [1], "responses": [{"tokens": [2], "reward": 1.0, "extra": 1}]}]}),
            "unknown field",
        ),
        (
            json!({"groups": [{"prompt": [1], "responses": [{"tokens": [2], "reward": 1.0}, {"tokens": [50], "reward": 0.0}]}]}),
            "group 0 response 1: token 50 >= vocab_size 11",
        ),
        (
            json!({"groups": [{"prompt": [1], "responses": [{"tokens": [2], "reward": 1.0}]}]}),
            "at least 2 rewards",
        ),
    ];
    for (i, (batch, want)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("batch{i}.json"));
        std::fs::write(&path, batch.to_string()).unwrap();
        let err = run_err(
            bin()
                .args(["grpo-step", "--model"])
                .arg(&model)
                .arg("--batch")
                .arg(&path)
                .arg("--out")
                .arg(dir.join("out")),
        );
        assert!(err.contains(want), "case {i}: {err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn grpo_step_reproduces_pytorch_on_the_golden_fixture() {
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../backends/tests/fixtures/golden/untied");
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json")).unwrap())
            .unwrap();
    let out_dir = tempdir("golden");
    let out = run_ok(
        bin()
            .args(["grpo-step", "--model"])
            .arg(&fixture)
            .arg("--batch")
            .arg(fixture.join("batch.json"))
            .arg("--out")
            .arg(&out_dir)
            .arg("--save-grads")
            .args([
                "--temperature",
                &meta["temperature"].to_string(),
                "--beta",
                &meta["beta"].to_string(),
            ]),
    );
    let result: Value = serde_json::from_slice(&out.stdout).unwrap();
    let want = meta["loss"].as_f64().unwrap();
    // Same tolerance as backends/tests/golden.rs's LOSS entry (f32 vs torch, 27 tokens).
    assert!(
        (result["loss"].as_f64().unwrap() - want).abs() < 1e-6,
        "{result} vs {want}"
    );
    let grads = Weights::load_safetensors(&out_dir.join("grads.safetensors")).unwrap();
    let exp = Weights::load_safetensors(&fixture.join("expected.safetensors")).unwrap();
    for (name, t) in &grads.tensors {
        let e = &exp.tensors[&format!("grad.{name}")];
        for (g, w) in t.data.iter().zip(&e.data) {
            // GRADS entry of the golden tolerance table.
            assert!(
                (g - w).abs() <= 1.5e-5 + 1e-4 * w.abs(),
                "{name}: {g} vs {w}"
            );
        }
    }
    std::fs::remove_dir_all(&out_dir).unwrap();
}

/// `--backend cuda` on a machine without an NVIDIA driver (this one and CI's), or in a
/// build without the `cuda` feature: one line naming the cause, a failure exit, no panic.
/// (Skipped where a CUDA driver and device are present: there the backend opens.)
#[test]
fn backend_cuda_without_a_driver_is_one_line() {
    if rolloutpipe_backends::cuda::availability().is_none() {
        eprintln!("SKIP: this machine has a usable CUDA device");
        return;
    }
    let dir = tempdir("cuda");
    tiny_model(&dir);
    let err = run_err(
        bin()
            .args(["logits", "--backend", "cuda", "--model"])
            .arg(&dir)
            .args(["--ids", "1,2"]),
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.starts_with("error: --backend cuda: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    if cfg!(feature = "cuda") {
        assert!(err.contains("CUDA driver"), "{err}");
    } else {
        assert!(err.contains("--features cuda"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train --backend cuda` where CUDA cannot run (a build without the feature, or no driver):
/// one line naming the cause, before any SFT work, and no panic.
#[test]
fn train_backend_cuda_without_a_driver_is_one_line() {
    if rolloutpipe_backends::cuda::availability().is_none() {
        eprintln!("SKIP: this machine has a usable CUDA device");
        return;
    }
    let dir = tempdir("train-cuda");
    let err = run_err(
        bin()
            .args(["train", "--backend", "cuda", "--out"])
            .arg(dir.join("run"))
            .args(["--set", "run.steps=1"]),
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("run.backend \"cuda\": "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    if cfg!(feature = "cuda") {
        assert!(err.contains("CUDA driver"), "{err}");
    } else {
        assert!(err.contains("--features cuda"), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
