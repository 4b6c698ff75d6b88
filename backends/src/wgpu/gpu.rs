//! The device side of the wgpu backend: one [`Gpu`] (device, queue, pipelines compiled once
//! per kernel) and an [`Exec`] recorder that turns a call's ops into one submission.
//!
//! Following wgpu's `repeated_compute` example, everything that can be made once is: the
//! pipelines live in the `Gpu` (shared by every model on it), bind groups are cached by the
//! exact buffers they bind (a model's buffers are persistent, so after the first call no bind
//! group is created), and all the dispatches' parameters go into one uniform arena written
//! with a single `write_buffer` per submission and bound with dynamic offsets. Per call the
//! backend only writes, encodes, dispatches, copies and submits, then maps one staging buffer
//! for what the host needs back.
//!
//! Errors: wgpu reports validation and out-of-memory errors through a callback; the `Gpu`
//! stores the first one and every submission turns it into [`BackendError::Device`], so no
//! device failure panics.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, PoisonError};

use rolloutpipe_kernels::{
    Kernel, MATMUL_BWD_COOP_ENTRIES, MATMUL_BWD_COOP_PARTS, MATMUL_BWD_COOP_STORAGE,
    MATMUL_COOP_ENTRY, MAX_STORAGE_BINDINGS, PARAMS_BYTES, WeightFormat, matmul_bwd_coop_wgsl,
    matmul_coop_wgsl,
};

use super::coop::{COOP_FEATURES, CoopSupport};

use super::inflight::InFlight;
use crate::error::{BackendError, Result};

/// Bytes between two dispatches' parameters in the arena (WebGPU's largest required
/// uniform offset alignment, so it is valid on every adapter).
const SLOT: u64 = 256;
/// Largest workgroup count of one dispatch dimension (WebGPU's default limit).
pub const MAX_GROUPS: u32 = 65_535;

pub(super) fn dev_err(what: impl std::fmt::Display) -> BackendError {
    BackendError::Device(what.to_string())
}

/// Which source of a kernel a launch runs: its own file, or one of the tensor-core products
/// launched in a GEMM's place: `matmul_fwd_coop` (for [`Kernel::MatmulFwd`], the same
/// bindings) or `matmul_bwd_coop` (for [`Kernel::MatmulBwd`], its bindings plus `amax`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// [`Kernel::wgsl_as`].
    Plain,
    /// [`matmul_coop_wgsl`] for the adapter's fragment shape ([`Gpu::coop`]).
    Coop,
    /// [`matmul_bwd_coop_wgsl`] for the adapter's fragment shape (f32 weights only).
    CoopBwd,
}

impl Variant {
    /// Storage bindings of `k`'s source in this variant.
    fn storage_bindings(self, k: Kernel) -> u32 {
        match self {
            Variant::CoopBwd => MATMUL_BWD_COOP_STORAGE,
            Variant::Plain | Variant::Coop => k.storage_bindings(),
        }
    }
}

/// A kernel's bind group layout and one pipeline per entry point.
#[derive(Debug)]
struct Compiled {
    layout: wgpu::BindGroupLayout,
    pipelines: Vec<wgpu::ComputePipeline>,
}

/// A device and queue with the backend's kernels compiled on demand (once per kernel and
/// weight format, [`Kernel::wgsl_as`]).
#[derive(Debug)]
pub struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    error: Arc<Mutex<Option<String>>>,
    compiled: Mutex<HashMap<(Kernel, WeightFormat, Variant), Arc<Compiled>>>,
    /// The tensor-core support the device was opened with, or why there is none.
    coop: std::result::Result<CoopSupport, String>,
}

