//! A backend named by value: which one, how its weights are stored, its threads and its
//! switches, in one serde type that a CLI flag set, a config section and a wire message can
//! all carry, and the one place that opens a backend from it.
//!
//! ```
//! use rolloutpipe_backends::{BackendKind, BackendSpec, ModelConfig, Weights};
//! let spec: BackendSpec = serde_json::from_str(r#"{"kind": "cpu", "threads": 1}"#).unwrap();
//! assert_eq!(spec.kind, BackendKind::Cpu);
//! let cfg = ModelConfig::tiny();
//! let be = spec.open(&cfg, &Weights::random(&cfg, 0).unwrap()).unwrap();
//! assert_eq!(be.name(), "cpu");
//! // A switch the backend does not have is refused in one line, before anything is built.
//! let bad = BackendSpec { lookahead: true, ..spec };
//! assert!(bad.validate().unwrap_err().to_string().contains("look-ahead"));
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::cpu::CpuBackend;
use crate::error::{BackendError, Result};
use crate::seam::{DType, Policy, RolloutEngine, Trainer};
use crate::weights::{Weights, load_model_dir};

/// Which backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The f32 CPU reference.
    #[default]
    Cpu,
    /// The portable GPU backend (WGSL on any wgpu adapter).
    Wgpu,
    /// The CUDA backend (PTX through cudarc), with the `cuda` feature.
    Cuda,
}

impl BackendKind {
    /// Every kind, in order.
    pub const ALL: [BackendKind; 3] = [BackendKind::Cpu, BackendKind::Wgpu, BackendKind::Cuda];

    /// The backend's name (`cpu`, `wgpu`, `cuda`), as [`BackendInfo::name`](crate::BackendInfo::name).
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }

    /// Why this kind cannot run in this process, or `None` when it can be tried: a build
    /// without its feature, or for CUDA no loadable driver.
    pub fn unavailable(self) -> Option<String> {
        match self {
            BackendKind::Cpu => None,
            BackendKind::Wgpu if cfg!(feature = "wgpu") => None,
            BackendKind::Wgpu => Some(
                "this build has no wgpu support (rebuild with `--features wgpu`, a default feature)"
                    .into(),
            ),
            BackendKind::Cuda => crate::cuda::availability(),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                BackendError::invalid("backend", format!("{s:?} is not one of cpu, wgpu, cuda"))
            })
    }
}

/// A backend to open (see the module docs). Every field has a default, so a config names only
/// what it changes; unknown fields are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackendSpec {
    /// Which backend.
    pub kind: BackendKind,
    /// How an engine stores its weights (`f32`, or `bf16` / `f16` on the CPU and wgpu
    /// backends: generation only, f32 compute). A trainer keeps f32 master weights.
    pub dtype: DType,
    /// CPU threads (0 = one per core; the GPU backends ignore it).
    pub threads: usize,
    /// Every matrix product on tensor cores (wgpu only; refused in one line where the adapter
    /// has none).
    pub tensor_cores: bool,
    /// Look-ahead decoding (wgpu only): each submission also queues the next step.
    pub lookahead: bool,
    /// The CUDA device ordinal.
    pub device: usize,
}

impl Default for BackendSpec {
    fn default() -> Self {
        Self {
            kind: BackendKind::Cpu,
            dtype: DType::F32,
            threads: 0,
            tensor_cores: false,
            lookahead: false,
            device: 0,
        }
    }
}

impl BackendSpec {
    /// The CPU backend on `threads` threads.
    pub fn cpu(threads: usize) -> Self {
        Self {
            threads,
            ..Self::default()
        }
    }

