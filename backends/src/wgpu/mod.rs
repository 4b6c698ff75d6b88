//! The portable GPU backend: the CPU reference's Qwen3 model and GRPO training as WGSL
//! kernels (`rolloutpipe-kernels`) on any wgpu adapter — Vulkan, Metal, DX12, GL, and in CI
//! Mesa's lavapipe (Vulkan on the CPU).
//!
//! - [`gpu`]: the device, pipelines compiled once per kernel, and the [`Exec`] recorder
//!   (bind groups cached per buffer set, one params arena, one submission per call);
//! - [`coop`]: whether the adapter has tensor cores (cooperative matrices) for
//!   `matmul_fwd_coop` and `matmul_bwd_coop`, which [`WgpuBackend::set_tensor_cores`] turns
//!   on;
//! - [`ops`]: one launcher per kernel, named and shaped like `cpu::ops`;
//! - `model`: parameters, gradients and activations on the device; the forward and
//!   backward encoders;
//! - [`lm_head`]: the output projection fused with the log-probs, in vocabulary chunks (no
//!   `[rows × vocab]` logits are stored);
//! - `generate`: continuous batching over the paged KV pool (`kv`) with on-device sampling,
//!   submitted without blocking (`inflight`).
//!
//! What crosses back to the host per call: sampled tokens and their log-probs
//! (`decode_step`), per-token log-probs (`logprobs`), four loss sums plus one gradient
//! sum-of-squares (`accumulate`), one sum of squares (`optimizer_step`). Weights and
//! gradients come back only when asked for (`export_weights`, `gradients`), and logits
//! only through the inspection call `logits`.
//!
//! Weights are f32 (generation, log-probs and training), or bf16 or f16 for an engine
//! ([`WgpuBackend::with_dtype`]: generation, logits and log-probs with f32 compute on any
//! adapter, half the weight memory; training calls are refused). See `model` for which
//! tensors are stored in 16 bits.
//!
//! Seam v2 on this backend: weight sync between two backends on one [`Gpu`] is a
//! buffer-to-buffer copy on the device ([`SyncPath::SameDevice`]), to a 16-bit engine after
//! rounding on the device (the `weight_cast` kernel, bit for bit the host's rounding); the KV cache is a paged
//! pool ([`kv`]) whose free pages are the engine's capacity (a request that does not fit is
//! handed back); a group's samples reference its prompt's shared pages instead of each
//! prefilling the prompt; `submit_step` queues the step and returns, `poll_step` collects it
//! ([`inflight`]).
//!
//! ```no_run
//! use rolloutpipe_backends::wgpu::WgpuBackend;
//! use rolloutpipe_backends::{BackendInfo, ModelConfig, Weights};
//! let cfg = ModelConfig::tiny();
//! let be = WgpuBackend::new(&cfg, &Weights::random(&cfg, 0)?)?;
//! assert_eq!(be.name(), "wgpu");
//! # Ok::<(), rolloutpipe_backends::BackendError>(())
//! ```

pub mod coop;
pub mod decode;
pub mod gpu;
pub mod inflight;
pub mod kv;
pub mod lm_head;
pub mod model;
pub mod model_ops;
pub mod ops;

use std::sync::Arc;

pub use gpu::{Exec, Gpu};

use crate::config::ModelConfig;
use crate::engine::host::EngineHost;
use crate::engine::{Engine, Paged};
use crate::error::{BackendError, Result};
use crate::model::acts::Acts;
use crate::model::check::{pairs, refuse_while_generating};
use crate::model::train::Net;
use crate::model::{Layout, ParamEntry};
use crate::optim::{AdamState, Optimize, ParamGroup};
use crate::seam::*;
use crate::weights::Weights;
use decode::{WgpuDecoder, WgpuRun, WgpuStep};
use model::{DeviceModel, f16_overflow, half_stored, stored_words, weight_format};
use model_ops::WgpuOps;
use ops::AdamScalars;
use rolloutpipe_kernels::{Kernel, WeightFormat};

/// Largest `head_dim` the attention kernels support (each of 64 threads owns ≤ 4 dims).
pub const MAX_HEAD_DIM: usize = 256;

