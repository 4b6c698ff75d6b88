//! [`CudaBackend`]: the seam v2 engine and trainer roles on one CUDA context.

use std::sync::Arc;

use super::decode::{CudaDecoder, CudaStep};
use super::device::{Cuda, DBuf};
use super::model::DeviceModel;
use super::model_ops::{CudaOps, Scratch};
use super::ops;
use super::plan::{self, AdamScalars};
use crate::config::ModelConfig;
use crate::engine::host::EngineHost;
use crate::engine::{Engine, Sampled, Slots};
use crate::error::{BackendError, Result};
use crate::model::Layout;
use crate::model::acts::Acts;
use crate::model::check::{pairs, refuse_while_generating};
use crate::model::train::Net;
use crate::optim::{AdamState, Optimize, ParamGroup};
use crate::seam::*;
use crate::weights::Weights;

/// Qwen3 on a CUDA device: generation, log-probs and GRPO/SFT training.
#[derive(Debug)]
pub struct CudaBackend {
    cuda: Arc<Cuda>,
    model: DeviceModel,
    acts: Option<CudaActs>,
    scratch: Option<Scratch>,
    engine: Engine<Slots, Sampled>,
    step: CudaStep,
    /// AdamW moments per tensor (allocated zeroed with the model) and the step count.
    opt_m: Vec<DBuf<f32>>,
    opt_v: Vec<DBuf<f32>>,
    opt_step: u64,
    /// Per-tensor first partial of the grad-norm sum, and the f64 partials and total.
    norm_bases: Vec<usize>,
    partials: DBuf<f64>,
    norm_total: DBuf<f64>,
}

/// A same-device weight snapshot: parameter buffers copied on the device.
struct CudaSnapshot {
    cuda: Arc<Cuda>,
    params: Vec<DBuf<f32>>,
}

impl CudaBackend {
    /// A backend on device `ordinal` with a context of its own; a one-line `Device` error
    /// when the machine has no usable driver or device.
    pub fn new(cfg: &ModelConfig, w: &Weights, ordinal: usize) -> Result<Self> {
        let cuda = Cuda::open(ordinal)?;
        Self::with_cuda(cuda, cfg, w)
    }

    /// A backend on a context the caller opened (a trainer and engines sharing one GPU
    /// share it, and sync on the device).
    pub fn with_cuda(cuda: Arc<Cuda>, cfg: &ModelConfig, w: &Weights) -> Result<Self> {
        cfg.validate()?;
        plan::check_head_dim(cfg.head_dim)?;
        w.validate(cfg)?;
        let layout = Layout::new(cfg);
        let flat = layout.flatten::<f32>(w)?;
        let model = DeviceModel::new(&cuda, cfg, layout, &flat)?;
        let lens: Vec<usize> = model.layout.entries.iter().map(|e| e.len).collect();
        let (norm_bases, n_partials) = plan::grad_norm_bases(&lens);
        let mut opt_m = Vec::with_capacity(lens.len());
        let mut opt_v = Vec::with_capacity(lens.len());
        for &n in &lens {
            opt_m.push(cuda.alloc::<f32>(n)?);
            opt_v.push(cuda.alloc::<f32>(n)?);
        }
        let partials = cuda.alloc::<f64>(n_partials)?;
        let norm_total = cuda.alloc::<f64>(1)?;
        cuda.sync()?;
        Ok(Self {
            cuda,
            model,
            acts: None,
            scratch: None,
            engine: Engine::new(cfg, Slots::new(cfg.max_position_embeddings)),
            step: CudaStep::default(),
            opt_m,
            opt_v,
            opt_step: 0,
            norm_bases,
            partials,
            norm_total,
        })
    }

    /// The context this backend runs on.
    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }

    /// AdamW steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.opt_step
    }

    /// Runs `f` with the one model over this backend's ops and activations.
    fn with_net<R>(
        &mut self,
        f: impl FnOnce(Net<'_>, &mut CudaOps<'_>, &mut Option<CudaActs>) -> R,
    ) -> R {
        let net = Net {
            cfg: &self.model.cfg,
            ids: &self.model.layout.ids,
        };
        let mut o = CudaOps::new(&self.cuda, &self.model, &mut self.scratch);
        f(net, &mut o, &mut self.acts)
    }
}

/// The activations of a training or scoring pass on this backend.
type CudaActs = Acts<DBuf<f32>, DBuf<u32>, DBuf<u32>>;

impl BackendInfo for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn device(&self) -> DeviceId {
        self.cuda.device_id()
    }
}

impl EngineHost for CudaBackend {
    type Store = Slots;
    type Run = Sampled;
    type Dec<'a> = CudaDecoder<'a>;

    fn engine(&self) -> &Engine<Slots, Sampled> {
        &self.engine
    }

    fn engine_mut(&mut self) -> &mut Engine<Slots, Sampled> {
        &mut self.engine
    }

    fn engine_and_decoder(&mut self) -> (&mut Engine<Slots, Sampled>, CudaDecoder<'_>) {
        let dec = CudaDecoder {
            cuda: &self.cuda,
            md: &self.model,
            step: &mut self.step,
            scratch: &mut self.scratch,
        };
        (&mut self.engine, dec)
    }

    fn stored_dtype(&self) -> DType {
        DType::F32
    }

    fn load_snapshot(&mut self, snap: &WeightSnapshot) -> Result<SyncPath> {
        snap.check_config(&self.model.cfg)?;
        if let SnapshotPayload::Device(d) = &snap.payload
            && let Some(src) = d.handle.downcast_ref::<CudaSnapshot>()
            && Arc::ptr_eq(&src.cuda, &self.cuda)
            && d.dtype == DType::F32
        {
            for ((e, from), to) in self
                .model
                .layout
                .entries
                .iter()
                .zip(&src.params)
                .zip(&self.model.params)
            {
                to.copy_from(0, from, 0, e.len)?;
            }
            self.cuda.sync()?;
            return Ok(SyncPath::SameDevice);
        }
        let w = snap.host_weights(&self.model.cfg)?;
        let flat = self.model.layout.flatten::<f32>(&w)?;
        self.model.write_params(&flat)?;
        Ok(SyncPath::Host)
    }
}

