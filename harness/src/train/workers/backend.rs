//! Building a worker's backend from its name and settings: the trainer, a rollout engine, and
//! the check, before any work, that this machine can run the backend a config names. These are
//! the only places a backend name is turned into a backend.
use rolloutpipe_backends::optim::AdamState;
use rolloutpipe_backends::{
    CpuBackend, DType, ModelConfig, Policy, RolloutEngine, SyncTarget, Trainer, Weights,
};

use crate::train::config::TrainConfig;
use crate::train::msg::EngineOptions;

/// The trainer's backend: any seam-v2 [`Trainer`]; its AdamW moments leave it only for
/// checkpoints (`TrainCmd::Export { optimizer: true }`).
pub struct TrainerBackend(Box<dyn Trainer>);

impl TrainerBackend {
    /// The backend through the trainer interface.
    pub fn as_dyn(&mut self) -> &mut dyn Trainer {
        self.0.as_mut()
    }

    /// Restores AdamW moments from a checkpoint.
    pub fn set_optimizer_state(&mut self, st: AdamState) -> anyhow::Result<()> {
        Ok(self.0.restore_optimizer(st)?)
    }
}

/// A rollout engine's backend: any seam-v2 [`RolloutEngine`], and how many decode iterations
/// a request added between two of them may wait before its first step (1 with look-ahead
/// decoding, whose next step was queued before the request arrived; else 0).
pub struct EngineBackend(Box<dyn RolloutEngine>, i64);

impl EngineBackend {
    /// Decode iterations a newly added request may run without a step (see the type).
    pub fn admission_lag(&self) -> i64 {
        self.1
    }

    /// The backend through the engine interface.
    pub fn as_dyn(&mut self) -> &mut dyn RolloutEngine {
        self.0.as_mut()
    }

    /// Where and in which dtype the engine wants its weight snapshots.
    pub fn sync_target(&self) -> SyncTarget {
        self.0.sync_target()
    }
}

/// Builds a trainer by name with `threads` CPU threads (ignored by GPU backends), its
/// products (forward and backward) on tensor cores with `tensor_cores` (`trainer.tensor_cores`;
/// wgpu only, refused in one line where the adapter has none).
pub fn make_trainer(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
    tensor_cores: bool,
) -> anyhow::Result<TrainerBackend> {
    let b: Box<dyn Trainer> = match name {
        "wgpu" if tensor_cores => make_wgpu_tensor_cores(cfg, w)?,
        other if tensor_cores => anyhow::bail!(
            "trainer.tensor_cores needs the wgpu backend: the {other} backend has no \
             cooperative-matrix path"
        ),
        _ => make_backend(name, cfg, w, threads)?,
    };
    Ok(TrainerBackend(b))
}

impl EngineOptions {
    /// The engine options of `cfg`'s `[rollout]`.
    pub fn of(cfg: &TrainConfig) -> Self {
        Self {
            threads: cfg.rollout.threads_per_engine,
            dtype: cfg.rollout.dtype.dtype(),
            tensor_cores: cfg.rollout.tensor_cores,
            lookahead: cfg.rollout.lookahead,
        }
    }
}

/// Builds a rollout engine by name as `opts` say: its weights stored in `opts.dtype` (half
/// storage on the CPU and wgpu backends; the config refuses it on cuda, and so does this, by
/// name), its forward products on tensor cores with `opts.tensor_cores` (wgpu only; refused
/// in one line where the adapter has none), and decoding a step ahead with `opts.lookahead`
/// (wgpu only). The trainer's are `trainer.tensor_cores` ([`make_trainer`]).
pub fn make_engine(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    opts: &EngineOptions,
) -> anyhow::Result<EngineBackend> {
    let EngineOptions {
        threads,
        dtype,
        tensor_cores,
        lookahead,
    } = *opts;
    let b: Box<dyn RolloutEngine> = match (name, dtype) {
        ("wgpu", _) => make_wgpu_engine(cfg, w, dtype, tensor_cores, lookahead)?,
        (other, _) if lookahead => anyhow::bail!(
            "rollout.lookahead needs the wgpu backend: the {other} backend runs one step at a time"
        ),
        (other, _) if tensor_cores => anyhow::bail!(
            "rollout.tensor_cores needs the wgpu backend: the {other} backend has no \
             cooperative-matrix path"
        ),
        (_, DType::F32) => make_backend(name, cfg, w, threads)?,
        ("cpu", _) => Box::new(CpuBackend::with_dtype(cfg, w, threads, dtype)?),
        (other, _) => anyhow::bail!(
            "rollout.dtype {:?} needs the cpu or wgpu backend: the {other} backend stores f32 weights",
            dtype.name().to_ascii_lowercase()
        ),
    };
    Ok(EngineBackend(b, i64::from(lookahead)))
}