/// Qwen3 on a wgpu device: generation, log-probs and GRPO/SFT training on f32 weights, or
/// generation and log-probs only on bf16 or f16 weights ([`WgpuBackend::with_dtype`]).
#[derive(Debug)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    ex: Exec,
    model: DeviceModel,
    acts: Option<WgpuActs>,
    scratch: Option<model_ops::Scratch>,
    engine: Engine<Paged, WgpuRun>,
    step: WgpuStep,
    /// AdamW moments per tensor (allocated zeroed with the model) and the step count.
    opt_m: Vec<wgpu::Buffer>,
    opt_v: Vec<wgpu::Buffer>,
    opt_step: u64,
    partials: wgpu::Buffer,
    norm_total: wgpu::Buffer,
}

/// A same-device weight snapshot: parameter buffers copied on the device.
#[derive(Debug)]
struct WgpuSnapshot {
    gpu: Arc<Gpu>,
    params: Vec<wgpu::Buffer>,
}

/// The device id of a shared [`Gpu`]: its address, unique while any backend or snapshot holds
/// the `Arc` (a snapshot holds it, so the number cannot be reused while it exists).
fn device_of(gpu: &Arc<Gpu>) -> DeviceId {
    DeviceId::Wgpu(Arc::as_ptr(gpu) as usize as u64)
}

impl WgpuBackend {
    /// A backend on the default adapter (see [`Gpu::new`]); a `Device` error when the machine
    /// has none.
    pub fn new(cfg: &ModelConfig, w: &Weights) -> Result<Self> {
        let gpu =
            Gpu::new()?.ok_or_else(|| BackendError::Device("no wgpu adapter found".into()))?;
        Self::with_gpu(gpu, cfg, w)
    }

    /// A backend on the default adapter storing its weights in `dtype`: F32 (trains and
    /// generates), BF16 or F16 (an engine: generation, logits and log-probs with f32 compute,
    /// half the weight memory; training calls are refused), as `CpuBackend::with_dtype`.
    /// Values are rounded to nearest-even; a value beyond f16's range is an error under F16.
    pub fn with_dtype(cfg: &ModelConfig, w: &Weights, dtype: DType) -> Result<Self> {
        let gpu =
            Gpu::new()?.ok_or_else(|| BackendError::Device("no wgpu adapter found".into()))?;
        Self::with_gpu_dtype(gpu, cfg, w, dtype)
    }

    /// A backend on a device the caller opened (tests share one device across backends).
    pub fn with_gpu(gpu: Arc<Gpu>, cfg: &ModelConfig, w: &Weights) -> Result<Self> {
        Self::with_gpu_dtype(gpu, cfg, w, DType::F32)
    }

    /// [`WgpuBackend::with_dtype`] on a device the caller opened.
    pub fn with_gpu_dtype(
        gpu: Arc<Gpu>,
        cfg: &ModelConfig,
        w: &Weights,
        dtype: DType,
    ) -> Result<Self> {
        cfg.validate()?;
        if cfg.head_dim > MAX_HEAD_DIM {
            return Err(BackendError::config(
                "head_dim",
                format!("{} exceeds the wgpu kernels' {MAX_HEAD_DIM}", cfg.head_dim),
            ));
        }
        w.validate(cfg)?;
        let layout = Layout::new(cfg);
        let format = weight_format(dtype);
        if format == WeightFormat::F16 {
            // `unpack2x16float` needs the downlevel capability SHADER_F16_IN_F32 (every
            // Vulkan, Metal and DX12 adapter has it); refuse here, not at the first launch.
            gpu.prepare(Kernel::MatmulFwd, format).map_err(|e| {
                BackendError::Device(format!(
                    "this adapter cannot read f16 weights (unpack2x16float; use BF16): {e}"
                ))
            })?;
        }
        let flat = layout.flatten::<f32>(w)?;
        let model = DeviceModel::new(&gpu, cfg, layout, &flat, format)?;
        drop(flat);
        // An engine-only 16-bit model has no gradients, moments or norm partials.
        let train_entries = match format {
            WeightFormat::F32 => &model.layout.entries[..],
            _ => &[],
        };
        let opt_m = train_entries
            .iter()
            .map(|e| gpu.buffer(&format!("adam m {}", e.name), e.len))
            .collect();
        let opt_v = train_entries
            .iter()
            .map(|e| gpu.buffer(&format!("adam v {}", e.name), e.len))
            .collect();
        let ex = Exec::new(Arc::clone(&gpu));
        let partials = gpu.buffer(
            "grad norm partials",
            norm_partials(ex.binding_limit(), train_entries),
        );
        let norm_total = gpu.buffer("grad norm total", 1);
        let pages = kv::device_pages(&gpu, cfg);
        gpu.check()?;
        Ok(Self {
            ex,
            gpu,
            model,
            acts: None,
            scratch: None,
            engine: Engine::new(cfg, Paged::new(pages)),
            step: WgpuStep::new(pages),
            opt_m,
            opt_v,
            opt_step: 0,
            partials,
            norm_total,
        })
    }

