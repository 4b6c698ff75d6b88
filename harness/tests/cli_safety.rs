//! Run safety through the binary (issue 16): every bad input is a one-line error without a
//! panic, no run directory or user file is lost (lock, --force, resume checks), and SIGINT
//! or `kill -9` mid-run followed by `--resume` loses nothing.
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rolloutpipe_harness::train::TrainConfig;
use support::cli::{bin, run_err, run_ok, tempdir};

/// A tiny run ([`TrainConfig::tiny`]: 1-layer model, 1-digit addition, short SFT) in sync
/// mode, a checkpoint every step, as the TOML file the CLI reads.
fn tiny() -> String {
    let sets = [
        "run.steps=4",
        "run.mode=sync",
        "run.eval_problems=16",
        "run.test_problems=1000",
        "run.checkpoint_every=1",
        "sft.steps=20",
        "rl.micro_batch=4",
    ];
    TrainConfig::tiny().set(&sets).unwrap().to_toml().unwrap()
}

fn tiny_config(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.toml");
    std::fs::write(&p, tiny()).unwrap();
    p
}

fn train(cfg: &Path, out: &Path) -> Command {
    let mut c = bin();
    c.arg("train")
        .arg("--config")
        .arg(cfg)
        .arg("--out")
        .arg(out);
    c
}

fn resume(out: &Path) -> Command {
    let mut c = bin();
    c.arg("train").arg("--resume").arg(out);
    c
}

fn steps_of(out: &Path) -> Vec<u64> {
    rolloutpipe_harness::train::read_metrics(out)
        .unwrap()
        .iter()
        .map(|m| m.step)
        .collect()
}

/// Asserts the failure is one clean line: `error: ...`, no panic, no backtrace, no ANSI.
fn one_line_error(what: &str, stderr: &str) {
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE", "\x1b["] {
        assert!(!stderr.contains(bad), "{what}: {bad:?} in\n{stderr}");
    }
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(
        errors.len(),
        1,
        "{what}: expected one error line in\n{stderr}"
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error"),
        "{what}: the error is not the last line:\n{stderr}"
    );
}

fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until `out/metrics.jsonl` has at least `n` lines (the run is mid-way).
fn wait_for_steps(out: &Path, n: usize, child: &mut Child) {
    let t = Instant::now();
    loop {
        let lines = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= n {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the run ended ({st}) before step {n}");
        }
        assert!(t.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn every_bad_input_is_one_line_without_a_panic() {
    let d = tempdir("bad-inputs");
    let cfg = tiny_config(&d);
    // A model directory whose position limit is absurd.
    let model = d.join("model");
    run_ok(
        bin()
            .args(["sft", "--task", "add", "--digits", "1", "--preset", "tiny"])
            .args([
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--eval-n",
                "0",
                "--out",
            ])
            .arg(&model),
    );
    let huge_pos = d.join("huge-pos");
    std::fs::create_dir_all(&huge_pos).unwrap();
    let weights = "model.safetensors";
    std::fs::copy(model.join(weights), huge_pos.join(weights)).unwrap();
    let conf = std::fs::read_to_string(model.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&conf).unwrap();
    v["max_position_embeddings"] = serde_json::json!(1_000_000_000_000u64);
    std::fs::write(huge_pos.join("config.json"), v.to_string()).unwrap();
    let wrong = d.join("wrong.jsonl");
    std::fs::write(
        &wrong,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"12+34=\", \"answer\": \"47\"}\n",
    )
    .unwrap();

    let train_sets: &[(&str, &str)] = &[
        ("rl.batch_groups=4000000000", "rl.batch_groups"),
        ("sft.batch=4000000000", "sft."),
        ("sft.steps=4000000000", "sft."),
        ("run.eval_problems=4000000000", "run.eval_problems"),
        (
            "rollout.max_groups_factor=1e15",
            "rollout.max_groups_factor",
        ),
        ("model.hidden_size=100000000000", "model."),
        ("model.layers=100000000000", "model."),
        ("rl.lr=nan", "rl.lr"),
        ("sft.carry_drop=2", "sft.carry_drop"),
        ("rl.lr=-1.0", "rl.lr"),
        ("rl.weight_decay=-0.1", "rl.weight_decay"),
        ("rl.max_grad_norm=-1.0", "rl.max_grad_norm"),
        ("rl.max_grad_norm=nan", "rl.max_grad_norm"),
        ("rl.max_new_tokens=100000", "rl.max_new_tokens"),
        ("model.dir=\"huge\"", "max_position_embeddings"),
        (
            "model.dir=\"/nonexistent-rp-model\"",
            "/nonexistent-rp-model",
        ),
    ];
    for (i, (set, name)) in train_sets.iter().enumerate() {
        let set = set.replace("\"huge\"", &format!("{:?}", huge_pos.display().to_string()));
        let t = Instant::now();
        let out = d.join(format!("run-{i}"));
        let err = run_err(train(&cfg, &out).args(["--set", &set]));
        one_line_error(&set, &err);
        assert!(err.contains(name), "{set}: {err}");
        // The OS's reason is said once, not once per layer of context.
        assert!(err.matches("No such file").count() <= 1, "{set}: {err}");
        // A refused start leaves nothing behind (no config.toml, no lock, no directory), so
        // the same --out works again without --force.
        assert!(
            !out.exists(),
            "{set}: the refused start left {}",
            out.display()
        );
        // Refused before the warm start, not after it.
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{set}: {:?}",
            t.elapsed()
        );
    }

    let s = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let m = model.display().to_string();
    let w = wrong.display().to_string();
    let o = d.join("o").display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            s(&["eval", "--model", &m, "--task", "add", "--n", "0"]),
            "--n",
        ),
        (
            s(&[
                "eval",
                "--model",
                &m,
                "--task",
                "add",
                "--n",
                "1000000000000000",
            ]),
            "--n",
        ),
        (
            s(&["eval", "--model", &m, "--task", "add", "--numbers", "3"]),
            "--numbers",
        ),
        (
            s(&[
                "eval",
                "--model",
                &m,
                "--task",
                "countdown",
                "--digits",
                "3",
            ]),
            "--digits",
        ),
        (
            s(&["eval", "--model", &m, "--task", "add", "--data", &w]),
            "line 2",
        ),
        (
            s(&[
                "eval",
                "--model",
                &huge_pos.display().to_string(),
                "--task",
                "add",
                "--n",
                "1",
            ]),
            "max_position_embeddings",
        ),
        (
            s(&[
                "sft",
                "--task",
                "add",
                "--batch-size",
                "1000000000",
                "--steps",
                "1000000000000",
                "--out",
                &o,
            ]),
            "--steps",
        ),
        (
            s(&["sft", "--task", "add", "--clip", "nan", "--out", &o]),
            "--clip",
        ),
        (s(&["sft", "--task", "add", "--lr=-1", "--out", &o]), "--lr"),
        (s(&["sft", "--task", "add", "--wd=-1", "--out", &o]), "--wd"),
        (
            s(&[
                "grpo-step",
                "--model",
                &m,
                "--batch",
                "x.json",
                "--clip",
                "nan",
                "--out",
                &o,
            ]),
            "--clip",
        ),
        (
            s(&[
                "grpo-step",
                "--model",
                &m,
                "--batch",
                "x.json",
                "--lr",
                "nan",
                "--out",
                &o,
            ]),
            "--lr",
        ),
    ];
    for (args, name) in &cases {
        let err = run_err(bin().args(args));
        one_line_error(&args.join(" "), &err);
        assert!(err.contains(name), "{args:?}: {err}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A machine without a wgpu adapter (no Vulkan driver: the loader is pointed at none) is
/// refused in one line before the run directory is touched, whether the SFT warm start or
/// only the engines would have used it, so the same `--out` works once a driver is there.
/// wgpu's OpenGL fallback is not taken (it deadlocks across engine threads).
#[test]
fn a_machine_without_an_adapter_is_refused_before_the_run_directory() {
    let d = tempdir("no-adapter");
    let cfg = tiny_config(&d);
    for sft in ["20", "0"] {
        let out = d.join(format!("run-sft{sft}"));
        let mut c = train(&cfg, &out);
        c.args(["--backend", "wgpu", "--set"])
            .arg(format!("sft.steps={sft}"))
            .env("VK_ICD_FILENAMES", d.join("none.json"))
            .env("VK_DRIVER_FILES", d.join("none.json"))
            .env_remove("WGPU_BACKEND");
        let err = run_err(&mut c);
        let what = format!("no adapter, sft.steps={sft}");
        one_line_error(&what, &err);
        let line = err.lines().last().unwrap();
        assert!(
            line.contains("no wgpu adapter found")
                || line.contains("wgpu backend is not built into this binary"),
            "{what}: {line}"
        );
        let left: Vec<_> = std::fs::read_dir(&out)
            .map(|r| r.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{what}: the refused start left {left:?}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn nothing_the_user_made_is_overwritten_without_force() {
    let d = tempdir("no-overwrite");
    let model = d.join("model");
    let sft = |out: &Path| {
        let mut c = bin();
        c.args(["sft", "--task", "add", "--digits", "1", "--preset", "tiny"])
            .args([
                "--steps",
                "1",
                "--batch-size",
                "2",
                "--eval-n",
                "0",
                "--out",
            ])
            .arg(out);
        c
    };
    run_ok(&mut sft(&model));
    let config = std::fs::read(model.join("config.json")).unwrap();
    // sft onto an existing model directory.
    let err = run_err(&mut sft(&model));
    assert!(err.contains("--force"), "{err}");
    // eval --out onto the model's config.json.
    let err = run_err(
        bin()
            .args([
                "eval", "--task", "add", "--digits", "1", "--n", "2", "--model",
            ])
            .arg(&model)
            .arg("--out")
            .arg(model.join("config.json")),
    );
    assert!(err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(model.join("config.json")).unwrap(), config);
    // With --force the user asked for it.
    run_ok(sft(&model).arg("--force"));
    // Every model directory carries its source's tokenizer files.
    std::fs::write(model.join("tokenizer_config.json"), "{\"x\": 1}").unwrap();
    let m2 = d.join("m2");
    run_ok(
        bin()
            .args([
                "sft",
                "--task",
                "add",
                "--digits",
                "1",
                "--steps",
                "1",
                "--batch-size",
                "2",
            ])
            .args(["--eval-n", "0", "--model"])
            .arg(&model)
            .arg("--out")
            .arg(&m2),
    );
    assert!(m2.join("tokenizer_config.json").is_file());

    // compare refuses a directory holding a run instead of deleting it.
    let x = d.join("cmp");
    std::fs::create_dir_all(x.join("sync")).unwrap();
    std::fs::write(x.join("sync/metrics.jsonl"), "keep me\n").unwrap();
    let err = run_err(bin().args(["compare", "--backend", "cpu", "--out"]).arg(&x));
    one_line_error("compare", &err);
    assert!(err.contains("--force"), "{err}");
    assert_eq!(
        std::fs::read_to_string(x.join("sync/metrics.jsonl")).unwrap(),
        "keep me\n"
    );

    // compare refuses a non-empty --out even without a mode directory: its compare.md and
    // compare.json there are an earlier measurement.
    let x2 = d.join("cmp2");
    std::fs::create_dir_all(&x2).unwrap();
    std::fs::write(x2.join("compare.md"), "earlier table\n").unwrap();
    let err = run_err(
        bin()
            .args(["compare", "--backend", "cpu", "--out"])
            .arg(&x2),
    );
    one_line_error("compare", &err);
    assert!(err.contains("--force"), "{err}");
    assert_eq!(
        std::fs::read_to_string(x2.join("compare.md")).unwrap(),
        "earlier table\n"
    );
    assert!(!x2.join(".lock").exists(), "a refused start leaves no lock");

    // simulate: an earlier run's table is refused without --force and replaced with it; a
    // refused start into a new path creates nothing.
    let s = d.join("sim");
    std::fs::create_dir_all(&s).unwrap();
    std::fs::write(s.join("table.csv"), "earlier\n").unwrap();
    let sim = |out: &Path, force: bool| {
        let mut c = bin();
        c.args([
            "simulate",
            "--no-plots",
            "--focus",
            "math/R1",
            "--jobs",
            "1",
        ])
        .args([
            "--set",
            "run.profiles=[\"math\"]",
            "--set",
            "run.settings=[\"R1\"]",
        ])
        .args(["--set", "run.steps=2", "--out"])
        .arg(out);
        if force {
            c.arg("--force");
        }
        c
    };
    let err = run_err(&mut sim(&s, false));
    one_line_error("simulate", &err);
    assert!(err.contains("--force"), "{err}");
    assert_eq!(
        std::fs::read_to_string(s.join("table.csv")).unwrap(),
        "earlier\n"
    );
    run_ok(&mut sim(&s, true));
    assert_ne!(
        std::fs::read_to_string(s.join("table.csv")).unwrap(),
        "earlier\n"
    );
    let err = run_err(
        bin()
            .args(["simulate", "--focus", "nowhere/R9", "--out"])
            .arg(d.join("sim-new")),
    );
    one_line_error("simulate", &err);
    assert!(
        !d.join("sim-new").exists(),
        "a refused start creates no --out"
    );

    // train: a finished run is neither overwritten nor made unresumable by a bad resume.
    let cfg = tiny_config(&d);
    let out = d.join("run");
    let mut t = train(&cfg, &out);
    t.args(["--set", "run.steps=2"]);
    // The run starts from the model dir with a tokenizer file: every model dir carries it.
    let mut t2 = train(&cfg, &out);
    t2.args(["--set", "run.steps=2"])
        .args([
            "--set",
            &format!("model.dir={:?}", model.display().to_string()),
        ])
        .args(["--set", "sft.steps=2"]);
    // The tiny config's shape differs from the preset model's; the model dir decides it.
    run_ok(&mut t2);
    for sub in ["sft", "final", "checkpoints/step-000002"] {
        assert!(
            out.join(sub).join("tokenizer_config.json").is_file(),
            "{sub}"
        );
    }
    let err = run_err(&mut t);
    assert!(err.contains("--force") && err.contains("--resume"), "{err}");
    let before = std::fs::read(out.join("config.toml")).unwrap();
    for (set, name) in [
        ("task.name=\"mul\"", "task.name"),
        ("run.seed=9", "run.seed"),
        ("model.init_seed=5", "model.init_seed"),
    ] {
        let err = run_err(resume(&out).args(["--set", set, "--set", "run.steps=3"]));
        one_line_error(set, &err);
        assert!(err.contains(name), "{set}: {err}");
        assert_eq!(
            std::fs::read(out.join("config.toml")).unwrap(),
            before,
            "{set}"
        );
    }
    // ... and a plain resume still works afterwards.
    run_ok(resume(&out).args(["--set", "run.steps=3"]));
    assert_eq!(steps_of(&out), [0, 1, 2]);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_second_writer_is_refused_and_the_first_loses_nothing() {
    let d = tempdir("two-writers");
    let cfg = tiny_config(&d);
    let out = d.join("run");
    let mut first = spawn(train(&cfg, &out).args(["--set", "run.steps=6"]));
    wait_for_steps(&out, 1, &mut first);
    let second = train(&cfg, &out)
        .args(["--set", "run.steps=6", "--force"])
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    one_line_error("second writer", &err);
    assert!(err.contains(&format!("pid {}", first.id())), "{err}");
    let o = first.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(steps_of(&out), [0, 1, 2, 3, 4, 5]);
    assert!(out.join("checkpoints/step-000006").is_dir());
    std::fs::remove_dir_all(&d).unwrap();
}

/// Interrupts a run mid-way with `sig`, checks what it left, resumes and checks nothing is
/// lost: every step once, the trace and summary cover both invocations.
fn interrupt_then_resume(name: &str, sig: &str) {
    let d = tempdir(name);
    let cfg = tiny_config(&d);
    let out = d.join("run");
    let mut child = spawn(train(&cfg, &out).args(["--set", "run.steps=8"]));
    wait_for_steps(&out, 2, &mut child);
    signal(&child, sig);
    let o = child.wait_with_output().unwrap();
    assert!(!o.status.success(), "{sig}: the run should exit non-zero");
    let err = String::from_utf8_lossy(&o.stderr);
    if sig == "-INT" {
        assert!(err.contains("--resume"), "{err}");
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        assert_eq!(summary["complete"], false);
    }
    assert!(out.join("checkpoints/latest").is_file());
    assert!(out.join("trace.json").is_file(), "{sig}: the trace is lost");
    let trace_before = rolloutpipe_harness::trace::read_events(&out.join("trace.json"))
        .0
        .len();
    assert!(trace_before > 0);
    run_ok(&mut resume(&out));
    assert_eq!(steps_of(&out), (0..8).collect::<Vec<u64>>(), "{sig}");
    let trace_after = rolloutpipe_harness::trace::read_events(&out.join("trace.json"))
        .0
        .len();
    assert!(
        trace_after > trace_before,
        "{sig}: the resumed trace replaced the first"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 8, "{summary}");
    assert_eq!(summary["invocations"], 2, "{summary}");
    assert_eq!(summary["complete"], true, "{summary}");
    assert!(summary["accuracy_start"].is_number(), "{summary}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn sigint_checkpoints_and_resume_loses_nothing() {
    interrupt_then_resume("sigint", "-INT");
}

#[test]
fn kill_9_then_resume_loses_nothing() {
    interrupt_then_resume("kill9", "-KILL");
}

#[test]
fn first_contact_help_and_plain_logs() {
    let h = run_ok(bin().args(["train", "--help"]));
    let h = String::from_utf8_lossy(&h.stdout);
    for want in ["--print-config", "[rl]", "[rollout]", "lr=", "--force"] {
        assert!(h.contains(want), "train --help lacks {want}:\n{h}");
    }
    let h = run_ok(bin().args(["compare", "--help"]));
    assert!(String::from_utf8_lossy(&h.stdout).contains("--backend"));
    let h = run_ok(bin().args(["eval", "--help"]));
    let h = String::from_utf8_lossy(&h.stdout);
    assert!(h.contains("default: 3 for add"), "{h}");
    assert!(h.contains("--input-key"), "{h}");
    // Logs redirected to a pipe carry no colour codes.
    let d = tempdir("plain-logs");
    let o = run_ok(
        bin()
            .args([
                "sft", "--task", "add", "--digits", "1", "--preset", "tiny", "--steps", "1",
            ])
            .args([
                "--batch-size",
                "2",
                "--eval-n",
                "0",
                "--log",
                "debug",
                "--out",
            ])
            .arg(d.join("m")),
    );
    assert!(!String::from_utf8_lossy(&o.stderr).contains('\x1b'));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn grpo_step_refuses_to_save_a_model_a_huge_lr_broke() {
    use rolloutpipe_backends::{ModelConfig, Weights, save_model_dir};
    let d = tempdir("grpo-huge-lr");
    let model = d.join("model");
    let cfg = ModelConfig::tiny();
    save_model_dir(&model, &cfg, &Weights::random(&cfg, 3).unwrap()).unwrap();
    let batch = d.join("batch.json");
    std::fs::write(
        &batch,
        serde_json::json!({"groups": [{"prompt": [1, 2], "responses": [
            {"tokens": [3, 4], "reward": 1.0}, {"tokens": [5], "reward": 0.0}]}]})
        .to_string(),
    )
    .unwrap();
    let step = |lr: &str, out: &Path| {
        let mut c = bin();
        c.args(["grpo-step", "--model"])
            .arg(&model)
            .arg("--batch")
            .arg(&batch)
            .args(["--lr", lr, "--out"])
            .arg(out);
        c
    };
    let out = d.join("huge");
    let err = run_err(&mut step("1e30", &out));
    one_line_error("--lr 1e30", &err);
    assert!(err.contains("--lr"), "{err}");
    assert!(
        !out.join("model.safetensors").exists(),
        "a broken model was saved"
    );
    // A sane rate still saves.
    let ok = d.join("ok");
    run_ok(&mut step("1e-3", &ok));
    assert!(ok.join("model.safetensors").is_file());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn compare_keeps_the_measured_table_when_its_simulation_fails() {
    let d = tempdir("compare-sim-fails");
    let cfg = tiny_config(&d);
    let out = d.join("cmp");
    // The simulator's input file cannot be written (a directory is in its place), so the
    // simulation fails after both real runs finished (--force: --out is not empty).
    std::fs::create_dir_all(out.join("sim_measured.toml")).unwrap();
    let err = run_err(
        bin()
            .args(["compare", "--backend", "cpu", "--force", "--config"])
            .arg(&cfg)
            .args(["--set", "run.steps=2", "--repeats", "2", "--out"])
            .arg(&out),
    );
    one_line_error("compare", &err);
    assert!(
        err.contains("compare.md") && err.contains("simulat"),
        "{err}"
    );
    let table = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(table.contains("| sync | measured"), "{table}");
    assert!(table.contains("| rolloutpipe | measured"), "{table}");
    assert!(table.contains("simulation of these runs failed"), "{table}");
    // Two interleaved rounds, each run in its own directory, paired against the baseline.
    assert!(table.contains("vs sync (paired by round)"), "{table}");
    assert!(table.contains("rolloutpipe round 1"), "{table}");
    for run in [
        "sync/rep0",
        "rolloutpipe/rep0",
        "sync/rep1",
        "rolloutpipe/rep1",
    ] {
        assert!(out.join(run).join("metrics.jsonl").is_file(), "{run}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}
