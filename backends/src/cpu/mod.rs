//! The CPU reference backend: plain f32 ops (`ops`, `kernel`), the model's storage (`model`)
//! and its [`Ops`](crate::model::ops::Ops) (`model_ops`), generation on the one engine
//! (`decode`), and [`CpuBackend`] implementing both seam roles, [`RolloutEngine`] and
//! [`Trainer`]. Every GPU backend is checked against this one.
//!
//! Decode steps run on the backend's own thread pool: `submit_step` hands the step to it and
//! returns, so the caller's thread prepares the next step (adds, cancels, its own work) while
//! the pool decodes.

mod decode;
pub mod kernel;
pub mod lm_head;
mod load;
pub mod model;
mod model_ops;
pub mod ops;
pub mod optim;
pub mod store;

use std::sync::Arc;

use crate::config::ModelConfig;
use crate::engine::host::EngineHost;
use crate::engine::{Engine, Paged};
use crate::error::{BackendError, Result};
use crate::model::Layout;
use crate::model::check::refuse_while_generating;
use crate::optim::AdamState;
use crate::seam::*;
use crate::weights::Weights;
use decode::{CpuDecoder, CpuRun, CpuStep};
use model::{Activations, Model};

/// A same-device weight snapshot: the trainer's parameters copied flat, in the layout both
/// CPU sides share (no name map, no per-tensor validation on load).
#[derive(Debug)]
struct CpuSnapshot {
    data: TensorData,
}

/// Qwen3 on the CPU: generation, log-probs and GRPO/SFT training on f32 weights, or
/// generation and log-probs only on bf16 weights ([`CpuBackend::with_dtype`]; f32 compute).
pub struct CpuBackend {
    /// Shared with a decode step in flight; training needs it unshared.
    model: Arc<Model<f32>>,
    grads: Vec<f32>,
    opt: AdamState,
    acts: Activations<f32>,
    engine: Engine<Paged, CpuRun>,
    /// The decode step's state, away on the pool while a step runs.
    step: Option<Box<CpuStep>>,
    pool: Arc<rayon::ThreadPool>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("config", &self.model.cfg)
            .field("active_requests", &self.engine.active())
            .field("threads", &self.pool.current_num_threads())
            .finish()
    }
}

impl CpuBackend {
    /// A backend for `cfg` with weights `w`, running attention, per-sequence work and decode
    /// steps on `threads` threads (0 = one per core); the GEMMs run on the same threads, in row
    /// bands.
    pub fn new(cfg: &ModelConfig, w: &Weights, threads: usize) -> Result<Self> {
        Self::from_model(Model::new(cfg, w)?, threads)
    }

    /// A backend storing its weights in `dtype`: F32 (trains and generates), BF16 or F16 (an
    /// engine: generation, logits and log-probs with f32 compute, half the weight memory;
    /// training calls are refused). Values are rounded to nearest-even; a value beyond f16's
    /// range is an error under F16.
    pub fn with_dtype(
        cfg: &ModelConfig,
        w: &Weights,
        threads: usize,
        dtype: DType,
    ) -> Result<Self> {
        match dtype {
            DType::F32 => Self::new(cfg, w, threads),
            DType::Bf16 | DType::F16 => {
                cfg.validate()?;
                w.validate(cfg)?;
                let flat: Vec<f32> = Layout::new(cfg).flatten(w)?;
                let half = store::HalfData::round(&flat, dtype)?;
                drop(flat);
                Self::from_model(Model::from_half(cfg, half)?, threads)
            }
        }
    }

    /// A backend over a model directory (`config.json` + safetensors, single or sharded),
    /// memory-mapped and converted tensor by tensor straight into the backend's flat storage
    /// in `dtype` (F32, BF16 or F16, as [`CpuBackend::with_dtype`]): no intermediate copy of
    /// the whole model exists, and bf16 (f16) checkpoints load into a bf16 (f16) backend
    /// without conversion.
    pub fn from_model_dir(dir: &std::path::Path, threads: usize, dtype: DType) -> Result<Self> {
        let ck = crate::weights::mapped::MappedCheckpoint::open_dir(dir)?;
        let cfg = ck.config().clone();
        let layout = Layout::new(&cfg);
        let model = match dtype {
            DType::F32 => {
                let flat = ck.flatten_f32(&layout)?;
                Model::from_flat(&cfg, layout, flat)?
            }
            DType::Bf16 => Model::from_bf16(&cfg, ck.flatten_bf16(&layout)?)?,
            DType::F16 => Model::from_half(&cfg, store::HalfData::F16(ck.flatten_f16(&layout)?))?,
        };
        drop(ck);
        Self::from_model(model, threads)
    }