/// Refuses, before any work, a backend this machine cannot run when `here` (a worker, or the
/// SFT warm start, runs in this process): `wgpu` without its feature or without an adapter,
/// `cuda` without its feature or without a loadable NVIDIA driver, and where `tensor_cores`
/// names the keys that ask for them (`rollout.tensor_cores`, `trainer.tensor_cores`) a wgpu
/// adapter without tensor cores (the adapter's one-line reason,
/// [`rolloutpipe_backends::wgpu::Gpu::coop_refusal`], after the keys). With every worker on
/// other hosts nothing here is checked: they refuse at `Init`, on their own devices.
pub fn check_backend(name: &str, tensor_cores: &[&str], here: bool) -> anyhow::Result<()> {
    match name {
        _ if !here => Ok(()),
        "wgpu" => check_wgpu(tensor_cores),
        "cuda" => match rolloutpipe_backends::cuda::availability() {
            Some(why) => anyhow::bail!("run.backend \"cuda\": {why}"),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Opens the default wgpu adapter as every engine and the trainer will: refuses a machine
/// with none, and the `tensor_cores` keys where it has no tensor cores, in one line.
#[cfg(feature = "wgpu")]
fn check_wgpu(tensor_cores: &[&str]) -> anyhow::Result<()> {
    use rolloutpipe_backends::wgpu::Gpu;
    let key = if tensor_cores.is_empty() {
        "run.backend \"wgpu\"".to_string()
    } else {
        tensor_cores.join(", ")
    };
    let gpu = match Gpu::new() {
        Ok(Some(g)) => g,
        Ok(None) => anyhow::bail!(
            "{key}: no wgpu adapter found (a Vulkan, Metal or DX12 driver; on Linux without a \
             GPU, Mesa's lavapipe: apt install mesa-vulkan-drivers)"
        ),
        Err(e) => anyhow::bail!("{key}: opening the wgpu adapter: {e}"),
    };
    match gpu.coop_refusal() {
        Some(why) if !tensor_cores.is_empty() => anyhow::bail!("{key}: {why}"),
        _ => Ok(()),
    }
}

#[cfg(not(feature = "wgpu"))]
fn check_wgpu(_tensor_cores: &[&str]) -> anyhow::Result<()> {
    make_wgpu_unavailable()
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu_unavailable<T>() -> anyhow::Result<T> {
    anyhow::bail!(
        "the wgpu backend is not built into this binary; rebuild with `--features wgpu` \
         (it is a default feature) or use --backend cpu"
    )
}

/// Builds a backend by name in both roles; callers keep the role they need.
fn make_backend(
    name: &str,
    cfg: &ModelConfig,
    w: &Weights,
    threads: usize,
) -> anyhow::Result<Box<dyn Policy>> {
    match name {
        "cpu" => Ok(Box::new(CpuBackend::new(cfg, w, threads)?)),
        "wgpu" => make_wgpu(cfg, w),
        "cuda" => make_cuda(cfg, w),
        other => anyhow::bail!("unknown backend {other:?}; valid: cpu, wgpu, cuda"),
    }
}

#[cfg(feature = "wgpu")]
fn make_wgpu(cfg: &ModelConfig, w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    use anyhow::Context;
    let b = rolloutpipe_backends::wgpu::WgpuBackend::new(cfg, w)
        .context("starting the wgpu backend (is there a GPU adapter?)")?;
    Ok(Box::new(b))
}

/// A wgpu engine storing its weights in `dtype` (f32, or bf16 / f16: engine-only, f32
/// compute), its forward products on tensor cores when `tensor_cores` (refused, naming what
/// the adapter lacks, where it has none), decoding a step ahead when `lookahead`.
#[cfg(feature = "wgpu")]
fn make_wgpu_engine(
    cfg: &ModelConfig,
    w: &Weights,
    dtype: DType,
    tensor_cores: bool,
    lookahead: bool,
) -> anyhow::Result<Box<dyn RolloutEngine>> {
    use anyhow::Context;
    let mut b = rolloutpipe_backends::wgpu::WgpuBackend::with_dtype(cfg, w, dtype)
        .context("starting the wgpu backend (is there a GPU adapter?)")?;
    if tensor_cores {
        b.set_tensor_cores(true).context("rollout.tensor_cores")?;
    }
    b.set_lookahead(lookahead);
    Ok(Box::new(b))
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu_engine(
    _cfg: &ModelConfig,
    _w: &Weights,
    _dtype: DType,
    _tensor_cores: bool,
    _lookahead: bool,
) -> anyhow::Result<Box<dyn RolloutEngine>> {
    make_wgpu_unavailable()
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu(_cfg: &ModelConfig, _w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    make_wgpu_unavailable()
}

/// A wgpu trainer whose products, forward and backward, run on tensor cores (refused, naming
/// what the adapter lacks, where it has none).
#[cfg(feature = "wgpu")]
fn make_wgpu_tensor_cores(cfg: &ModelConfig, w: &Weights) -> anyhow::Result<Box<dyn Trainer>> {
    use anyhow::Context;
    let mut b = rolloutpipe_backends::wgpu::WgpuBackend::new(cfg, w)
        .context("starting the wgpu backend (is there a GPU adapter?)")?;
    b.set_tensor_cores(true).context("trainer.tensor_cores")?;
    Ok(Box::new(b))
}

#[cfg(not(feature = "wgpu"))]
fn make_wgpu_tensor_cores(_cfg: &ModelConfig, _w: &Weights) -> anyhow::Result<Box<dyn Trainer>> {
    make_wgpu_unavailable()
}

/// The CUDA backend on device 0. Without the `cuda` feature, or without a loadable NVIDIA
/// driver, this is the one-line reason (never a panic: cudarc panics when no driver loads, so
/// availability is checked first).
fn make_cuda(cfg: &ModelConfig, w: &Weights) -> anyhow::Result<Box<dyn Policy>> {
    #[cfg(feature = "cuda")]
    {
        use anyhow::Context;
        if let Some(why) = rolloutpipe_backends::cuda::availability() {
            anyhow::bail!("run.backend \"cuda\": {why}");
        }
        let b = rolloutpipe_backends::cuda::CudaBackend::new(cfg, w, 0)
            .context("starting the CUDA backend")?;
        Ok(Box::new(b))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (cfg, w);
        anyhow::bail!(
            "run.backend \"cuda\": {}",
            rolloutpipe_backends::cuda::availability().unwrap_or_default()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(lookahead: bool) -> EngineOptions {
        EngineOptions {
            threads: 1,
            dtype: DType::F32,
            tensor_cores: false,
            lookahead,
        }
    }

    /// `rollout.lookahead` reaches the engine: a request added after the first decode
    /// iteration has not started after the second with it (its first step was queued behind
    /// the step already on the device) and has without it; the lag the migration count uses
    /// says so. Other backends refuse it by name.
    #[test]
    fn lookahead_engines_start_a_later_request_one_iteration_later() {
        let mc = ModelConfig::tiny();
        let w = Weights::random(&mc, 3).unwrap();
        let e = make_engine("cpu", &mc, &w, &opts(true)).err().unwrap();
        assert_eq!(
            e.to_string(),
            "rollout.lookahead needs the wgpu backend: the cpu backend runs one step at a time"
        );
        #[cfg(feature = "wgpu")]
        {
            use rolloutpipe_backends::{GenRequest, RequestKey, SamplingParams};
            if !matches!(rolloutpipe_backends::wgpu::Gpu::new(), Ok(Some(_))) {
                eprintln!("SKIP: no wgpu adapter; the look-ahead engine test did not run");
                return;
            }
            let req = |id| GenRequest {
                id: RequestKey(id),
                prompt: vec![1, 2, 3],
                params: SamplingParams {
                    max_new_tokens: 8,
                    seed: id,
                    ..Default::default()
                },
            };
            for lookahead in [false, true] {
                let mut e = make_engine("wgpu", &mc, &w, &opts(lookahead)).unwrap();
                assert_eq!(e.admission_lag(), i64::from(lookahead));
                let be = e.as_dyn();
                be.add_request(req(1)).unwrap();
                be.decode_step().unwrap();
                be.add_request(req(2)).unwrap();
                be.decode_step().unwrap();
                let started = be.export_request(RequestKey(2)).is_ok();
                assert_eq!(started, !lookahead, "lookahead {lookahead}");
            }
        }
    }
}
