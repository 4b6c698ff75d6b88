//! The CPU reference backend: plain f32 ops (`ops`), the Qwen3 model over packed batches
//! (`model`), continuous-batching generation (`generate`), and [`CpuBackend`] tying them to the
//! [`PolicyBackend`] interface. Every GPU backend is checked against this one.

pub mod generate;
pub mod kernel;
pub mod lm_head;
pub mod model;
pub mod ops;

use crate::api::*;
use crate::config::ModelConfig;
use crate::error::{BackendError, Result};
use crate::optim::{self, AdamState};
use crate::weights::Weights;
use generate::Generator;
use model::{Activations, Model, PackedBatch, check_tokens};

/// Qwen3 on the CPU in f32: generation, log-probs and GRPO/SFT training.
pub struct CpuBackend {
    model: Model<f32>,
    grads: Vec<f32>,
    opt: AdamState,
    acts: Activations<f32>,
    generator: Generator,
    pool: rayon::ThreadPool,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("config", &self.model.cfg)
            .field("active_requests", &self.generator.active())
            .field("threads", &self.pool.current_num_threads())
            .finish()
    }
}

impl CpuBackend {
    /// A backend for `cfg` with weights `w`, running attention and per-sequence work on
    /// `threads` threads (0 = one per core). GEMMs use matrixmultiply's own threads
    /// (`MATMUL_NUM_THREADS`).
    pub fn new(cfg: &ModelConfig, w: &Weights, threads: usize) -> Result<Self> {
        let model = Model::new(cfg, w)?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("rolloutpipe-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device(format!("thread pool: {e}")))?;
        Ok(Self {
            grads: vec![0.0; model.layout.total],
            model,
            opt: AdamState::default(),
            acts: Activations::default(),
            generator: Generator::default(),
            pool,
        })
    }

    /// The model (parameters and layout), for tests and other backends' parity checks.
    pub fn model(&self) -> &Model<f32> {
        &self.model
    }

    /// The optimizer state (moments and step count), e.g. for checkpoints.
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
}

impl PolicyBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn export_weights(&self) -> Result<Weights> {
        Ok(self.model.layout.to_weights(&self.model.params))
    }

    fn import_weights(&mut self, w: &Weights) -> Result<()> {
        if self.generator.active() > 0 {
            return Err(BackendError::invalid(
                "import_weights",
                format!(
                    "{} requests are active; their KV caches hold the old weights",
                    self.generator.active()
                ),
            ));
        }
        w.validate(&self.model.cfg)?;
        self.model.params = self.model.layout.flatten(w)?;
        Ok(())
    }

    fn add_request(&mut self, req: GenRequest) -> Result<()> {
        self.generator.add(&self.model.cfg, req)
    }

    fn cancel_request(&mut self, id: RequestKey) -> Result<()> {
        self.generator.cancel(id)
    }

    fn decode_step(&mut self) -> Result<Vec<GenOutput>> {
        let (model, generator) = (&self.model, &mut self.generator);
        self.pool.install(|| generator.step(model))
    }

    fn active_requests(&self) -> usize {
        self.generator.active()
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
        let cfg = &self.model.cfg;
        if ids.is_empty() {
            return Err(BackendError::EmptyBatch("no token ids".into()));
        }
        check_tokens(cfg, ids, "ids")?;
        if ids.len() > cfg.max_position_embeddings {
            return Err(BackendError::shape(
                "ids length",
                cfg.max_position_embeddings,
                ids.len(),
            ));
        }
        let b = PackedBatch::all_positions(ids);
        let (model, acts) = (&self.model, &mut self.acts);
        self.pool.install(|| model.forward(&b, acts));
        Ok(self.acts.logits.clone())
    }

    fn zero_grad(&mut self) {
        self.grads.fill(0.0);
    }

    fn accumulate(&mut self, batch: &TrainBatch, obj: &Objective) -> Result<AccumStats> {
        let (model, acts, grads) = (&self.model, &mut self.acts, &mut self.grads);
        // A non-finite loss is refused before the backward, leaving the sums untouched.
        let stats = self
            .pool
            .install(|| model.accumulate(batch, obj, acts, Some(grads)))?;
        if grads.iter().any(|g| !g.is_finite()) {
            return Err(BackendError::non_finite(
                "gradient sums after this micro-batch (overflow); call zero_grad before reusing them",
            ));
        }
        Ok(stats)
    }

    fn optimizer_step(&mut self, normalizer: f64, opt: &AdamW) -> Result<OptStats> {
        let groups = self.model.layout.param_groups(opt.exclude_norms_from_decay);
        optim::step(
            &mut self.model.params,
            &self.grads,
            &mut self.opt,
            &groups,
            normalizer,
            opt,
        )
    }

    fn gradients(&self) -> Result<Weights> {
        Ok(self.model.layout.to_weights(&self.grads))
    }

    fn export_optimizer_state(&self) -> Result<AdamState> {
        Ok(self.optimizer_state().clone())
    }

    fn import_optimizer_state(&mut self, state: AdamState) -> Result<()> {
        self.set_optimizer_state(state)
    }
}