    fn from_model(model: Model<f32>, threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rolloutpipe-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device(format!("thread pool: {e}")))?;
        Ok(Self {
            // An engine-only 16-bit backend has no gradients.
            grads: if model.is_half() {
                Vec::new()
            } else {
                vec![0.0; model.layout.total]
            },
            // The host's memory is the pool's only bound.
            engine: Engine::new(&model.cfg, Paged::new(usize::MAX)),
            step: Some(Box::default()),
            model: Arc::new(model),
            opt: AdamState::default(),
            acts: Activations::default(),
            pool: Arc::new(pool),
        })
    }

    /// The model (parameters and layout), for tests and other backends' parity checks.
    pub fn model(&self) -> &Model<f32> {
        &self.model
    }

    /// The optimizer state (moments and step count).
    pub fn optimizer_state(&self) -> &AdamState {
        &self.opt
    }

    /// Restores an optimizer state saved with [`CpuBackend::optimizer_state`].
    pub fn set_optimizer_state(&mut self, st: AdamState) -> Result<()> {
        let n = self.model.layout.total;
        if !(st.m.is_empty() && st.v.is_empty() || st.m.len() == n && st.v.len() == n) {
            return Err(BackendError::shape("optimizer state", n, st.m.len()));
        }
        self.opt = st;
        Ok(())
    }

    /// Refuses a training call on a 16-bit (engine-only) backend.
    fn trainable(&self, what: &str) -> Result<()> {
        crate::model::check::trainable(self.model.storage_dtype(), what)
    }

    /// Replaces every parameter with the flat f32 values `flat` (rounded on a 16-bit backend).
    fn set_flat(&mut self, flat: Vec<f32>) -> Result<()> {
        let m = self.model_mut("load_weights")?;
        if m.is_half() {
            let half = store::HalfData::round(&flat, m.storage_dtype())?;
            drop(flat);
            m.half = Some(store::HalfStore::new(&m.layout, half)?);
        } else {
            m.params = flat;
        }
        Ok(())
    }

    /// The parameters widened to f32 (a copy).
    fn flat_f32(&self) -> Vec<f32> {
        match &self.model.half {
            Some(h) => h.data.to_f32(),
            None => self.model.params.clone(),
        }
    }

    /// The model for an update; refused while a decode step reads it.
    fn model_mut(&mut self, what: &'static str) -> Result<&mut Model<f32>> {
        Arc::get_mut(&mut self.model).ok_or(BackendError::StepInFlight(what))
    }
}

impl BackendInfo for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn device(&self) -> DeviceId {
        DeviceId::Host
    }
}

impl EngineHost for CpuBackend {
    type Store = Paged;
    type Run = CpuRun;
    type Dec<'a> = CpuDecoder<'a>;

    fn engine(&self) -> &Engine<Paged, CpuRun> {
        &self.engine
    }

    fn engine_mut(&mut self) -> &mut Engine<Paged, CpuRun> {
        &mut self.engine
    }

    fn engine_and_decoder(&mut self) -> (&mut Engine<Paged, CpuRun>, CpuDecoder<'_>) {
        let dec = CpuDecoder {
            model: &self.model,
            pool: &self.pool,
            state: &mut self.step,
            lost: false,
        };
        (&mut self.engine, dec)
    }

    fn stored_dtype(&self) -> DType {
        self.model.storage_dtype()
    }

    fn load_snapshot(&mut self, snap: &WeightSnapshot) -> Result<SyncPath> {
        snap.check_config(&self.model.cfg)?;
        let path = snap.path_to(DeviceId::Host);
        if let SnapshotPayload::Device(d) = &snap.payload
            && d.device == DeviceId::Host
            && let Some(flat) = d.handle.downcast_ref::<CpuSnapshot>()
        {
            let m = self.model_mut("load_weights")?;
            if m.is_half() {
                // HalfStore::new checks the length.
                let v = match (&flat.data, m.storage_dtype()) {
                    (TensorData::Bf16(v), DType::Bf16) => store::HalfData::Bf16(v.clone()),
                    (TensorData::F16(v), DType::F16) => store::HalfData::F16(v.clone()),
                    (other, dt) => store::HalfData::round(&other.to_f32(), dt)?,
                };
                m.half = Some(store::HalfStore::new(&m.layout, v)?);
            } else {
                flat.data.write_f32(&mut m.params)?;
            }
            return Ok(path);
        }
        let SnapshotPayload::Host(ts) = &snap.payload else {
            return Err(BackendError::invalid(
                "weight snapshot",
                "it lives on another device; take a host snapshot for this engine",
            ));
        };
        load::load_host(self.model_mut("load_weights")?, ts)?;
        Ok(SyncPath::Host)
    }
}

impl CpuBackend {
    fn fast_snapshot(&self, dtype: DType) -> WeightSnapshot {
        let data = match &self.model.half {
            Some(h) => h.data.to_tensor_data().to_dtype(dtype),
            None => TensorData::from_f32(&self.model.params, dtype),
        };
        WeightSnapshot {
            config: self.model.cfg.clone(),
            payload: SnapshotPayload::Device(DeviceSnapshot {
                device: DeviceId::Host,
                dtype,
                handle: Arc::new(CpuSnapshot { data }),
            }),
        }
    }
}

