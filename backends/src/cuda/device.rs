//! One CUDA context and its stream, the PTX modules loaded once and their functions cached,
//! device buffers, copies and the one checked launch path.
//!
//! Everything runs on one stream per context, in submission order; cudarc's per-buffer event
//! tracking is switched off for that reason, and buffers are passed to kernels as raw device
//! addresses (after a bounds check against their length), which is what lets one kernel
//! read and write parts of the same buffer, as the PTX ABI allows.
//!
//! Opening never panics: `cudarc` panics when no driver library can be loaded
//! (`CudaContext::new` -> `culib()`), so [`Cuda::open`] first checks that the library loads,
//! then that the driver is new enough for the API version this build was compiled against
//! ([`CUDA_API_VERSION`]), then that the device exists.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use cudarc::driver::{LaunchConfig, PushKernelArg, sys};
use cudarc::nvrtc::Ptx;
use rolloutpipe_kernels::Kernel;

use super::abi::{self, Arg};
use super::plan::LaunchDims;
use crate::error::{BackendError, Result};
use crate::seam::{DeviceId, next_device_number};

/// The CUDA driver API version this build calls (cudarc's `cuda-12040` feature): 12.4, the
/// first release with H200 support. An older driver is refused with its version named.
pub const CUDA_API_VERSION: i32 = 12040;

fn dev(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

/// Why CUDA cannot be used on this machine, or `None` when a driver library loads and
/// reports at least one device (no context is created). The `--backend cuda` error.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: only tries to dlopen the driver library under its usual names; nothing is
    // called through it.
    if !unsafe { sys::is_culib_present() } {
        return Some(
            "no CUDA driver: libcuda could not be loaded (install the NVIDIA driver, or use --backend cpu|wgpu)".into(),
        );
    }
    let mut version = 0i32;
    // SAFETY: the library is present (checked above); cuDriverGetVersion writes one int and
    // needs no cuInit.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Some(format!(
            "the CUDA driver did not report its version ({r:?})"
        ));
    }
    if version < CUDA_API_VERSION {
        return Some(format!(
            "the CUDA driver supports CUDA {}.{}, this build needs {}.{} or newer",
            version / 1000,
            (version % 1000) / 10,
            CUDA_API_VERSION / 1000,
            (CUDA_API_VERSION % 1000) / 10
        ));
    }
    match CudaContext::device_count() {
        Ok(0) => Some("the CUDA driver loaded but reports no device".into()),
        Ok(_) => None,
        Err(e) => Some(format!("the CUDA driver failed to initialise: {e:?}")),
    }
}

/// A CUDA context with one stream, the kernels' modules and a function cache.
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: u32,
    number: u64,
    modules: Mutex<HashMap<Kernel, Arc<CudaModule>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Cuda(device {}, context {})", self.ordinal, self.number)
    }
}