impl Gpu {
    /// Opens the first adapter wgpu finds (honouring `WGPU_BACKEND`, `WGPU_ADAPTER_NAME` and
    /// `WGPU_POWER_PREF`); `Ok(None)` when the machine has no adapter at all, so callers can
    /// skip cleanly.
    ///
    /// Only wgpu's primary backends (Vulkan, Metal, DX12) are searched unless `WGPU_BACKEND`
    /// names another: on a machine without a Vulkan driver wgpu would otherwise fall back
    /// to OpenGL, whose adapter context deadlocks when engines on several threads share it
    /// ("Could not lock adapter context", then an abort).
    pub fn new() -> Result<Option<Arc<Gpu>>> {
        let mut options = wgpu::InstanceDescriptor::new_without_display_handle();
        options.backends = wgpu::Backends::PRIMARY;
        let instance = wgpu::Instance::new(options.with_env());
        let power =
            wgpu::PowerPreference::from_env().unwrap_or(wgpu::PowerPreference::HighPerformance);
        let adapter =
            match pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: power,
                force_fallback_adapter: false,
                compatible_surface: None,
                apply_limit_buckets: false,
            })) {
                Ok(a) => a,
                Err(_) => return Ok(None),
            };
        Self::from_adapter(&adapter).map(Some)
    }

    /// Creates the device on `adapter`; refuses adapters with fewer storage buffers per stage
    /// than the kernels bind.
    pub fn from_adapter(adapter: &wgpu::Adapter) -> Result<Arc<Gpu>> {
        let have = adapter.limits();
        if have.max_storage_buffers_per_shader_stage < MAX_STORAGE_BINDINGS {
            return Err(dev_err(format!(
                "adapter offers {} storage buffers per shader stage, the kernels need {}",
                have.max_storage_buffers_per_shader_stage, MAX_STORAGE_BINDINGS
            )));
        }
        // The adapter's own limits are all attainable; asking for them lets large
        // vocabularies fit one binding wherever the hardware allows it.
        let limits = have.clone();
        let open = |features: wgpu::Features| {
            let experimental = if features.is_empty() {
                wgpu::ExperimentalFeatures::disabled()
            } else {
                // SAFETY: wgpu's experimental features may have bugs of their own; this opts
                // into `EXPERIMENTAL_COOPERATIVE_MATRIX` only, requested only where the adapter
                // reports it with the fragment shape the kernel uses, and its only user is
                // `matmul_fwd_coop`, run only when an engine turns tensor cores on. The
                // kernel is validated by naga (kernels/tests/coop.rs) and its results are
                // checked against the f32 product (tests/wgpu_coop.rs).
                #[allow(unsafe_code)]
                unsafe {
                    wgpu::ExperimentalFeatures::enabled()
                }
            };
            pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
                label: Some("rolloutpipe"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: experimental,
                ..Default::default()
            }))
        };
        let mut coop = CoopSupport::of(adapter);
        let opened = match coop.is_ok().then(|| open(COOP_FEATURES)) {
            Some(Ok(d)) => Ok(d),
            Some(Err(e)) => {
                // The adapter reported the features but would not open a device with them:
                // run without tensor cores, and say why (on one line, whatever the driver's
                // message spans) when they are asked for.
                let e = e
                    .to_string()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                coop = Err(format!(
                    "the device could not be opened with the features shader-f16 and \
                     wgpu-cooperative-matrix ({e})"
                ));
                open(wgpu::Features::empty())
            }
            None => open(wgpu::Features::empty()),
        };
        let (device, queue) = opened.map_err(|e| dev_err(format!("request_device: {e}")))?;
        Ok(Self::with_coop(device, queue, adapter.get_info(), coop))
    }

    /// Wraps a device the caller created (tests and embedders bring their own); it must
    /// allow [`MAX_STORAGE_BINDINGS`] storage buffers per shader stage. Tensor cores are off
    /// on such a device: its fragment shapes are the adapter's to report.
    pub fn from_device(
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
    ) -> Arc<Gpu> {
        let why = "tensor cores need a device opened by the backend (Gpu::new or \
                   Gpu::from_adapter), which asks the adapter for its fragment shapes";
        Self::with_coop(device, queue, info, Err(why.to_string()))
    }

    fn with_coop(
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
        coop: std::result::Result<CoopSupport, String>,
    ) -> Arc<Gpu> {
        let error = Arc::new(Mutex::new(None::<String>));
        let sink = Arc::clone(&error);
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.is_none() {
                *slot = Some(e.to_string());
            }
        }));
        Arc::new(Gpu {
            device,
            queue,
            info,
            error,
            compiled: Mutex::new(HashMap::new()),
            coop,
        })
    }

    /// The adapter's tensor-core support (fragment shape and subgroup size), where the device
    /// was opened with it ([`super::coop`]).
    pub fn coop(&self) -> Option<CoopSupport> {
        self.coop.as_ref().ok().copied()
    }

    /// Why this device runs no tensor cores, in one line naming what is missing; `None`
    /// where it does.
    pub fn coop_refusal(&self) -> Option<&str> {
        self.coop.as_ref().err().map(String::as_str)
    }

    /// The most loop iterations a shader invocation may run, on adapters that stop loops past
    /// a limit: Mesa's llvmpipe (lavapipe) ends every loop of an invocation once 65,535
    /// iterations have run in all (its loop limiter), silently, so kernels whose loops grow
    /// with a length split their launches there. `None`: no such limit.
    pub fn loop_cap(&self) -> Option<usize> {
        self.info.name.contains("llvmpipe").then_some(65_535)
    }

    /// The adapter's name, backend and driver.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// The device.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Stores an error to be returned by the next [`Gpu::check`] (for calls without an
    /// error channel).
    pub fn defer_error(&self, e: String) {
        let mut slot = self.error.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    /// Returns (and clears) the first device error since the last check.
    pub fn check(&self) -> Result<()> {
        let mut slot = self.error.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.take() {
            Some(e) => Err(BackendError::Device(e)),
            None => Ok(()),
        }
    }

    /// A storage buffer of `len` 4-byte elements (at least one), copyable both ways. Its
    /// size is rounded up to whole 16-byte units ([`padded`]), so that a kernel may read it as
    /// `array<vec4<f32>>` (the GEMM operands) up to and including its last element.
    pub fn buffer(&self, label: &str, len: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: padded((len.max(1) * 4) as u64),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `data`.
    pub fn upload<T: bytemuck::Pod>(&self, label: &str, data: &[T]) -> wgpu::Buffer {
        let n = (std::mem::size_of_val(data) / 4).max(1);
        let b = self.buffer(label, n);
        self.write(&b, data);
        b
    }

    /// Queues a write of `data` at the start of `buf` (performed before the next submission).
    pub fn write<T: bytemuck::Pod>(&self, buf: &wgpu::Buffer, data: &[T]) {
        if !data.is_empty() {
            self.queue.write_buffer(buf, 0, bytemuck::cast_slice(data));
        }
    }

    /// Reads `len` elements of `buf` back (a blocking round trip; tests and exports only).
    pub fn read<T: bytemuck::Pod>(
        self: &Arc<Self>,
        buf: &wgpu::Buffer,
        len: usize,
    ) -> Result<Vec<T>> {
        let mut ex = Exec::new(Arc::clone(self));
        let t = ex.read_back(buf, 0, len * std::mem::size_of::<T>());
        let out = ex.submit()?;
        Ok(out.get::<T>(t))
    }

    /// Compiles `k` with its weights in `f` now (it is otherwise compiled at its first
    /// launch), so that a format the adapter cannot run is refused when an engine is built.
    pub fn prepare(&self, k: Kernel, f: WeightFormat) -> Result<()> {
        self.compiled(k, f, Variant::Plain).map(|_| ())
    }

    /// Compiles the tensor-core product for weights in `f` now; refused in one line where
    /// the device has no tensor cores ([`Gpu::coop_refusal`]).
    pub fn prepare_coop(&self, f: WeightFormat) -> Result<()> {
        self.compiled(Kernel::MatmulFwd, f, Variant::Coop)
            .map(|_| ())
    }

    /// Compiles the tensor-core backward product (`matmul_bwd_coop`, f32 weights) now;
    /// refused in one line where the device has no tensor cores.
    pub fn prepare_coop_bwd(&self) -> Result<()> {
        self.compiled(Kernel::MatmulBwd, WeightFormat::F32, Variant::CoopBwd)
            .map(|_| ())
    }

    fn compiled(&self, k: Kernel, f: WeightFormat, v: Variant) -> Result<Arc<Compiled>> {
        let mut map = self.compiled.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = map.get(&(k, f, v)) {
            return Ok(Arc::clone(c));
        }
        let (src, entries_of, subgroup): (&str, &[&str], Option<u32>) = match v {
            Variant::Plain => (
                k.wgsl_as(f)
                    .ok_or_else(|| dev_err(format!("{} reads no {f:?} weights", k.name())))?,
                k.entry_points(),
                None,
            ),
            Variant::Coop => {
                let sup = self.coop.as_ref().map_err(|e| dev_err(e.clone()))?;
                if k != Kernel::MatmulFwd {
                    return Err(dev_err(format!("{} has no tensor-core variant", k.name())));
                }
                (
                    matmul_coop_wgsl(sup.tile, f),
                    &[MATMUL_COOP_ENTRY],
                    Some(sup.subgroup),
                )
            }
            Variant::CoopBwd => {
                let sup = self.coop.as_ref().map_err(|e| dev_err(e.clone()))?;
                if k != Kernel::MatmulBwd || f != WeightFormat::F32 {
                    return Err(dev_err(format!(
                        "{} with {f:?} weights has no tensor-core backward",
                        k.name()
                    )));
                }
                (
                    matmul_bwd_coop_wgsl(sup.tile),
                    &MATMUL_BWD_COOP_ENTRIES,
                    Some(sup.subgroup),
                )
            }
        };
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(k.name()),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let mut entries = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: NonZeroU64::new(PARAMS_BYTES),
            },
            count: None,
        }];
        for b in 1..=v.storage_bindings(k) {
            entries.push(wgpu::BindGroupLayoutEntry {
                binding: b,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: k.read_only_bindings().contains(&b),
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        }
        let layout = self
            .device
            .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(k.name()),
                entries: &entries,
            });
        let pl = self
            .device
            .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some(k.name()),
                bind_group_layouts: &[Some(&layout)],
                immediate_size: 0,
            });
        let constants: Vec<(&str, f64)> =
            subgroup.map(|sg| ("SG", sg as f64)).into_iter().collect();
        let pipelines = entries_of
            .iter()
            .map(|ep| {
                self.device
                    .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: Some(ep),
                        layout: Some(&pl),
                        module: &module,
                        entry_point: Some(ep),
                        compilation_options: wgpu::PipelineCompilationOptions {
                            constants: &constants,
                            ..Default::default()
                        },
                        cache: None,
                    })
            })
            .collect();
        self.check()?;
        let c = Arc::new(Compiled { layout, pipelines });
        map.insert((k, f, v), Arc::clone(&c));
        Ok(c)
    }
}