    /// Caps the generation KV pool at `pages` pages of [`kv::PAGE`] positions (by default
    /// as many as one storage binding holds): a request or group whose positions do not fit
    /// in the free pages is handed back ([`BackendError::EngineFull`]).
    pub fn set_kv_pages(&mut self, pages: usize) -> Result<()> {
        let device = kv::device_pages(&self.gpu, &self.model.cfg);
        self.engine
            .store_mut()
            .set_max_pages(pages, device)
            .map_err(|why| BackendError::invalid("KV pool pages", why))?;
        self.step.max_pages = pages;
        Ok(())
    }

    /// Splits every tensor the chunked ops bind (the embedding table and lm_head in the
    /// embedding and product ops, each parameter's AdamW step and gradient norm) into
    /// bindings of at most `bytes`, as a device whose storage-binding limit is `bytes` would:
    /// what runs a model whose tensors exceed a smaller device's limit can be run, and
    /// checked, on a larger one. `bytes` must be a positive multiple of 256 (the chunks start
    /// on 256-byte boundaries); a cap above the device's limit changes nothing.
    pub fn cap_storage_binding(&mut self, bytes: usize) -> Result<()> {
        if bytes == 0 || !bytes.is_multiple_of(256) {
            return Err(BackendError::invalid(
                "storage binding cap",
                format!("{bytes} bytes is not a positive multiple of 256"),
            ));
        }
        self.ex.cap_binding(bytes);
        let trained = match self.model.weights {
            WeightFormat::F32 => &self.model.layout.entries[..],
            _ => &[],
        };
        let needed = norm_partials(self.ex.binding_limit(), trained);
        if needed as u64 * 4 > self.partials.size() {
            self.partials = self.gpu.buffer("grad norm partials", needed);
        }
        self.gpu.check()
    }