impl Optimize for CudaBackend {
    fn groups(&self, exclude_norms_from_decay: bool) -> Vec<ParamGroup> {
        self.model.layout.param_groups(exclude_norms_from_decay)
    }

    /// Σ g² over every gradient tensor (f64 partials, one fixed-order reduction).
    fn grad_sumsq(&mut self) -> Result<f64> {
        let cu = &*self.cuda;
        for ((e, g), &base) in self
            .model
            .layout
            .entries
            .iter()
            .zip(&self.model.grads)
            .zip(&self.norm_bases)
        {
            ops::grad_norm(cu, &self.partials, g, e.len, base)?;
        }
        ops::grad_norm_reduce(cu, &self.norm_total, &self.partials, self.partials.len())?;
        Ok(self.norm_total.read(0, 1)?[0])
    }

    fn steps(&self) -> u64 {
        self.opt_step
    }

    fn adamw(&mut self, t: u64, scalars: &[AdamScalars]) -> Result<()> {
        self.opt_step = t;
        let md = &self.model;
        for (i, (e, s)) in md.layout.entries.iter().zip(scalars).enumerate() {
            let (p, g) = (&md.params[i], &md.grads[i]);
            ops::adamw_step(&self.cuda, p, g, &self.opt_m[i], &self.opt_v[i], e.len, *s)?;
        }
        self.cuda.sync()
    }
}

impl Trainer for CudaBackend {
    fn export_weights(&self) -> Result<Weights> {
        let flat = self.model.read_flat(&self.model.params)?;
        Ok(self.model.layout.to_weights(&flat))
    }

    fn import_weights(&mut self, w: &Weights) -> Result<()> {
        refuse_while_generating(self.engine.active())?;
        w.validate(&self.model.cfg)?;
        let flat = self.model.layout.flatten::<f32>(w)?;
        self.model.write_params(&flat)
    }

    fn snapshot_weights(&self, target: SyncTarget) -> Result<WeightSnapshot> {
        if target.device == self.device() && target.dtype == DType::F32 {
            let mut params = Vec::with_capacity(self.model.params.len());
            for (e, b) in self.model.layout.entries.iter().zip(&self.model.params) {
                let c = self.cuda.alloc::<f32>(e.len)?;
                c.copy_from(0, b, 0, e.len)?;
                params.push(c);
            }
            self.cuda.sync()?;
            return Ok(WeightSnapshot {
                config: self.model.cfg.clone(),
                payload: SnapshotPayload::Device(DeviceSnapshot {
                    device: self.device(),
                    dtype: DType::F32,
                    handle: Arc::new(CudaSnapshot {
                        cuda: Arc::clone(&self.cuda),
                        params,
                    }),
                }),
            });
        }
        let w = self.export_weights()?;
        WeightSnapshot::host(&self.model.cfg, &w, target.dtype)
    }

    fn checkpoint_optimizer(&self) -> Result<AdamState> {
        if self.opt_step == 0 {
            return Ok(AdamState::default());
        }
        Ok(AdamState {
            m: self.model.read_flat(&self.opt_m)?,
            v: self.model.read_flat(&self.opt_v)?,
            step: self.opt_step,
        })
    }

    fn restore_optimizer(&mut self, st: AdamState) -> Result<()> {
        let n = self.model.layout.total;
        if st.m.is_empty() && st.v.is_empty() {
            for b in self.opt_m.iter().chain(&self.opt_v) {
                b.clear()?;
            }
            self.cuda.sync()?;
            self.opt_step = 0;
            return Ok(());
        }
        if st.m.len() != n || st.v.len() != n {
            return Err(BackendError::shape(
                "optimizer state",
                n,
                st.m.len().max(st.v.len()),
            ));
        }
        for (i, e) in self.model.layout.entries.iter().enumerate() {
            self.opt_m[i].write(0, &st.m[e.offset..e.offset + e.len])?;
            self.opt_v[i].write(0, &st.v[e.offset..e.offset + e.len])?;
        }
        self.opt_step = st.step;
        Ok(())
    }

    fn logprobs(&mut self, seqs: &[Sequence], temperature: f32) -> Result<Vec<Vec<f32>>> {
        let pairs = pairs(seqs);
        self.with_net(|net, o, acts| net.logprobs(o, acts, &pairs, temperature as f64))
    }

    fn logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        self.with_net(|net, o, acts| net.logits(o, acts, ids))
    }

    fn zero_grad(&mut self) -> Result<()> {
        for g in &self.model.grads {
            g.clear()?;
        }
        self.cuda.sync()
    }

    fn accumulate(&mut self, batch: &TrainBatch, obj: &Objective) -> Result<AccumStats> {
        let stats = self.with_net(|net, o, acts| net.accumulate(o, acts, batch, obj, true))?;
        if !self.grad_sumsq()?.is_finite() {
            return Err(BackendError::non_finite(
                "gradient sums after this micro-batch (overflow); call zero_grad before reusing them",
            ));
        }
        Ok(stats)
    }

    fn optimizer_step(&mut self, normalizer: f64, opt: &AdamW) -> Result<OptStats> {
        crate::optim::step(self, normalizer, opt)
    }

    fn gradients(&self) -> Result<Weights> {
        let flat = self.model.read_flat(&self.model.grads)?;
        Ok(self.model.layout.to_weights(&flat))
    }
}