/// Alignment of every storage binding's offset and (padded) size, and the unit buffer sizes
/// are rounded up to: one `vec4<f32>`, the widest load a kernel makes.
pub const BIND_ALIGN: u64 = 16;

/// `bytes` rounded up to a multiple of [`BIND_ALIGN`].
pub fn padded(bytes: u64) -> u64 {
    bytes.div_ceil(BIND_ALIGN) * BIND_ALIGN
}

/// One kernel launch's parameters: the `Params` uniform as sixteen 4-byte words, filled in
/// declaration order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Params {
    words: [u32; 16],
    len: usize,
}

impl Params {
    /// No fields yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a `u32` field.
    pub fn u(mut self, x: usize) -> Self {
        // Sizes are validated against u32 by the callers (ModelConfig and batch checks).
        self.words[self.len.min(15)] = x as u32;
        self.len += 1;
        self
    }

    /// Appends an `f32` field.
    pub fn f(mut self, x: f32) -> Self {
        self.words[self.len.min(15)] = x.to_bits();
        self.len += 1;
        self
    }
}

/// Workgroup counts for `n` workgroups, spilling into y past [`MAX_GROUPS`] (kernels
/// flatten `x + y·num_workgroups.x`).
pub fn groups(n: usize) -> [u32; 2] {
    let n = n.max(1);
    if n <= MAX_GROUPS as usize {
        [n as u32, 1]
    } else {
        [MAX_GROUPS, n.div_ceil(MAX_GROUPS as usize) as u32]
    }
}

