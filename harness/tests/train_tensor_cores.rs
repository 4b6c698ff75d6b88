//! `rollout.tensor_cores` and `trainer.tensor_cores` end to end: `train` refuses either where
//! the wgpu adapter has no tensor cores (this machine's Mesa 22.3 lavapipe) in one line, before
//! any run directory is written; remote engine and trainer hosts refuse them the same way from
//! their `Init`; and where the adapter has them (a Mesa 26 lavapipe, `scripts/ci.d/coop.sh`),
//! tensor-core engines and a tensor-core trainer train in-process and behind the wire alike,
//! and differently from f32 ones. Tests that need a machine of the other kind print SKIP
//! (`ROLLOUTPIPE_REQUIRE_COOP=1` makes the tensor-core runs' skip an error).
mod support;

use std::path::{Path, PathBuf};

use rolloutpipe_backends::{DType, ModelConfig, Weights};
use rolloutpipe_harness::train::TrainConfig;
use rolloutpipe_harness::train::msg::{EngineOptions, TrainCmd};
use rolloutpipe_harness::train::remote::protocol::{
    EngineInit, EngineMsg, EngineReply, TrainerAnswer, TrainerInit, TrainerMsg,
};
use rolloutpipe_harness::train::remote::wire;
use rolloutpipe_harness::train::remote::{EngineHost, TrainerHost};
use support::cli::{bin, run_err, tempdir};
use support::train::TINY_MODEL;

/// What the default wgpu adapter says about tensor cores: `None` (after a SKIP line) where
/// the binary has no wgpu or the machine no adapter; `Some(None)` where it has tensor cores;
/// `Some(Some(why))` with its one-line refusal where it has none.
fn adapter(test: &str) -> Option<Option<String>> {
    #[cfg(feature = "wgpu")]
    {
        match rolloutpipe_backends::wgpu::Gpu::new() {
            Ok(Some(g)) => Some(g.coop_refusal().map(str::to_owned)),
            Ok(None) => {
                eprintln!("SKIP: no wgpu adapter; {test} did not run");
                None
            }
            Err(e) => {
                eprintln!("SKIP: the wgpu adapter did not open ({e}); {test} did not run");
                None
            }
        }
    }
    #[cfg(not(feature = "wgpu"))]
    {
        eprintln!("SKIP: built without the wgpu feature; {test} did not run");
        None
    }
}

/// `train` with tensor cores (`key`) on the wgpu backend, one step (it never gets that far).
fn train_tc(out: &Path, key: &str) -> std::process::Command {
    let mut c = bin();
    c.args(["train", "--backend", "wgpu"])
        .args(["--set", &format!("{key}=true")])
        .args(["--set", "run.steps=1", "--set", "run.progress=false"])
        // Small enough that, were the refusal late, the run would reach the engines quickly.
        .args(["--set", "sft.steps=0", "--set", "run.eval_problems=8"])
        .args(["--set", "run.test_problems=0"])
        .arg("--out")
        .arg(out);
    c
}

/// The refusal is the run's one error line, the last line, naming the key and exactly what
/// the adapter lacks (`why`, as the test process's own `Gpu::new` words it). The driver may
/// log lines of its own before it (EGL probing, `XDG_RUNTIME_DIR`); none mentions the key.
fn assert_refused(what: &str, stderr: &str, key: &str, why: &str) {
    for bad in ["panicked", "backtrace", "RUST_BACKTRACE"] {
        assert!(!stderr.contains(bad), "{what}: {bad:?} in\n{stderr}");
    }
    let ours: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("tensor_cores"))
        .collect();
    assert_eq!(
        ours.len(),
        1,
        "{what}: expected one line naming the key in\n{stderr}"
    );
    let line = ours[0];
    assert_eq!(
        stderr.trim_end().lines().last(),
        Some(line),
        "{what}: the refusal is not the last line:\n{stderr}"
    );
    // `train` words it on one line, whatever whitespace the driver's message had.
    let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(line, format!("error: {key}: {why}"), "{what}");
    assert!(
        line.contains("wgpu-cooperative-matrix") || line.contains("shader-f16"),
        "{what}: the refusal names no missing feature: {line}"
    );
}