impl Trainer for CpuBackend {
    fn snapshot_weights(&self, target: SyncTarget) -> Result<WeightSnapshot> {
        if target.device == DeviceId::Host {
            return Ok(self.fast_snapshot(target.dtype));
        }
        let w = self.export_weights()?;
        WeightSnapshot::host(&self.model.cfg, &w, target.dtype)
    }

    fn checkpoint_optimizer(&self) -> Result<AdamState> {
        Ok(self.optimizer_state().clone())
    }

    fn restore_optimizer(&mut self, state: AdamState) -> Result<()> {
        self.set_optimizer_state(state)
    }

    fn export_weights(&self) -> Result<Weights> {
        Ok(self.model.layout.to_weights(&self.flat_f32()))
    }

    fn import_weights(&mut self, w: &Weights) -> Result<()> {
        refuse_while_generating(self.engine.active())?;
        w.validate(&self.model.cfg)?;
        let flat = self.model.layout.flatten(w)?;
        self.set_flat(flat)
    }

    fn logprobs(&mut self, seqs: &[Sequence], temperature: f32) -> Result<Vec<Vec<f32>>> {
        // The model checks the sequences and temperature.
        let pairs: Vec<(&[u32], &[u32])> = seqs
            .iter()
            .map(|s| (&s.prompt[..], &s.response[..]))
            .collect();
        let (model, acts) = (&self.model, &mut self.acts);
        self.pool
            .install(|| model.logprobs(&pairs, temperature as f64, acts))
    }

    fn logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        let (model, acts) = (&self.model, &mut self.acts);
        self.pool.install(|| model.logits(ids, acts))
    }

    fn zero_grad(&mut self) -> Result<()> {
        use rayon::prelude::*;
        let grads = &mut self.grads;
        self.pool.install(|| {
            grads
                .par_chunks_mut(ops::PAR_CHUNK)
                .for_each(|c| c.fill(0.0))
        });
        Ok(())
    }

    fn accumulate(&mut self, batch: &TrainBatch, obj: &Objective) -> Result<AccumStats> {
        self.trainable("accumulate")?;
        let (model, acts, grads) = (&self.model, &mut self.acts, &mut self.grads);
        // A non-finite loss is refused before the backward, leaving the sums untouched.
        let stats = self
            .pool
            .install(|| model.accumulate(batch, obj, acts, Some(grads)))?;
        let finite = {
            use rayon::prelude::*;
            let grads: &[f32] = grads;
            self.pool.install(|| {
                grads
                    .par_chunks(ops::PAR_CHUNK)
                    .all(|c| c.iter().all(|g| g.is_finite()))
            })
        };
        if !finite {
            return Err(BackendError::non_finite(
                "gradient sums after this micro-batch (overflow); call zero_grad before reusing them",
            ));
        }
        Ok(stats)
    }

    fn optimizer_step(&mut self, normalizer: f64, opt: &AdamW) -> Result<OptStats> {
        self.trainable("optimizer_step")?;
        // The step ends a round of micro-batches: their activations are not needed until the
        // next forward, so they are released before the moments are touched (at Qwen3-0.6B
        // size 0.7 GiB that would otherwise sit beside the four parameter-sized buffers).
        self.acts = Activations::default();
        let groups = self.model.layout.param_groups(opt.exclude_norms_from_decay);
        let model =
            Arc::get_mut(&mut self.model).ok_or(BackendError::StepInFlight("optimizer_step"))?;
        let (grads, state) = (&self.grads, &mut self.opt);
        self.pool
            .install(|| optim::step(&mut model.params, grads, state, &groups, normalizer, opt))
    }

    fn gradients(&self) -> Result<Weights> {
        self.trainable("gradients")?;
        Ok(self.model.layout.to_weights(&self.grads))
    }

    fn visit_gradients(&self, visit: &mut dyn FnMut(&str, &[f32]) -> Result<()>) -> Result<()> {
        self.trainable("gradients")?;
        for e in &self.model.layout.entries {
            visit(&e.name, &self.grads[e.offset..e.offset + e.len])?;
        }
        Ok(())
    }

    fn visit_weights(&self, visit: &mut dyn FnMut(&str, &[f32]) -> Result<()>) -> Result<()> {
        // A 16-bit store is widened one tensor at a time.
        let m = &self.model;
        for e in &m.layout.entries {
            let r = e.offset..e.offset + e.len;
            match &m.half {
                Some(h) => visit(&e.name, &h.data.range_f32(r))?,
                None => visit(&e.name, &m.params[r])?,
            }
        }
        Ok(())
    }
}