/// Workgroup counts for `n` threads in workgroups of `wg`.
pub fn linear(n: usize, wg: usize) -> [u32; 2] {
    groups(n.div_ceil(wg))
}

#[derive(Debug)]
enum Cmd {
    Dispatch {
        kernel: Kernel,
        format: WeightFormat,
        variant: Variant,
        entry: usize,
        bufs: Vec<Bind>,
        groups: [u32; 2],
        slot: u64,
    },
    Copy {
        src: wgpu::Buffer,
        src_off: u64,
        dst: wgpu::Buffer,
        dst_off: u64,
        size: u64,
    },
    Clear {
        buf: wgpu::Buffer,
    },
}

/// One storage binding of a dispatch: `size` bytes of `buf` from `offset` (0 = to the end).
/// Both are multiples of the device's storage offset alignment (at most 256 bytes under
/// WebGPU's rules), so a tensor larger than the binding limit can be bound piecewise.
pub type Bind = (wgpu::Buffer, u64, u64);

/// A read-back request: where its bytes land in the submission's staging buffer.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    offset: usize,
    len: usize,
}

/// The bytes read back by one submission.
#[derive(Debug, Default)]
pub struct Readback {
    bytes: Vec<u8>,
}

impl Readback {
    /// The bytes of a collected submission.
    pub(super) fn from_bytes(bytes: Vec<u8>) -> Self {
        Self { bytes }
    }