/// Every file under `dir` with its bytes, sorted by path.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.push((p.clone(), Vec::new()));
                todo.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// On an adapter without cooperative matrices, `train` with `rollout.tensor_cores = true`,
/// `trainer.tensor_cores = true` or both fails in one line naming the keys and the missing
/// feature, and writes nothing: a fresh `--out` is not created, an existing one keeps the
/// user's files byte for byte (`--force` included), and a `--config` file is only read.
#[test]
fn train_tensor_cores_without_cooperative_matrices_is_refused_before_the_run_directory() {
    let test = "the tensor-core refusal test";
    let Some(refusal) = adapter(test) else {
        return;
    };
    let Some(why) = refusal else {
        eprintln!("SKIP: this adapter has tensor cores; {test} did not run");
        return;
    };
    let dir = tempdir("tensor-cores");

    // A config file setting the keys, and a fresh --out.
    for (keys, sections) in [
        ("rollout.tensor_cores", "[rollout]\ntensor_cores = true\n"),
        ("trainer.tensor_cores", "[trainer]\ntensor_cores = true\n"),
        (
            "rollout.tensor_cores, trainer.tensor_cores",
            "[rollout]\ntensor_cores = true\n[trainer]\ntensor_cores = true\n",
        ),
    ] {
        let cfg = dir.join("tc.toml");
        std::fs::write(
            &cfg,
            format!(
                "[run]\nbackend = \"wgpu\"\nsteps = 1\nprogress = false\neval_problems = 8\n\
                 test_problems = 0\n{TINY_MODEL}[sft]\nsteps = 0\n{sections}"
            ),
        )
        .unwrap();
        let out = dir.join("run");
        let before = snapshot(&dir);
        let err = run_err(
            bin()
                .arg("train")
                .arg("--config")
                .arg(&cfg)
                .arg("--out")
                .arg(&out),
        );
        assert_refused(&format!("--config {keys}"), &err, keys, &why);
        assert!(!out.exists(), "the refused run created {}", out.display());
        assert_eq!(
            snapshot(&dir),
            before,
            "the refused run changed {}",
            dir.display()
        );
        std::fs::remove_file(&cfg).unwrap();
    }

    // --set into an existing directory holding the user's files, with and without --force.
    let mine = dir.join("mine");
    std::fs::create_dir_all(mine.join("sub")).unwrap();
    std::fs::write(mine.join("notes.txt"), "keep me\n").unwrap();
    std::fs::write(mine.join("config.toml"), "# not a run's config\n").unwrap();
    std::fs::write(mine.join("sub").join("data.bin"), [0u8, 1, 2, 255]).unwrap();
    let before = snapshot(&dir);
    for key in ["rollout.tensor_cores", "trainer.tensor_cores"] {
        let err = run_err(&mut train_tc(&mine, key));
        assert_refused(&format!("--set {key}"), &err, key, &why);
        assert_eq!(
            snapshot(&dir),
            before,
            "the refused run changed the user's files"
        );
        let err = run_err(train_tc(&mine, key).arg("--force"));
        assert_refused(&format!("--set {key} --force"), &err, key, &why);
        assert_eq!(
            snapshot(&dir),
            before,
            "the refused --force run changed the user's files"
        );
    }

    std::fs::remove_dir_all(&dir).unwrap();
}