impl Cuda {
    /// Opens device `ordinal` with a context of its own, after the checks of
    /// [`unavailable_reason`]; every failure is a one-line [`BackendError::Device`].
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        if let Some(why) = unavailable_reason() {
            return Err(BackendError::Device(why));
        }
        let count = CudaContext::device_count().map_err(|e| dev("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(BackendError::Device(format!(
                "CUDA device {ordinal} does not exist ({count} found)"
            )));
        }
        // cudarc panics on a symbol the driver lacks; the version check above should rule
        // that out, and this turns any remaining case into an error.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| {
                BackendError::Device("the CUDA driver lacks a required entry point".into())
            })?
            .map_err(|e| dev("creating the CUDA context", e))?;
        // SAFETY: every launch and copy of this backend goes to this context's one stream
        // (`stream` below), so stream order sequences all accesses; cudarc's cross-stream
        // events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        Ok(Arc::new(Self {
            ctx,
            stream,
            ordinal: ordinal as u32,
            number: next_device_number(),
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
        }))
    }

    /// This context as a seam device id (two backends on one `Cuda` share it).
    pub fn device_id(&self) -> DeviceId {
        DeviceId::Cuda {
            ordinal: self.ordinal,
            context: self.number,
        }
    }

    /// The device's name, e.g. for benchmark tables.
    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|_| "unknown CUDA device".into())
    }

    /// The context (for cuBLAS in benchmarks).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch and copy goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The function `entry` of `kernel`'s module: the module is loaded (JIT-compiled from
    /// its PTX by the driver) the first time any of its entries is used, the function once.
    pub fn function(&self, kernel: Kernel, entry: &'static str) -> Result<CudaFunction> {
        let mut fns = self
            .functions
            .lock()
            .map_err(|_| BackendError::Device("function cache poisoned".into()))?;
        if let Some(f) = fns.get(entry) {
            return Ok(f.clone());
        }
        let module = {
            let mut mods = self
                .modules
                .lock()
                .map_err(|_| BackendError::Device("module cache poisoned".into()))?;
            match mods.get(&kernel) {
                Some(m) => Arc::clone(m),
                None => {
                    let src = kernel.ptx().ok_or_else(|| {
                        BackendError::Device(format!("{} has no PTX twin", kernel.name()))
                    })?;
                    let m = self
                        .ctx
                        .load_module(Ptx::from_src(src))
                        .map_err(|e| dev(&format!("loading {}.ptx", kernel.name()), e))?;
                    mods.insert(kernel, Arc::clone(&m));
                    m
                }
            }
        };
        let f = module
            .load_function(entry)
            .map_err(|e| dev(&format!("finding `{entry}` in {}.ptx", kernel.name()), e))?;
        fns.insert(entry, f.clone());
        Ok(f)
    }

    /// Launches `entry` of `kernel` after checking `args` against its PTX signature.
    ///
    /// The callers (`ops`) check every buffer against the extent the kernel touches before
    /// building `args`; this is the only place a kernel is launched.
    pub fn launch(
        &self,
        kernel: Kernel,
        entry: &'static str,
        dims: LaunchDims,
        args: &[Arg],
    ) -> Result<()> {
        abi::pack(entry, args)?;
        let f = self.function(kernel, entry)?;
        let vals: Vec<Arg> = args.to_vec();
        let mut b = self.stream.launch_builder(&f);
        for a in &vals {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::U32(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: dims.grid,
            block_dim: dims.block,
            shared_mem_bytes: 0,
        };
        // SAFETY: `abi::pack` checked the argument count and every kind against the entry's
        // PTX declaration (a unit test keeps that table equal to the files); every address
        // is a live allocation of this context whose length the caller checked against the
        // kernel's documented extent; `vals` outlives the launch call, which copies the
        // parameter values; all kernels use static shared memory only.
        unsafe { b.launch(cfg) }.map_err(|e| dev(&format!("launching `{entry}`"), e))?;
        Ok(())
    }

    /// Waits for everything queued on the stream; surfaces asynchronous kernel faults.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| dev("synchronizing the stream", e))
    }

    /// A zeroed buffer of `len` elements (at least one, so its address is never null).
    pub fn alloc<T: Elem>(self: &Arc<Self>, len: usize) -> Result<DBuf<T>> {
        let n = len.max(1);
        let slice: CudaSlice<T> = self
            .stream
            .alloc_zeros::<T>(n)
            .map_err(|e| dev(&format!("allocating {n} x {} bytes", size_of::<T>()), e))?;
        let ptr = {
            let (p, _sync) = slice.device_ptr(&self.stream);
            p
        };
        Ok(DBuf {
            ptr,
            len,
            slice,
            cuda: Arc::clone(self),
            _t: PhantomData,
        })
    }

    /// A buffer holding `data`.
    pub fn upload<T: Elem>(self: &Arc<Self>, data: &[T]) -> Result<DBuf<T>> {
        let b = self.alloc::<T>(data.len())?;
        b.write(0, data)?;
        Ok(b)
    }
}

/// Element types of device buffers (4- or 2-byte plain data; bf16 is stored as `u16`).
pub trait Elem:
    cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
    + Copy
    + Default
    + Send
    + Sync
    + 'static
{
}
impl Elem for f32 {}
impl Elem for u32 {}
impl Elem for u16 {}
impl Elem for f64 {}

/// A device buffer of `len` elements of `T`, with its address cached for launches.
pub struct DBuf<T: Elem> {
    ptr: u64,
    len: usize,
    // Owns the allocation (freed on drop); only its address is used after creation.
    #[allow(dead_code)]
    slice: CudaSlice<T>,
    cuda: Arc<Cuda>,
    _t: PhantomData<T>,
}

impl<T: Elem> std::fmt::Debug for DBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DBuf<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