    /// The values of one ticket.
    pub fn get<T: bytemuck::Pod>(&self, t: Ticket) -> Vec<T> {
        let b = &self.bytes[t.offset..t.offset + t.len];
        bytemuck::pod_collect_to_vec(b)
    }
}

/// Records the ops of one call and submits them as one command buffer.
#[derive(Debug)]
pub struct Exec {
    gpu: Arc<Gpu>,
    arena: wgpu::Buffer,
    arena_slots: u64,
    bind_groups: HashMap<(Kernel, WeightFormat, Variant, Vec<Bind>), wgpu::BindGroup>,
    cmds: Vec<Cmd>,
    params: Vec<u8>,
    reads: Vec<(wgpu::Buffer, u64, u64, Ticket)>,
    read_bytes: usize,
    staging: Option<wgpu::Buffer>,
    dummy: wgpu::Buffer,
    /// The largest storage binding the chunked ops plan for, in bytes (at most the device's).
    binding_cap: usize,
    /// Lanes per column of the decode GEMV, when forced ([`Exec::force_gemv_lanes`]).
    gemv_lanes: Option<usize>,
    /// Keys per `attention_decode` launch, when forced ([`Exec::force_decode_window`]).
    decode_window: Option<usize>,
    /// The device's tensor-core support while forward products run on it
    /// ([`Exec::set_tensor_cores`]).
    tensor_cores: Option<CoopSupport>,
    /// The GEMMs stage one value at a time ([`Exec::force_scalar_loads`]).
    scalar_loads: bool,
    /// The per-workgroup maxima of |dy| that `matmul_bwd_coop` picks its gradient scale
    /// from ([`Exec::dispatch_coop_bwd`]); reused by every backward product, in order.
    amax: wgpu::Buffer,
}

impl Exec {
    /// A recorder on `gpu` with an empty bind group cache.
    pub fn new(gpu: Arc<Gpu>) -> Self {
        let arena_slots = 256;
        let arena = Self::make_arena(&gpu, arena_slots);
        Self {
            dummy: gpu.buffer("unused binding", 4),
            amax: gpu.buffer("backward |dy| maxima", MATMUL_BWD_COOP_PARTS as usize),
            gpu,
            arena,
            arena_slots,
            bind_groups: HashMap::new(),
            cmds: Vec::new(),
            params: Vec::new(),
            reads: Vec::new(),
            read_bytes: 0,
            staging: None,
            binding_cap: usize::MAX,
            gemv_lanes: None,
            decode_window: None,
            tensor_cores: None,
            scalar_loads: false,
        }
    }

    /// Runs every product on tensor cores (f16 operands, f32 sums), or back on the f32
    /// kernels: the forward ones (`matmul_fwd`, at every row count, the lm_head chunks
    /// included) on `matmul_fwd_coop`, the backward ones (`matmul_bwd`'s dx and dW, with a
    /// per-product power-of-two gradient scale) on `matmul_bwd_coop`. Turning them on is
    /// refused, in one line naming what the adapter lacks, where the device has none
    /// ([`Gpu::coop_refusal`]).
    pub fn set_tensor_cores(&mut self, on: bool) -> Result<()> {
        self.tensor_cores = match (on, &self.gpu.coop) {
            (false, _) => None,
            (true, Ok(sup)) => Some(*sup),
            (true, Err(why)) => return Err(BackendError::Device(why.clone())),
        };
        Ok(())
    }

    /// The tensor-core support the GEMMs run on, `None` while they run on the f32 kernels.
    pub fn tensor_cores(&self) -> Option<CoopSupport> {
        self.tensor_cores
    }

    /// Makes the GEMMs (`matmul_fwd`, its decode GEMV, `matmul_bwd`) stage their operands one
    /// value at a time even where the shape allows vector loads (`off`), or lets them choose
    /// again: for tests, which compare both paths' bits (they stage the same values).
    pub fn force_scalar_loads(&mut self, off: bool) {
        self.scalar_loads = off;
    }