    /// A backend of `kind` with every other setting at its default.
    pub fn of(kind: BackendKind) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }

    /// Refuses, in one line naming the setting, a combination the backend does not have.
    pub fn validate(&self) -> Result<()> {
        let kind = self.kind;
        if self.lookahead && kind != BackendKind::Wgpu {
            return Err(BackendError::invalid(
                "lookahead",
                format!(
                    "look-ahead decoding needs the wgpu backend: the {kind} backend runs one step at a time"
                ),
            ));
        }
        if self.tensor_cores && kind != BackendKind::Wgpu {
            return Err(BackendError::invalid(
                "tensor_cores",
                format!(
                    "tensor cores need the wgpu backend: the {kind} backend has no cooperative-matrix path"
                ),
            ));
        }
        if self.dtype != DType::F32 && kind == BackendKind::Cuda {
            return Err(BackendError::invalid(
                "dtype",
                format!(
                    "{} weights need the cpu or wgpu backend: the cuda backend stores f32 weights",
                    self.dtype.name().to_ascii_lowercase()
                ),
            ));
        }
        Ok(())
    }

    /// Opens the backend in both roles on `cfg` with weights `w` (checked first). A 16-bit
    /// `dtype` gives an engine that refuses training calls.
    pub fn open(&self, cfg: &ModelConfig, w: &Weights) -> Result<Box<dyn Policy>> {
        self.validate()?;
        if let Some(why) = self.kind.unavailable() {
            return Err(BackendError::Device(why));
        }
        match self.kind {
            BackendKind::Cpu => Ok(Box::new(CpuBackend::with_dtype(
                cfg,
                w,
                self.threads,
                self.dtype,
            )?)),
            BackendKind::Wgpu => self.open_wgpu(cfg, w),
            BackendKind::Cuda => self.open_cuda(cfg, w),
        }
    }

    /// Opens the backend as a rollout engine ([`BackendSpec::open`]).
    pub fn open_engine(&self, cfg: &ModelConfig, w: &Weights) -> Result<Box<dyn RolloutEngine>> {
        Ok(self.open(cfg, w)? as Box<dyn RolloutEngine>)
    }

    /// Opens the backend as a trainer ([`BackendSpec::open`]); it keeps f32 master weights,
    /// so a 16-bit `dtype` is refused.
    pub fn open_trainer(&self, cfg: &ModelConfig, w: &Weights) -> Result<Box<dyn Trainer>> {
        crate::model::check::trainable(self.dtype, "trainer dtype")?;
        Ok(self.open(cfg, w)? as Box<dyn Trainer>)
    }

    /// Opens the backend on a model directory (`config.json` + safetensors) the way that holds
    /// the least memory: the CPU backend converts the memory-mapped tensors straight into its
    /// own storage (no named f32 copy of the model), the others load named tensors first.
    pub fn open_dir(&self, dir: &Path) -> Result<Box<dyn Policy>> {
        self.validate()?;
        match self.kind {
            BackendKind::Cpu => Ok(Box::new(CpuBackend::from_model_dir(
                dir,
                self.threads,
                self.dtype,
            )?)),
            _ => {
                let (cfg, w) = load_model_dir(dir)?;
                self.open(&cfg, &w)
            }
        }
    }

    #[cfg(feature = "wgpu")]
    fn open_wgpu(&self, cfg: &ModelConfig, w: &Weights) -> Result<Box<dyn Policy>> {
        let mut b = crate::wgpu::WgpuBackend::with_dtype(cfg, w, self.dtype)?;
        if self.tensor_cores {
            b.set_tensor_cores(true)?;
        }
        b.set_lookahead(self.lookahead);
        Ok(Box::new(b))
    }

    #[cfg(not(feature = "wgpu"))]
    fn open_wgpu(&self, _cfg: &ModelConfig, _w: &Weights) -> Result<Box<dyn Policy>> {
        Err(BackendError::Device(
            BackendKind::Wgpu.unavailable().unwrap_or_default(),
        ))
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(&self, cfg: &ModelConfig, w: &Weights) -> Result<Box<dyn Policy>> {
        Ok(Box::new(crate::cuda::CudaBackend::new(
            cfg,
            w,
            self.device,
        )?))
    }

    #[cfg(not(feature = "cuda"))]
    fn open_cuda(&self, _cfg: &ModelConfig, _w: &Weights) -> Result<Box<dyn Policy>> {
        Err(BackendError::Device(
            BackendKind::Cuda.unavailable().unwrap_or_default(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_names_every_field_and_defaults_the_rest() {
        let s: BackendSpec = serde_json::from_str(
            r#"{"kind": "wgpu", "dtype": "bf16", "tensor_cores": true, "lookahead": true}"#,
        )
        .unwrap();
        assert_eq!(
            s,
            BackendSpec {
                kind: BackendKind::Wgpu,
                dtype: DType::Bf16,
                tensor_cores: true,
                lookahead: true,
                ..BackendSpec::default()
            }
        );
        let back: BackendSpec = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        assert_eq!(
            serde_json::from_str::<BackendSpec>("{}").unwrap(),
            BackendSpec::default()
        );
        let e = serde_json::from_str::<BackendSpec>(r#"{"kind": "tpu"}"#).unwrap_err();
        assert!(e.to_string().contains("tpu"), "{e}");
        let e = serde_json::from_str::<BackendSpec>(r#"{"thread": 2}"#).unwrap_err();
        assert!(e.to_string().contains("thread"), "{e}");
        assert_eq!("cuda".parse::<BackendKind>().unwrap(), BackendKind::Cuda);
        assert!("gpu".parse::<BackendKind>().is_err());
    }

    #[test]
    fn switches_a_backend_lacks_are_refused_by_name() {
        let cases = [
            (
                BackendSpec {
                    lookahead: true,
                    ..BackendSpec::cpu(1)
                },
                "look-ahead",
            ),
            (
                BackendSpec {
                    tensor_cores: true,
                    ..BackendSpec::of(BackendKind::Cuda)
                },
                "tensor cores",
            ),
            (
                BackendSpec {
                    dtype: DType::F16,
                    ..BackendSpec::of(BackendKind::Cuda)
                },
                "f16 weights",
            ),
        ];
        for (s, says) in cases {
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(says) && !e.contains('\n'), "{e}");
        }
        let fine = BackendSpec {
            kind: BackendKind::Wgpu,
            dtype: DType::Bf16,
            lookahead: true,
            tensor_cores: true,
            ..BackendSpec::default()
        };
        assert!(fine.validate().is_ok());
    }

    #[test]
    fn a_16_bit_cpu_engine_opens_and_refuses_to_train() {
        let cfg = ModelConfig::tiny();
        let w = Weights::random(&cfg, 1).unwrap();
        let spec = BackendSpec {
            dtype: DType::Bf16,
            ..BackendSpec::cpu(1)
        };
        let e = spec.open_engine(&cfg, &w).unwrap();
        assert_eq!(e.weight_dtype(), DType::Bf16);
        assert!(spec.open_trainer(&cfg, &w).is_err());
        assert!(BackendSpec::cpu(1).open_trainer(&cfg, &w).is_ok());
    }
}