impl<T: Elem> DBuf<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of element `offset` as a kernel argument, after checking that
    /// `offset + count` elements exist (`what` names the operand in the error).
    pub fn at(&self, offset: usize, count: usize, what: &str) -> Result<Arg> {
        if offset.checked_add(count).is_none_or(|end| end > self.len) {
            return Err(BackendError::Device(format!(
                "{what}: elements {offset}..{} past a buffer of {}",
                offset.saturating_add(count),
                self.len
            )));
        }
        Ok(Arg::Ptr(self.ptr + (offset * size_of::<T>()) as u64))
    }

    /// The whole buffer as an argument, checked to hold `count` elements.
    pub fn arg(&self, count: usize, what: &str) -> Result<Arg> {
        self.at(0, count, what)
    }

    /// Queues a copy of `data` into elements `offset..`.
    pub fn write(&self, offset: usize, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let Arg::Ptr(dst) = self.at(offset, data.len(), "host-to-device copy")? else {
            unreachable!("`at` returns an address")
        };
        // SAFETY: `dst..dst + data.len()` lies inside this allocation (checked by `at`). The
        // copy is asynchronous on the stream, so the host data must stay valid until it has
        // run: the stream is synchronized before returning, as cuMemcpyHtoDAsync from
        // pageable memory is not guaranteed to have staged the data yet.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst, data, self.cuda.stream.cu_stream())
        }
        .map_err(|e| dev("host-to-device copy", e))?;
        self.cuda.sync()
    }

    /// Reads elements `offset..offset + count` (waits for the stream).
    pub fn read(&self, offset: usize, count: usize) -> Result<Vec<T>> {
        let mut out = vec![T::default(); count];
        if count == 0 {
            return Ok(out);
        }
        let Arg::Ptr(src) = self.at(offset, count, "device-to-host copy")? else {
            unreachable!("`at` returns an address")
        };
        // SAFETY: the source range lies inside this allocation (checked); `out` has `count`
        // elements and is not touched until the stream is synchronized below.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut out[..],
                src,
                self.cuda.stream.cu_stream(),
            )
        }
        .map_err(|e| dev("device-to-host copy", e))?;
        self.cuda.sync()?;
        Ok(out)
    }

    /// Queues a copy of `count` elements from `src[src_off..]` into `self[dst_off..]`
    /// (same context; ranges may not overlap within one buffer).
    pub fn copy_from(
        &self,
        dst_off: usize,
        src: &DBuf<T>,
        src_off: usize,
        count: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        if !Arc::ptr_eq(&self.cuda, &src.cuda) {
            return Err(BackendError::Device(
                "device-to-device copy between two CUDA contexts".into(),
            ));
        }
        let (Arg::Ptr(d), Arg::Ptr(s)) = (
            self.at(dst_off, count, "device copy destination")?,
            src.at(src_off, count, "device copy source")?,
        ) else {
            unreachable!("`at` returns addresses")
        };
        if self.ptr == src.ptr && dst_off.abs_diff(src_off) < count {
            return Err(BackendError::Device("overlapping device copy".into()));
        }
        // SAFETY: both ranges lie inside live allocations of this context (checked) and do
        // not overlap; the copy is ordered on the one stream like every kernel.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                d,
                s,
                count * size_of::<T>(),
                self.cuda.stream.cu_stream(),
            )
        }
        .map_err(|e| dev("device-to-device copy", e))
    }

    /// Queues zeroing of the whole buffer.
    pub fn clear(&self) -> Result<()> {
        // SAFETY: the range is exactly this allocation's; ordered on the stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.ptr,
                0,
                self.len.max(1) * size_of::<T>(),
                self.cuda.stream.cu_stream(),
            )
        }
        .map_err(|e| dev("clearing a buffer", e))
    }

    /// The context this buffer lives in.
    pub fn cuda(&self) -> &Arc<Cuda> {
        &self.cuda
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without an NVIDIA driver (this one, CI's) opening is a one-line error
    /// naming the cause, never a panic; with a device, it opens.
    #[test]
    fn open_without_a_driver_is_a_one_line_error() {
        match unavailable_reason() {
            None => {
                let c = Cuda::open(0).expect("a usable device opens");
                assert!(matches!(c.device_id(), DeviceId::Cuda { ordinal: 0, .. }));
            }
            Some(why) => {
                assert!(!why.contains('\n'), "{why}");
                let e = Cuda::open(0).expect_err("no device here").to_string();
                assert_eq!(e, format!("device: {why}"));
            }
        }
    }
}