    /// Whether the GEMMs may use vector loads where the shape allows them.
    pub fn vector_loads(&self) -> bool {
        !self.scalar_loads
    }

    /// Makes `attention_decode` cover `keys` keys per launch (a multiple of 64) instead of the
    /// adapter's choice ([`Gpu::loop_cap`]), so that tests split rows over launches on any
    /// adapter. The split changes no result.
    pub fn force_decode_window(&mut self, keys: Option<usize>) {
        assert!(
            keys.is_none_or(|k| k > 0 && k.is_multiple_of(64)),
            "decode window must be a positive multiple of 64"
        );
        self.decode_window = keys;
    }

    /// The forced decode window, if any.
    pub fn forced_decode_window(&self) -> Option<usize> {
        self.decode_window
    }

    /// Makes every decode GEMV (`matmul_fwd_gemv`) split K over `lanes` (1, 8 or 16) instead of
    /// the adapter's choice, so that tests reach every split on any adapter. The split changes
    /// no result, only the launch geometry.
    pub fn force_gemv_lanes(&mut self, lanes: Option<usize>) {
        assert!(
            matches!(lanes, None | Some(1 | 8 | 16)),
            "GEMV lanes must be 1, 8 or 16"
        );
        self.gemv_lanes = lanes;
    }

    /// The forced GEMV lane count, if any.
    pub fn forced_gemv_lanes(&self) -> Option<usize> {
        self.gemv_lanes
    }

    /// The storage-binding size the chunked ops (embedding, lm_head products, AdamW, the
    /// gradient norm) split their tensors to fit: the device's limit, or the lower cap of
    /// [`Exec::cap_binding`].
    pub fn binding_limit(&self) -> usize {
        let device = self.gpu.device().limits().max_storage_buffer_binding_size as usize;
        device.min(self.binding_cap)
    }

    /// Plans the chunked ops for bindings of at most `bytes` (a multiple of 256, checked by
    /// the caller): what a device with that limit would run, on any device.
    pub fn cap_binding(&mut self, bytes: usize) {
        self.binding_cap = bytes;
    }

    /// A small buffer for bindings an entry point does not use.
    pub fn dummy(&self) -> wgpu::Buffer {
        self.dummy.clone()
    }

