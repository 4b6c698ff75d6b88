//! Weight sync between a trainer and rollout engines.
//!
//! A sync is two halves so that it also works across threads: the trainer takes a
//! [`WeightSnapshot`] for the engine's [`SyncTarget`] (its device and weight dtype), and the
//! engine loads it. When both sides live on the same device the snapshot is a device-side
//! copy (`SnapshotPayload::Device`) that the engine copies again on the device; otherwise it
//! is host tensors already converted to the engine's dtype (`SnapshotPayload::Host`).
//! `Trainer::sync_to` runs both halves when trainer and engine are in one thread.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::tensor::{DType, TypedTensor};
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::weights::{Weights, param_specs};

/// Where a backend keeps its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceId {
    /// Host memory (the CPU backend): any two CPU backends of a process share it.
    Host,
    /// One wgpu device, by the process-unique number [`next_device_number`] gave it.
    Wgpu(u64),
    /// One CUDA context: ordinal and process-unique context number.
    Cuda {
        /// Device ordinal.
        ordinal: u32,
        /// Process-unique number of the context.
        context: u64,
    },
}

/// A process-unique number for a newly opened device or context, so that two backends can
/// tell whether they share one.
pub fn next_device_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What an engine wants a snapshot to be: on which device, in which dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncTarget {
    /// The engine's device.
    pub device: DeviceId,
    /// The engine's weight storage type.
    pub dtype: DType,
}

/// A device-resident snapshot: an opaque handle only a backend of that device understands.
#[derive(Clone)]
pub struct DeviceSnapshot {
    /// The device the handle lives on.
    pub device: DeviceId,
    /// Storage type of the snapshot's tensors.
    pub dtype: DType,
    /// Backend-specific handle (buffers, a host array); the loading backend downcasts it.
    pub handle: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for DeviceSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSnapshot")
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

/// The payload of a snapshot.
#[derive(Debug, Clone)]
pub enum SnapshotPayload {
    /// Stays on one device.
    Device(DeviceSnapshot),
    /// Host tensors in [`param_specs`] order, with their names.
    Host(Vec<(String, TypedTensor)>),
}

/// A copy of a trainer's weights, made for one kind of engine.
#[derive(Debug, Clone)]
pub struct WeightSnapshot {
    /// The model the weights belong to.
    pub config: ModelConfig,
    /// The tensors.
    pub payload: SnapshotPayload,
}

/// Which path a sync took (reported so that tests and logs can tell a fast path happened).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPath {
    /// Device to device, no host copy.
    SameDevice,
    /// Through host memory.
    Host,
}

impl WeightSnapshot {
    /// A host snapshot of `w` in `dtype` (the fallback every backend can produce).
    pub fn host(cfg: &ModelConfig, w: &Weights, dtype: DType) -> Result<Self> {
        w.validate(cfg)?;
        let mut out = Vec::with_capacity(w.tensors.len());
        for (name, shape) in param_specs(cfg) {
            let t = w.get(&name)?;
            let data = super::tensor::TensorData::from_f32(&t.data, dtype);
            out.push((name, TypedTensor::new(shape, data)?));
        }
        Ok(Self {
            config: cfg.clone(),
            payload: SnapshotPayload::Host(out),
        })
    }

    /// The path loading this snapshot into an engine on `device` takes.
    pub fn path_to(&self, device: DeviceId) -> SyncPath {
        match &self.payload {
            SnapshotPayload::Device(d) if d.device == device => SyncPath::SameDevice,
            _ => SyncPath::Host,
        }
    }

    /// Checks that the snapshot is of the engine's model.
    pub fn check_config(&self, cfg: &ModelConfig) -> Result<()> {
        if &self.config != cfg {
            return Err(BackendError::invalid(
                "weight snapshot",
                "it is of another model configuration than the engine's",
            ));
        }
        Ok(())
    }

    /// The host tensors as f32 `Weights`, checked against `cfg` (for engines that load from
    /// the host); a device snapshot is refused, since only its own backend can read it.
    pub fn host_weights(&self, cfg: &ModelConfig) -> Result<Weights> {
        self.check_config(cfg)?;
        let SnapshotPayload::Host(ts) = &self.payload else {
            return Err(BackendError::invalid(
                "weight snapshot",
                "it lives on another device; take a host snapshot for this engine",
            ));
        };
        let mut w = Weights::default();
        for (name, t) in ts {
            let tensor = crate::weights::Tensor::new(t.shape.clone(), t.data.to_f32())?;
            w.tensors.insert(name.clone(), tensor);
        }
        w.validate(cfg)?;
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_snapshot_round_trips_and_is_checked() {
        let cfg = ModelConfig::tiny();
        let w = Weights::random(&cfg, 3).unwrap();
        let s = WeightSnapshot::host(&cfg, &w, DType::F32).unwrap();
        assert_eq!(s.path_to(DeviceId::Host), SyncPath::Host);
        assert_eq!(s.host_weights(&cfg).unwrap(), w);
        let b = WeightSnapshot::host(&cfg, &w, DType::Bf16).unwrap();
        let back = b.host_weights(&cfg).unwrap();
        let (x, y) = (
            &w.tensors["model.norm.weight"],
            &back.tensors["model.norm.weight"],
        );
        for (a, b) in x.data.iter().zip(&y.data) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} vs {b}");
        }
        let mut other = cfg.clone();
        other.num_hidden_layers += 1;
        assert!(s.host_weights(&other).is_err());
        assert_ne!(next_device_number(), next_device_number());
    }
}
