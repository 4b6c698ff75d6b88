//! The CPU reference backend: plain f32 ops (`ops`), the Qwen3 model over packed batches
//! (`model`), continuous-batching generation (`generate`), and [`CpuBackend`] implementing both
//! seam roles, [`RolloutEngine`] and [`Trainer`]. Every GPU backend is checked against this one.
//!
//! Decode steps run on the backend's own thread pool: `submit_step` hands the step to it and
//! returns, so the caller's thread prepares the next step (adds, cancels, its own work) while
//! the pool decodes; requests added or cancelled meanwhile take effect when the step is polled.

pub mod generate;
pub mod kernel;
pub mod lm_head;
mod load;
pub mod model;
mod model_ops;
pub mod ops;
pub mod optim;
pub mod store;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError, channel};

use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::model::Layout;
use crate::model::check::{refuse_while_generating, validate_request, validate_resume};
use crate::optim::AdamState;
use crate::seam::*;
use crate::weights::Weights;
use generate::Generator;
use model::{Activations, Model};

/// The result a decode step sends back from the pool with the generator it ran on.
type StepResult = (Box<Generator>, Result<Vec<GenOutput>>);

/// The generator, idle on this thread or away running a step (boxed: it is far larger than
/// the receiver, and moves to the pool and back every step).
#[derive(Debug)]
enum EngineState {
    Idle(Box<Generator>),
    InFlight(Receiver<StepResult>),
}

