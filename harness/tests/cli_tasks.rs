//! `sft` and `eval` run end to end on the tiny preset (seconds), checking their outputs and
//! their error messages.

use rolloutpipe_backends::load_model_dir;
use serde_json::Value;

mod support;
use support::cli::{bin, run_err, run_ok, tempdir};

#[test]
fn sft_lowers_the_loss_and_eval_reads_its_model() {
    let dir = tempdir("sft");
    let model = dir.join("m");
    let out = run_ok(
        bin()
            .args([
                "sft", "--task", "add", "--digits", "1", "--preset", "tiny", "--steps", "60",
            ])
            .args([
                "--batch-size",
                "16",
                "--lr",
                "0.01",
                "--warmup",
                "5",
                "--eval-n",
                "4",
                "--seed",
                "3",
                "--out",
            ])
            .arg(&model),
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("sft.json")).unwrap()).unwrap();
    assert_eq!(report, saved);
    let curve = report["loss_curve"].as_array().unwrap();
    let first = curve[0][1].as_f64().unwrap();
    let last = curve.last().unwrap()[1].as_f64().unwrap();
    // Uniform over the 52-id vocabulary is ln 52 = 3.95; answers of 1-digit sums are a digit or
    // two then <eos>, so even the tiny model gets well under 2.5 nats in 60 steps.
    assert!(first > 3.0 && last < 2.5, "loss {first} -> {last}");
    assert_eq!(report["heldout_eval"]["n"], 4);

    let (cfg, _) = load_model_dir(&model).unwrap();
    assert_eq!(cfg.vocab_size, 52);
    assert_eq!((cfg.bos_token_id, cfg.eos_token_id), (Some(1), Some(2)));

    let out = run_ok(
        bin()
            .args([
                "eval", "--task", "add", "--digits", "1", "--n", "6", "--model",
            ])
            .arg(&model),
    );
    let ev: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ev["n"], 6);
    assert_eq!(ev["split"], "held-out");
    let acc = ev["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    assert_eq!(ev["correct"].as_u64().unwrap() as f64 / 6.0, acc);

    // The user's own problems, checked by the task's verifier.
    let data = dir.join("p.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"1+2=\", \"answer\": \"3\"}\n{\"prompt\": \"4+4=\", \"answer\": 8}\n",
    )
    .unwrap();
    let out = run_ok(
        bin()
            .args(["eval", "--task", "add", "--model"])
            .arg(&model)
            .arg("--data")
            .arg(&data),
    );
    let ev: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (ev["n"].as_u64(), ev["split"].as_str()),
        (Some(2), Some("data"))
    );
    assert_eq!(ev["examples"][1]["answer"], "8");

    std::fs::write(
        &data,
        "{\"prompt\": \"1+2=\", \"answer\": \"3\"}\n{\"prompt\": \"4+4=\"}\n",
    )
    .unwrap();
    let err = run_err(
        bin()
            .args(["eval", "--task", "add", "--model"])
            .arg(&model)
            .arg("--data")
            .arg(&data),
    );
    assert!(err.contains("line 2") && err.contains("answer"), "{err}");
    let err = run_err(
        bin()
            .args(["eval", "--task", "subtract", "--model"])
            .arg(&model),
    );
    assert!(err.contains("add, mul, countdown"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sft_rejects_bad_options() {
    let dir = tempdir("sft-bad");
    let err = run_err(
        bin()
            .args([
                "sft", "--task", "add", "--digits", "0", "--preset", "tiny", "--out",
            ])
            .arg(dir.join("m")),
    );
    assert!(err.contains("digits"), "{err}");
    let err = run_err(
        bin()
            .args([
                "sft",
                "--task",
                "countdown",
                "--numbers",
                "9",
                "--preset",
                "tiny",
                "--out",
            ])
            .arg(dir.join("m")),
    );
    assert!(err.contains("numbers"), "{err}");
    let err = run_err(
        bin()
            .args(["sft", "--task", "add", "--steps", "0", "--out"])
            .arg(dir.join("m")),
    );
    assert!(err.contains("--steps"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_uses_the_model_dirs_tokenizer_json() {
    use rolloutpipe_backends::{ModelConfig, Weights, save_model_dir};
    let dir = tempdir("hf-tok");
    let model = dir.join("m");
    let cfg = ModelConfig::tiny();
    save_model_dir(&model, &cfg, &Weights::random(&cfg, 1).unwrap()).unwrap();
    let data = dir.join("p.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"ONE PLUS TWO IS\", \"answer\": \"3\"}\n",
    )
    .unwrap();

    // Without tokenizer.json the 52-id character tokenizer applies, which this 11-id model
    // cannot use: a clear error instead of out-of-range ids later.
    let err = run_err(
        bin()
            .args(["eval", "--task", "add", "--model"])
            .arg(&model)
            .arg("--data")
            .arg(&data),
    );
    assert!(
        err.contains("52 ids") && err.contains("vocab_size is 11"),
        "{err}"
    );

    let words = ["</s>", "[UNK]", "ONE", "PLUS", "TWO", "IS", "1", "2", "3"];
    let vocab: serde_json::Map<String, Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| ((*w).to_owned(), Value::from(i)))
        .collect();
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "</s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(model.join("tokenizer.json"), tok.to_string()).unwrap();
    let out = run_ok(
        bin()
            .args(["eval", "--task", "add", "--max-tokens", "3", "--model"])
            .arg(&model)
            .arg("--data")
            .arg(&data),
    );
    let ev: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(ev["n"], 1);
    assert_eq!(ev["examples"][0]["prompt"], "ONE PLUS TWO IS");
    // At most 3 tokens were generated (fewer when </s> came first).
    assert!(ev["mean_tokens"].as_f64().unwrap() <= 3.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn eval_uniform_scores_the_independent_test_set_and_names_its_distribution() {
    let dir = tempdir("uniform");
    let model = dir.join("m");
    run_ok(
        bin()
            .args(["sft", "--task", "add", "--digits", "2", "--preset", "tiny"])
            .args(["--steps", "2", "--eval-n", "1", "--out"])
            .arg(&model),
    );
    let written = dir.join("test.jsonl");
    let eval = |extra: &[&str]| {
        let mut c = bin();
        c.args([
            "eval",
            "--task",
            "add",
            "--digits",
            "2",
            "--uniform",
            "--n",
            "40",
        ])
        .args(["--seed", "7", "--max-tokens", "4", "--model"])
        .arg(&model)
        .args(extra);
        c
    };
    let out = run_ok(&mut eval(&["--write-problems", written.to_str().unwrap()]));
    let ev: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (ev["split"].as_str(), ev["n"].as_u64()),
        (Some("uniform"), Some(40))
    );
    let dist = ev["distribution"].as_str().unwrap();
    assert!(
        dist.contains("uniform in 0..=99") && dist.contains("seed 7"),
        "{dist}"
    );
    // The written problems are the evaluated ones: 40 correct sums of operands below 100.
    let lines: Vec<Value> = std::fs::read_to_string(&written)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 40);
    assert_eq!(lines[0]["prompt"], ev["examples"][0]["prompt"]);
    for p in &lines {
        let prompt = p["prompt"].as_str().unwrap().trim_end_matches('=');
        let (a, b) = prompt.split_once('+').unwrap();
        let (a, b): (u32, u32) = (a.parse().unwrap(), b.parse().unwrap());
        assert!(a < 100 && b < 100);
        assert_eq!(p["answer"].as_str().unwrap(), (a + b).to_string());
    }
    // An existing file is never overwritten.
    let err = run_err(&mut eval(&["--write-problems", written.to_str().unwrap()]));
    assert!(
        err.contains("test.jsonl") && err.contains("must not exist"),
        "{err}"
    );
    // The held-out split says so too.
    let out = run_ok(
        bin()
            .args([
                "eval", "--task", "add", "--digits", "2", "--n", "4", "--model",
            ])
            .arg(&model),
    );
    let ev: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(ev["distribution"].as_str().unwrap().starts_with("held-out"));
    std::fs::remove_dir_all(&dir).unwrap();
}