/// A remote trainer host builds its trainer from `Init`'s config: `trainer.tensor_cores` with
/// a backend other than wgpu is a `Fatal` naming the key (every machine); on wgpu it is
/// `Fatal` with the adapter's one-line refusal where it has no tensor cores and `Ready` where
/// it has them. A refused host has no trainer: a micro-batch after it is an error.
#[test]
fn a_remote_trainer_host_honours_tensor_cores_from_its_init() {
    let mc = ModelConfig::tiny();
    let w = Weights::random(&mc, 12).unwrap();
    let blob = wire::weights_blob(&w).unwrap();
    let init = |backend: &str| {
        let mut config = TrainConfig::default_config().unwrap();
        config.run.backend = backend.into();
        config.trainer.tensor_cores = true;
        let msg = TrainerMsg::Init(Box::new(TrainerInit {
            config,
            model: mc.to_json(),
            adam_step: None,
            reference: false,
        }));
        let mut host = TrainerHost::new();
        let reply = host
            .handle(&wire::encode(&msg, &[blob.as_slice()]))
            .unwrap();
        (host, wire::decode::<TrainerAnswer>(&reply).unwrap().0)
    };
    let batch = wire::encode(&TrainerMsg::Cmd(TrainCmd::MicroBatch(vec![])), &[]);

    let (mut host, reply) = init("cpu");
    assert_eq!(
        reply,
        TrainerAnswer::Fatal(
            "trainer: trainer.tensor_cores needs the wgpu backend: the cpu backend has no \
             cooperative-matrix path"
                .into()
        )
    );
    assert!(
        host.handle(&batch).is_err(),
        "a refused host ran a micro-batch"
    );

    let Some(refusal) = adapter("the wgpu half of the trainer-host test") else {
        return;
    };
    let (mut host, reply) = init("wgpu");
    match refusal {
        Some(why) => {
            let TrainerAnswer::Fatal(m) = reply else {
                panic!("tensor cores without cooperative matrices answered {reply:?}")
            };
            assert_eq!(m.lines().count(), 1, "{m}");
            assert!(
                m.starts_with("trainer: trainer.tensor_cores: ") && m.ends_with(&why),
                "{m}"
            );
            assert!(
                host.handle(&batch).is_err(),
                "a refused host ran a micro-batch"
            );
        }
        None => assert_eq!(reply, TrainerAnswer::Ready),
    }
}

/// A remote engine host builds its engine from `Init`: `tensor_cores` with a backend other
/// than wgpu is a `Fatal` naming the key (every machine); on wgpu it is `Fatal` with the
/// adapter's refusal where it has no tensor cores and `Ready` where it has them. A refused
/// host has no engine: a `Step` after it is an error.
#[test]
fn a_remote_engine_host_honours_tensor_cores_from_its_init() {
    let mc = ModelConfig::tiny();
    let w = Weights::random(&mc, 11).unwrap();
    let blob = wire::weights_blob(&w).unwrap();
    let init = |backend: &str, tensor_cores: bool| {
        let msg = EngineMsg::Init(Box::new(EngineInit {
            engine: 0,
            backend: backend.into(),
            options: EngineOptions {
                threads: 1,
                dtype: DType::F32,
                tensor_cores,
                lookahead: false,
            },
            model: mc.to_json(),
            fail_at_request: None,
            reference: false,
            perturb_mux: false,
        }));
        let mut host = EngineHost::new();
        let reply = host.handle(&wire::encode(&msg, &[]), Some(&blob)).unwrap();
        (host, wire::decode::<EngineReply>(&reply).unwrap().0)
    };
    let step = EngineMsg::Step {
        adds: vec![],
        resumes: vec![],
        cancels: vec![],
        decode: true,
    };
    let step = wire::encode(&step, &[]);

    // Off, the cpu engine builds; on, it is refused by name.
    assert_eq!(init("cpu", false).1, EngineReply::Ready);
    let (mut host, reply) = init("cpu", true);
    assert_eq!(
        reply,
        EngineReply::Fatal(
            "rollout engine 0: rollout.tensor_cores needs the wgpu backend: the cpu backend has \
             no cooperative-matrix path"
                .into()
        )
    );
    assert!(
        host.handle(&step, None).is_err(),
        "a refused host ran a Step"
    );

    let Some(refusal) = adapter("the wgpu half of the engine-host test") else {
        return;
    };
    let (mut host, reply) = init("wgpu", true);
    match refusal {
        Some(why) => {
            let EngineReply::Fatal(m) = reply else {
                panic!("tensor cores without cooperative matrices answered {reply:?}")
            };
            assert_eq!(m.lines().count(), 1, "{m}");
            assert!(
                m.starts_with("rollout engine 0: rollout.tensor_cores: ") && m.ends_with(&why),
                "{m}"
            );
            assert!(
                host.handle(&step, None).is_err(),
                "a refused host ran a Step"
            );
        }
        None => {
            assert_eq!(reply, EngineReply::Ready);
            host.handle(&step, None).unwrap();
        }
    }
}

#[cfg(feature = "wgpu")]
mod with_tensor_cores {
    use std::path::PathBuf;