/// An engine call made while a step was in flight, applied when it is polled.
#[derive(Debug)]
enum Pending {
    Add(GenRequest),
    Group(Vec<GenRequest>),
    Cancel(RequestKey),
    Resume(Box<ResumeState>),
}

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
    engine: EngineState,
    pending: Vec<Pending>,
    /// Admitted requests (queued, waiting for their group's prefill, or active) and the KV
    /// positions each reserves.
    admitted: HashMap<RequestKey, usize>,
    limits: EngineLimits,
    pool: Arc<rayon::ThreadPool>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("config", &self.model.cfg)
            .field("admitted_requests", &self.admitted.len())
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
            model: Arc::new(model),
            opt: AdamState::default(),
            acts: Activations::default(),
            engine: EngineState::Idle(Box::default()),
            pending: Vec::new(),
            admitted: HashMap::new(),
            limits: EngineLimits::default(),
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

    /// The generator, when no step is in flight.
    fn idle(&mut self) -> Option<&mut Generator> {
        match &mut self.engine {
            EngineState::Idle(g) => Some(g.as_mut()),
            EngineState::InFlight(_) => None,
        }
    }

    /// Admission: checks limits and duplicates, hands the submission back when full.
    fn admit(&self, reqs: &[GenRequest], rejected: impl FnOnce() -> Rejected) -> Result<()> {
        // Invalid input is its own error before any back-pressure.
        for (i, r) in reqs.iter().enumerate() {
            if self.admitted.contains_key(&r.id) || reqs[..i].iter().any(|o| o.id == r.id) {
                return Err(BackendError::DuplicateRequest(r.id));
            }
        }
        let kv: usize = reqs.iter().map(GenRequest::kv_tokens).sum();
        self.load().admit(&self.limits, reqs.len(), kv, rejected)
    }

    /// Applies an add, group or cancel to the idle generator.
    fn apply(gen_: &mut Generator, cfg: &ModelConfig, p: Pending) -> Result<()> {
        match p {
            Pending::Add(r) => gen_.add(cfg, r),
            Pending::Group(rs) => gen_.add_group(cfg, rs),
            Pending::Cancel(id) => gen_.cancel(cfg, id),
            Pending::Resume(st) => gen_.resume(cfg, *st),
        }
    }

    /// Validates the requests as the generator will (so that a request queued during a step
    /// cannot fail later, when the caller no longer expects an answer).
    fn validate(&self, reqs: &[GenRequest]) -> Result<()> {
        for r in reqs {
            validate_request(&self.model.cfg, r)?;
        }
        Ok(())
    }

    fn submit(&mut self, reqs: Vec<GenRequest>, group: bool) -> Result<()> {
        let kv: Vec<(RequestKey, usize)> = reqs.iter().map(|r| (r.id, r.kv_tokens())).collect();
        let cfg = self.model.cfg.clone();
        let p = if group {
            Pending::Group(reqs)
        } else {
            Pending::Add(
                reqs.into_iter()
                    .next()
                    .ok_or_else(|| BackendError::EmptyBatch("no request".into()))?,
            )
        };
        match self.idle() {
            Some(g) => Self::apply(g, &cfg, p)?,
            None => self.pending.push(p),
        }
        self.admitted.extend(kv);
        Ok(())
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

impl RolloutEngine for CpuBackend {
    fn weight_dtype(&self) -> DType {
        self.model.storage_dtype()
    }

    fn load_weights(&mut self, snap: &WeightSnapshot) -> Result<SyncPath> {
        refuse_while_generating(self.admitted.len())?;
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

    fn limits(&self) -> EngineLimits {
        self.limits
    }

    fn set_limits(&mut self, limits: EngineLimits) -> Result<()> {
        self.limits = limits.validate()?;
        Ok(())
    }

    fn load(&self) -> EngineLoad {
        EngineLoad {
            requests: self.admitted.len(),
            // The CPU copies a group's prompt KV into each sample's cache, so every sample
            // reserves its whole prompt.
            kv_tokens: self.admitted.values().sum(),
        }
    }

    fn add_request(&mut self, req: GenRequest) -> Result<()> {
        self.validate(std::slice::from_ref(&req))?;
        self.admit(std::slice::from_ref(&req), || {
            Rejected::Request(req.clone())
        })?;
        self.submit(vec![req], false)
    }

    fn add_group(&mut self, group: GroupRequest) -> Result<()> {
        if group.samples.is_empty() {
            return Err(BackendError::EmptyBatch("group with no samples".into()));
        }
        let reqs = group.clone().into_requests();
        self.validate(&reqs)?;
        self.admit(&reqs, || Rejected::Group(group))?;
        self.submit(reqs, true)
    }

    fn cancel_request(&mut self, id: RequestKey) -> Result<()> {
        if self.admitted.remove(&id).is_none() {
            return Err(BackendError::UnknownRequest(id));
        }
        let cfg = self.model.cfg.clone();
        match self.idle() {
            Some(g) => g.cancel(&cfg, id),
            None => {
                self.pending.push(Pending::Cancel(id));
                Ok(())
            }
        }
    }

    fn export_request(&mut self, id: RequestKey) -> Result<ResumeState> {
        let g = self
            .idle()
            .ok_or(BackendError::StepInFlight("export_request"))?;
        let st = g.export(id)?;
        self.admitted.remove(&id);
        Ok(st)
    }

    fn resume_request(&mut self, st: ResumeState) -> Result<()> {
        validate_resume(&self.model.cfg, &st)?;
        let req = std::slice::from_ref(&st.request);
        self.admit(req, || Rejected::Resume(Box::new(st.clone())))?;
        let kv = (st.request.id, st.request.kv_tokens());
        let cfg = self.model.cfg.clone();
        match self.idle() {
            Some(g) => g.resume(&cfg, st)?,
            None => self.pending.push(Pending::Resume(Box::new(st))),
        }
        self.admitted.insert(kv.0, kv.1);
        Ok(())
    }

    fn submit_step(&mut self) -> Result<()> {
        let gen_ = match std::mem::replace(&mut self.engine, EngineState::Idle(Box::default())) {
            EngineState::Idle(g) => g,
            busy @ EngineState::InFlight(_) => {
                self.engine = busy;
                return Err(BackendError::StepInFlight("submit_step"));
            }
        };
        let (tx, rx) = channel();
        let model = Arc::clone(&self.model);
        let mut gen_ = gen_;
        self.pool.spawn(move || {
            let r = gen_.step(&model);
            // Release the model before answering: once polled, training must find it
            // unshared (`Arc::get_mut`).
            drop(model);
            // The receiver is gone only when the backend was dropped mid-step.
            let _ = tx.send((gen_, r));
        });
        self.engine = EngineState::InFlight(rx);
        Ok(())
    }

    fn poll_step(&mut self, wait: bool) -> Result<Option<Vec<GenOutput>>> {
        let EngineState::InFlight(rx) = &self.engine else {
            return Ok(Some(Vec::new()));
        };
        let got = if wait {
            rx.recv().ok()
        } else {
            match rx.try_recv() {
                Ok(r) => Some(r),
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => None,
            }
        };
        let Some((mut gen_, out)) = got else {
            // The step's thread died: its requests are lost with the generator.
            self.engine = EngineState::Idle(Box::default());
            self.admitted.clear();
            self.pending.clear();
            return Err(BackendError::Device(
                "the decode step's thread stopped; every active request was lost".into(),
            ));
        };
        let cfg = self.model.cfg.clone();
        let mut err = None;
        let mut out = match out {
            Ok(o) => o,
            Err(e) => {
                err = Some(e);
                Vec::new()
            }
        };
        // Cancelled while the step ran: its output (if it finished) is dropped, as a cancel
        // of an idle engine would have prevented it.
        for p in std::mem::take(&mut self.pending) {
            if let Pending::Cancel(id) = &p
                && let Some(i) = out.iter().position(|o| o.id == *id)
            {
                out.remove(i);
                continue;
            }
            // Requests were validated and admitted when queued; this only fails on a bug.
            if let Err(e) = Self::apply(&mut gen_, &cfg, p) {
                err.get_or_insert(e);
            }
        }
        for o in &out {
            self.admitted.remove(&o.id);
        }
        self.engine = EngineState::Idle(gen_);
        match err {
            Some(e) => Err(e),
            None => Ok(Some(out)),
        }
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
        refuse_while_generating(self.admitted.len())?;
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
}