    /// Reads whole tensors back (gradients, weights, optimizer moments) in submissions that
    /// stage at most `bytes` each, instead of the default [`model::READ_BATCH_BYTES`]: the
    /// batching a model above one buffer's size needs, testable on a small one. Refused at 0.
    pub fn cap_read_batch(&mut self, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Err(BackendError::invalid("read batch cap", "0 bytes"));
        }
        self.model.read_batch = bytes;
        Ok(())
    }

    /// Runs every matrix product on tensor cores, f16 operands with f32 sums ([`coop`]): the
    /// forward ones of generation, scoring and training (the projections and the lm_head
    /// chunks, at every row count) on `matmul_fwd_coop`, and, where the weights are f32 (a
    /// trainer), the backward ones (dx and dW of each projection and lm_head chunk) on
    /// `matmul_bwd_coop`, which scales dy by a power of two per product so that small
    /// gradients keep f16's relative precision instead of flushing to zero. Results move by
    /// the f16 rounding of the operands (tests/wgpu_coop.rs bounds them); decoding and scoring
    /// stay batch-invariant; every other kernel is unchanged. Refused, in one line naming what
    /// the adapter lacks, where it has no tensor cores; compiled here, so a driver that
    /// rejects a kernel is refused here too. `false` goes back to the f32 kernels.
    pub fn set_tensor_cores(&mut self, on: bool) -> Result<()> {
        self.ex.set_tensor_cores(on)?;
        if on {
            let mut ready = self.gpu.prepare_coop(self.model.weights);
            if ready.is_ok() && self.model.weights == WeightFormat::F32 {
                ready = self.gpu.prepare_coop_bwd();
            }
            if let Err(e) = ready {
                self.ex.set_tensor_cores(false)?;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether matrix products run on tensor cores ([`WgpuBackend::set_tensor_cores`]).
    pub fn tensor_cores(&self) -> bool {
        self.ex.tensor_cores().is_some()
    }

    /// Look-ahead decoding with device-side token feedback (off by default): each
    /// `submit_step` also queues the step after it, whose input tokens the device copies
    /// from the step before, so that the device runs step n + 1 while the host collects step
    /// n and prepares n + 2 (SGLang's overlap scheduling, without its host thread). What
    /// changes for a caller: a request added after a submission joins one step later, and
    /// `poll_step(true)` waits for its own step only. Each request's tokens and log-probs are
    /// the same bits as with it off (batch invariance; `tests/wgpu_lookahead.rs`).
    pub fn set_lookahead(&mut self, on: bool) {
        self.engine.set_lookahead(on);
    }

    /// Whether look-ahead decoding is on ([`WgpuBackend::set_lookahead`]).
    pub fn lookahead(&self) -> bool {
        self.engine.lookahead()
    }

    /// Whether a look-ahead step is queued on the device now.
    pub fn lookahead_queued(&self) -> bool {
        self.engine.ahead_in_flight()
    }

    /// The generation KV pool's capacity in pages of [`kv::PAGE`] positions.
    pub fn kv_pages(&mut self) -> Result<usize> {
        Ok(self.engine.store().max_pages())
    }

    /// The device this backend runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Bytes of the device buffers that hold the weights (not gradients or moments).
    pub fn weight_bytes(&self) -> u64 {
        self.model.param_bytes()
    }

    /// Refuses a training call on a 16-bit (engine-only) backend.
    fn trainable(&self, what: &str) -> Result<()> {
        crate::model::check::trainable(self.weight_dtype(), what)
    }

    /// AdamW steps taken so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.opt_step
    }

    /// The optimizer state (moments read back from the device, and the step count), in the
    /// CPU backend's flat layout, e.g. for checkpoints.
    pub fn optimizer_state(&self) -> Result<AdamState> {
        if self.opt_step == 0 {
            return Ok(AdamState::default());
        }
        let mut ex = Exec::new(Arc::clone(&self.gpu));
        let m = self.model.read_flat(&mut ex, &self.opt_m)?;
        let v = self.model.read_flat(&mut ex, &self.opt_v)?;
        Ok(AdamState {
            m,
            v,
            step: self.opt_step,
        })
    }

    /// Restores a state saved by [`WgpuBackend::optimizer_state`] or the CPU backend's (empty
    /// moments mean a fresh optimizer).
    pub fn set_optimizer_state(&mut self, st: AdamState) -> Result<()> {
        let n = self.model.layout.total;
        if !(st.m.is_empty() && st.v.is_empty()) {
            self.trainable("optimizer state")?;
        }
        if st.m.is_empty() && st.v.is_empty() {
            for b in self.opt_m.iter().chain(&self.opt_v) {
                self.ex.clear(b);
            }
            self.ex.submit()?;
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
            self.gpu
                .write(&self.opt_m[i], &st.m[e.offset..e.offset + e.len]);
            self.gpu
                .write(&self.opt_v[i], &st.v[e.offset..e.offset + e.len]);
        }
        self.opt_step = st.step;
        self.gpu.check()
    }

    /// Records the sum of squares of every gradient tensor into `norm_total`.
    fn encode_grad_sumsq(&mut self) {
        let mut base = 0;
        for (e, g) in self.model.layout.entries.iter().zip(&self.model.grads) {
            base += ops::grad_norm(
                &mut self.ex,
                &self.partials,
                &self.norm_total,
                g,
                e.len,
                base,
            );
        }
        ops::grad_norm_reduce(&mut self.ex, &self.norm_total, &self.partials, base);
    }

    /// Runs `f` with the one model over this backend's ops and activations.
    fn with_net<R>(
        &mut self,
        f: impl FnOnce(Net<'_>, &mut WgpuOps<'_>, &mut Option<WgpuActs>) -> R,
    ) -> R {
        let net = Net {
            cfg: &self.model.cfg,
            ids: &self.model.layout.ids,
        };
        let mut o = WgpuOps::new(&mut self.ex, &self.model, &mut self.scratch);
        f(net, &mut o, &mut self.acts)
    }
}

/// The activations of a training or scoring pass on this backend.
type WgpuActs = Acts<wgpu::Buffer, model_ops::Idx, model_ops::Seqs>;

impl BackendInfo for WgpuBackend {
    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn config(&self) -> &ModelConfig {
        &self.model.cfg
    }

    fn device(&self) -> DeviceId {
        device_of(&self.gpu)
    }
}

impl EngineHost for WgpuBackend {
    type Store = Paged;
    type Run = WgpuRun;
    type Dec<'a> = WgpuDecoder<'a>;

    fn engine(&self) -> &Engine<Paged, WgpuRun> {
        &self.engine
    }

    fn engine_mut(&mut self) -> &mut Engine<Paged, WgpuRun> {
        &mut self.engine
    }

    fn engine_and_decoder(&mut self) -> (&mut Engine<Paged, WgpuRun>, WgpuDecoder<'_>) {
        let dec = WgpuDecoder {
            gpu: &self.gpu,
            ex: &mut self.ex,
            md: &self.model,
            step: &mut self.step,
            scratch: &mut self.scratch,
        };
        (&mut self.engine, dec)
    }

    fn can_look_ahead(&self) -> bool {
        true
    }

    fn can_generate(&self) -> Result<()> {
        kv::check_gqa(&self.model.cfg)
    }

    fn stored_dtype(&self) -> DType {
        match self.model.weights {
            WeightFormat::F32 => DType::F32,
            WeightFormat::Bf16 => DType::Bf16,
            WeightFormat::F16 => DType::F16,
        }
    }

    fn load_snapshot(&mut self, snap: &WeightSnapshot) -> Result<SyncPath> {
        snap.check_config(&self.model.cfg)?;
        if let SnapshotPayload::Device(d) = &snap.payload
            && let Some(src) = d.handle.downcast_ref::<WgpuSnapshot>()
            && Arc::ptr_eq(&src.gpu, &self.gpu)
            && weight_format(d.dtype) == self.model.weights
        {
            // In the engine's own storage (f32, or 16-bit pairs rounded on the device by
            // `snapshot_on_device`): a copy per tensor.
            for ((e, from), to) in self
                .model
                .layout
                .entries
                .iter()
                .zip(&src.params)
                .zip(&self.model.params)
            {
                let bytes = stored_words(e, self.model.weights) as u64 * 4;
                if from.size() < bytes {
                    return Err(BackendError::Device(format!(
                        "snapshot tensor {} holds {} bytes, {bytes} expected",
                        e.name,
                        from.size()
                    )));
                }
                self.ex.copy(from, 0, to, 0, bytes);
            }
            self.ex.submit()?;
            return Ok(SyncPath::SameDevice);
        }
        // A host snapshot arrives in the engine's dtype (a bf16 engine's bf16 values round-trip
        // through f32 exactly); other dtypes are rounded here, past f16's range refused by name.
        let w = snap.host_weights(&self.model.cfg)?;
        let flat = self.model.layout.flatten::<f32>(&w)?;
        drop(w);
        self.model.write_params(&self.gpu, &flat)?;
        self.gpu.check()?;
        Ok(SyncPath::Host)
    }
}

/// Gradient-norm partials the trained `entries` need under a binding limit of `limit` bytes.
fn norm_partials(limit: usize, entries: &[ParamEntry]) -> usize {
    entries
        .iter()
        .map(|e| ops::grad_norm_partials(limit, e.len))
        .sum()
}

impl WgpuBackend {
    /// A snapshot of this f32 model for an engine on the same device, in the engine's
    /// `dtype`: every tensor copied on the device (f32), or rounded there (`weight_cast`: 2-D
    /// tensors packed in pairs, 1-D ones rounded and kept as f32, as a 16-bit engine stores
    /// them), bit for bit what the host path gives; under f16 a value past its range is
    /// refused naming its tensor, as there.
    fn snapshot_on_device(&self, dtype: DType) -> Result<WeightSnapshot> {
        let fmt = weight_format(dtype);
        let entries = &self.model.layout.entries;
        let mut ex = Exec::new(Arc::clone(&self.gpu));
        // wgpu zeroes new buffers: one overflow flag per tensor.
        let overflow = self.gpu.buffer("weight cast overflow", entries.len());
        let params: Vec<wgpu::Buffer> = entries
            .iter()
            .zip(&self.model.params)
            .enumerate()
            .map(|(i, (e, b))| {
                let c = self
                    .gpu
                    .buffer(&format!("snapshot {}", e.name), stored_words(e, fmt));
                if fmt == WeightFormat::F32 {
                    ex.copy(b, 0, &c, 0, e.len as u64 * 4);
                } else {
                    let packed = half_stored(e, fmt);
                    ops::weight_cast(&mut ex, &c, b, &overflow, e.len, fmt, i, packed);
                }
                c
            })
            .collect();
        if fmt == WeightFormat::F32 {
            ex.submit()?;
        } else {
            let t = ex.read_back(&overflow, 0, entries.len() * 4);
            let flags = ex.submit()?.get::<u32>(t);
            if let Some(i) = flags.iter().position(|&f| f != 0) {
                return Err(f16_overflow(&entries[i].name));
            }
        }
        Ok(WeightSnapshot {
            config: self.model.cfg.clone(),
            payload: SnapshotPayload::Device(DeviceSnapshot {
                device: self.device(),
                dtype,
                handle: Arc::new(WgpuSnapshot {
                    gpu: Arc::clone(&self.gpu),
                    params,
                }),
            }),
        })
    }
}

impl Optimize for WgpuBackend {
    fn groups(&self, exclude_norms_from_decay: bool) -> Vec<ParamGroup> {
        self.model.layout.param_groups(exclude_norms_from_decay)
    }

    fn grad_sumsq(&mut self) -> Result<f64> {
        self.encode_grad_sumsq();
        let t = self.ex.read_back(&self.norm_total, 0, 4);
        Ok(self.ex.submit()?.get::<f32>(t)[0] as f64)
    }

    fn steps(&self) -> u64 {
        self.opt_step
    }

    fn adamw(&mut self, t: u64, scalars: &[AdamScalars]) -> Result<()> {
        self.opt_step = t;
        let md = &self.model;
        for (i, (e, s)) in md.layout.entries.iter().zip(scalars).enumerate() {
            let (p, g) = (&md.params[i], &md.grads[i]);
            ops::adamw_step(
                &mut self.ex,
                p,
                g,
                &self.opt_m[i],
                &self.opt_v[i],
                e.len,
                *s,
            );
        }
        self.ex.submit().map(|_| ())
    }
}

impl Trainer for WgpuBackend {
    fn export_weights(&self) -> Result<Weights> {
        let mut ex = Exec::new(Arc::clone(&self.gpu));
        let flat = self.model.read_params(&mut ex)?;
        Ok(self.model.layout.to_weights(&flat))
    }

    fn import_weights(&mut self, w: &Weights) -> Result<()> {
        refuse_while_generating(self.engine.active())?;
        w.validate(&self.model.cfg)?;
        let flat = self.model.layout.flatten::<f32>(w)?;
        self.model.write_params(&self.gpu, &flat)?;
        self.gpu.check()
    }

    fn snapshot_weights(&self, target: SyncTarget) -> Result<WeightSnapshot> {
        // An engine on this device gets its weights on the device, in its dtype.
        if target.device == self.device() && self.model.weights == WeightFormat::F32 {
            return self.snapshot_on_device(target.dtype);
        }
        let w = self.export_weights()?;
        WeightSnapshot::host(&self.model.cfg, &w, target.dtype)
    }

    fn checkpoint_optimizer(&self) -> Result<AdamState> {
        self.optimizer_state()
    }

    fn restore_optimizer(&mut self, state: AdamState) -> Result<()> {
        self.set_optimizer_state(state)
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
            self.ex.clear(g);
        }
        self.ex.submit().map(|_| ())
    }

    fn accumulate(&mut self, batch: &TrainBatch, obj: &Objective) -> Result<AccumStats> {
        self.trainable("accumulate")?;
        let stats = self.with_net(|net, o, acts| net.accumulate(o, acts, batch, obj, true))?;
        if !self.grad_sumsq()?.is_finite() {
            return Err(BackendError::non_finite(
                "gradient sums after this micro-batch (overflow); call zero_grad before reusing them",
            ));
        }
        Ok(stats)
    }

    fn optimizer_step(&mut self, normalizer: f64, opt: &AdamW) -> Result<OptStats> {
        self.trainable("optimizer_step")?;
        crate::optim::step(self, normalizer, opt)
    }

    fn gradients(&self) -> Result<Weights> {
        self.trainable("gradients")?;
        let mut ex = Exec::new(Arc::clone(&self.gpu));
        let flat = self.model.read_flat(&mut ex, &self.model.grads)?;
        Ok(self.model.layout.to_weights(&flat))
    }
}