    use crate::support::loopback::Loopback;
    use rolloutpipe_harness::train::{Local, TrainConfig, run_with_transport};

    use crate::support::train::{FRESH, bits, scratch, trained};

    fn dir(name: &str) -> PathBuf {
        scratch("tensor-cores", name)
    }

    /// Whether the adapter has tensor cores; where not, a SKIP line (a panic under
    /// `ROLLOUTPIPE_REQUIRE_COOP=1`).
    fn has_tensor_cores(test: &str) -> bool {
        let Some(refusal) = super::adapter(test) else {
            return false;
        };
        if let Some(why) = refusal {
            if std::env::var("ROLLOUTPIPE_REQUIRE_COOP").is_ok_and(|v| v == "1") {
                panic!("ROLLOUTPIPE_REQUIRE_COOP=1 but {why}");
            }
            eprintln!("SKIP: {why}; {test} did not run");
            return false;
        }
        true
    }

    /// One sync step of the tiny job on wgpu (after a 24-step SFT warm start), logπ_old from
    /// the rollout (so the engines' numerics reach the update), tensor cores for the engines
    /// and the trainer as `engines` and `trainer` say.
    fn tiny(engines: bool, trainer: bool) -> TrainConfig {
        let (e, t) = (
            format!("rollout.tensor_cores={engines}"),
            format!("trainer.tensor_cores={trainer}"),
        );
        let cfg = TrainConfig::tiny()
            .set(&[
                "run.steps=1",
                "run.mode=sync",
                "run.backend=wgpu",
                "run.eval_problems=8",
                "sft.steps=24",
                "rl.micro_batch=4",
                "rl.old_logprobs=rollout",
                &e,
                &t,
            ])
            .unwrap();
        cfg.validate().unwrap();
        cfg
    }

    /// Runs `tc` (tensor cores where `who` says) in-process and behind the wire, and the f32
    /// job beside it: the tensor-core runs train the same samples and weights bit for bit, and
    /// their weights are not the f32 run's. `tag` names the scratch directories.
    fn alike_and_not_f32(tag: &str, who: &str, tc: &TrainConfig) {
        let f32_cfg = tiny(false, false);
        let dirs = ["f32", "tc", "tc-remote"].map(|d| dir(&format!("{tag}-{d}")));
        let full = run_with_transport(&f32_cfg, &dirs[0], FRESH, &Local).unwrap();
        let local = run_with_transport(tc, &dirs[1], FRESH, &Local).unwrap();
        let lb = Loopback::new(tc);
        let remote = run_with_transport(tc, &dirs[2], FRESH, &lb.transport()).unwrap();
        assert!(!local.trained.is_empty(), "{who}: no sample trained");
        assert_eq!(
            trained(&local),
            trained(&remote),
            "{who}: the same samples trained"
        );
        assert!(
            bits(&local.weights) == bits(&remote.weights),
            "{who}: weights differ in-process vs remote"
        );
        assert!(
            bits(&full.weights) != bits(&local.weights),
            "{who}: the weights are bit-identical to the f32 run's"
        );
        for d in dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    /// Where the adapter has tensor cores: the engines run on them in-process and behind the
    /// wire alike (same samples, same weights bit for bit), and not like f32 engines (the
    /// update moves). Were the flag dropped on the wire, the remote run would match the f32
    /// one instead; were it never applied, all three would agree.
    #[test]
    fn tensor_core_engines_train_in_process_and_remote_alike() {
        if has_tensor_cores("the tensor-core engines' run") {
            alike_and_not_f32("engines", "tensor-core engines", &tiny(true, false));
        }
    }

    /// Where the adapter has tensor cores: a tensor-core trainer (SFT warm start and the GRPO
    /// step, forward and backward products) trains in-process and behind the wire alike (same
    /// weights bit for bit: the flag travels in the trainer's `Init`), and not like an f32
    /// trainer.
    #[test]
    fn a_tensor_core_trainer_trains_in_process_and_remote_alike() {
        if has_tensor_cores("the tensor-core trainer's run") {
            alike_and_not_f32("trainer", "tensor-core trainer", &tiny(false, true));
        }
    }
}