    fn make_arena(gpu: &Gpu, slots: u64) -> wgpu::Buffer {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params arena"),
            size: slots * SLOT,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// The device.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Drops cached bind groups (call after reallocating buffers they bind).
    pub fn forget_bind_groups(&mut self) {
        self.bind_groups.clear();
    }

    /// Records one launch of `kernel`'s entry point `entry` over `groups` workgroups, with
    /// `bufs` bound at 1.. in order.
    pub fn dispatch(
        &mut self,
        kernel: Kernel,
        entry: usize,
        bufs: &[&wgpu::Buffer],
        p: Params,
        groups: [u32; 2],
    ) {
        let bufs: Vec<(&wgpu::Buffer, u64, u64)> = bufs.iter().map(|b| (*b, 0, 0)).collect();
        self.dispatch_ranges(kernel, entry, &bufs, p, groups);
    }

    /// [`Exec::dispatch`] with each buffer bound from an offset (`(buffer, offset, size)`,
    /// size 0 = to the end): for tensors above the device's storage-binding limit.
    pub fn dispatch_ranges(
        &mut self,
        kernel: Kernel,
        entry: usize,
        bufs: &[(&wgpu::Buffer, u64, u64)],
        p: Params,
        groups: [u32; 2],
    ) {
        self.dispatch_as(kernel, WeightFormat::F32, entry, bufs, p, groups);
    }

    /// [`Exec::dispatch_ranges`] of `kernel`'s variant whose weight binding (binding 2) holds
    /// values in `format` ([`Kernel::wgsl_as`]; offsets into it are in bytes, as always).
    pub fn dispatch_as(
        &mut self,
        kernel: Kernel,
        format: WeightFormat,
        entry: usize,
        bufs: &[(&wgpu::Buffer, u64, u64)],
        p: Params,
        groups: [u32; 2],
    ) {
        self.record(kernel, format, Variant::Plain, entry, bufs, p, groups);
    }

    /// A launch of the tensor-core product `matmul_fwd_coop` with [`Kernel::MatmulFwd`]'s
    /// bindings and `Params`, over `groups` tiles of [`CoopSupport::tile`]'s workgroup tile.
    pub fn dispatch_coop(
        &mut self,
        format: WeightFormat,
        bufs: &[(&wgpu::Buffer, u64, u64)],
        p: Params,
        groups: [u32; 2],
    ) {
        self.record(Kernel::MatmulFwd, format, Variant::Coop, 0, bufs, p, groups);
    }

    /// A launch of entry `entry` of the tensor-core backward product `matmul_bwd_coop`
    /// (`MATMUL_BWD_COOP_ENTRIES`: the |dy| maxima, dx, dW) with [`Kernel::MatmulBwd`]'s five
    /// bindings in `bufs` and `Params`; the maxima buffer is bound sixth.
    pub fn dispatch_coop_bwd(
        &mut self,
        entry: usize,
        bufs: &[(&wgpu::Buffer, u64, u64)],
        p: Params,
        groups: [u32; 2],
    ) {
        let amax = self.amax.clone();
        let mut all = bufs.to_vec();
        all.push((&amax, 0, 0));
        let (k, f) = (Kernel::MatmulBwd, WeightFormat::F32);
        self.record(k, f, Variant::CoopBwd, entry, &all, p, groups);
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        kernel: Kernel,
        format: WeightFormat,
        variant: Variant,
        entry: usize,
        bufs: &[(&wgpu::Buffer, u64, u64)],
        p: Params,
        groups: [u32; 2],
    ) {
        let slot = (self.params.len() as u64) / SLOT;
        let mut bytes = [0u8; SLOT as usize];
        bytes[..64].copy_from_slice(bytemuck::cast_slice(&p.words));
        self.params.extend_from_slice(&bytes);
        // Sizes are padded to 16 bytes (within the buffer, whose size is padded too), so that
        // a binding read as `array<vec4<f32>>` or `array<vec2<u32>>` covers its last
        // element; offsets must be 16-byte aligned for the same reason (checked at submit).
        self.cmds.push(Cmd::Dispatch {
            kernel,
            format,
            variant,
            entry,
            bufs: bufs
                .iter()
                .map(|(b, o, n)| {
                    let n = if *n == 0 {
                        0
                    } else {
                        padded(*n).min(b.size().saturating_sub(*o))
                    };
                    ((*b).clone(), *o, n)
                })
                .collect(),
            groups,
            slot,
        });
    }

    /// Records a copy of `size` bytes.
    pub fn copy(
        &mut self,
        src: &wgpu::Buffer,
        src_off: u64,
        dst: &wgpu::Buffer,
        dst_off: u64,
        size: u64,
    ) {
        if size > 0 {
            self.cmds.push(Cmd::Copy {
                src: src.clone(),
                src_off,
                dst: dst.clone(),
                dst_off,
                size,
            });
        }
    }

    /// Records zeroing a whole buffer.
    pub fn clear(&mut self, buf: &wgpu::Buffer) {
        self.cmds.push(Cmd::Clear { buf: buf.clone() });
    }

    /// Asks for `size` bytes of `src` from `offset` once this submission has run.
    pub fn read_back(&mut self, src: &wgpu::Buffer, offset: u64, size: usize) -> Ticket {
        let t = Ticket {
            offset: self.read_bytes,
            len: size,
        };
        // Copies must be 4-byte aligned; every element here is 4 bytes.
        let padded = size.div_ceil(4) * 4;
        self.reads.push((src.clone(), offset, padded as u64, t));
        self.read_bytes += padded;
        t
    }

    /// Encodes everything recorded and submits it without waiting: the returned
    /// [`InFlight`] is polled for the bytes asked for, while the host records the next call.
    pub fn submit_async(&mut self) -> Result<InFlight> {
        let gpu = Arc::clone(&self.gpu);
        let cmds = std::mem::take(&mut self.cmds);
        let params = std::mem::take(&mut self.params);
        let reads = std::mem::take(&mut self.reads);
        let read_bytes = std::mem::replace(&mut self.read_bytes, 0);
        let slots = (params.len() as u64) / SLOT;
        if slots > self.arena_slots {
            self.arena_slots = slots.next_power_of_two();
            self.arena = Self::make_arena(&gpu, self.arena_slots);
            self.bind_groups.clear();
        }
        if !params.is_empty() {
            gpu.queue.write_buffer(&self.arena, 0, &params);
        }
        let mut enc = gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("rolloutpipe call"),
            });
        let mut i = 0;
        while i < cmds.len() {
            match &cmds[i] {
                Cmd::Dispatch { .. } => {
                    // Consecutive dispatches share one pass; wgpu orders their storage
                    // accesses (each dispatch is its own synchronisation scope).
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("ops"),
                        timestamp_writes: None,
                    });
                    while let Some(Cmd::Dispatch {
                        kernel,
                        format,
                        variant,
                        entry,
                        bufs,
                        groups,
                        slot,
                    }) = cmds.get(i)
                    {
                        let c = gpu.compiled(*kernel, *format, *variant)?;
                        let pipeline = c.pipelines.get(*entry).ok_or_else(|| {
                            dev_err(format!("{} has no entry point #{entry}", kernel.name()))
                        })?;
                        let want = variant.storage_bindings(*kernel);
                        if bufs.len() != want as usize {
                            return Err(dev_err(format!(
                                "{} binds {want} buffers, {} given",
                                kernel.name(),
                                bufs.len()
                            )));
                        }
                        if let Some((_, o, _)) = bufs.iter().find(|b| b.1 % BIND_ALIGN != 0) {
                            return Err(dev_err(format!(
                                "{} binds a buffer at offset {o}, not a multiple of {BIND_ALIGN} bytes",
                                kernel.name()
                            )));
                        }
                        let key = (*kernel, *format, *variant, bufs.clone());
                        if !self.bind_groups.contains_key(&key) {
                            let mut entries = vec![wgpu::BindGroupEntry {
                                binding: 0,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: &self.arena,
                                    offset: 0,
                                    size: NonZeroU64::new(PARAMS_BYTES),
                                }),
                            }];
                            for (b, (buf, offset, size)) in bufs.iter().enumerate() {
                                entries.push(wgpu::BindGroupEntry {
                                    binding: b as u32 + 1,
                                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                        buffer: buf,
                                        offset: *offset,
                                        size: NonZeroU64::new(*size),
                                    }),
                                });
                            }
                            let bg = gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                                label: Some(kernel.name()),
                                layout: &c.layout,
                                entries: &entries,
                            });
                            self.bind_groups.insert(key.clone(), bg);
                        }
                        let bg = &self.bind_groups[&key];
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, bg, &[(*slot * SLOT) as u32]);
                        pass.dispatch_workgroups(groups[0], groups[1], 1);
                        i += 1;
                    }
                }
                Cmd::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    size,
                } => {
                    enc.copy_buffer_to_buffer(src, *src_off, dst, *dst_off, *size);
                    i += 1;
                }
                Cmd::Clear { buf } => {
                    enc.clear_buffer(buf, 0, None);
                    i += 1;
                }
            }
        }
        if read_bytes > 0 {
            let need = read_bytes as u64;
            if self.staging.as_ref().is_none_or(|s| s.size() < need) {
                self.staging = Some(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("readback staging"),
                    size: need.next_power_of_two().max(256),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }));
            }
        }
        if let Some(staging) = &self.staging {
            for (src, off, size, t) in &reads {
                enc.copy_buffer_to_buffer(src, *off, staging, t.offset as u64, *size);
            }
        }
        // The staging buffer travels with the submission until it is collected, so that
        // another call can submit meanwhile (it gets a staging buffer of its own).
        let staging = if read_bytes > 0 {
            self.staging.take()
        } else {
            None
        };
        let index = gpu.queue.submit([enc.finish()]);
        Ok(InFlight::start(gpu, index, staging, read_bytes))
    }

    /// Encodes everything recorded, submits it, waits, and returns the bytes asked for.
    pub fn submit(&mut self) -> Result<Readback> {
        let mut run = self.submit_async()?;
        match run.poll(true)? {
            Some(out) => {
                self.recycle(&mut run);
                Ok(out)
            }
            None => Err(dev_err("a waited-for submission did not complete")),
        }
    }

    /// Takes back the staging buffer of a collected submission for later read-backs.
    pub fn recycle(&mut self, run: &mut InFlight) {
        if let Some(s) = run.take_staging()
            && self.staging.as_ref().is_none_or(|o| o.size() < s.size())
        {
            self.staging = Some(s);
        }
    }
}
