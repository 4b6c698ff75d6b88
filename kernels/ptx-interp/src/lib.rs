//! A PTX interpreter: RolloutPipe's CUDA kernels (and any PTX within the implemented subset)
//! executed on the CPU, with the checks a first GPU run would otherwise be spent on.
//!
//! It executes warp-synchronously: 32 lanes per warp with a shared program counter per group
//! of converged lanes, every block with its own shared memory, blocks one after another. It
//! reports, naming the kernel, the source line, the instruction, the block and the thread:
//! out-of-bounds and misaligned global and shared accesses, reads of uninitialised memory,
//! shared-memory races between barriers (and with in-flight `cp.async` copies), global
//! bytes written by one block and touched by another in the same launch, `ld.global.nc`
//! of memory the launch writes, barriers that not every thread reaches, warp-synchronous
//! instructions whose lanes are not all there, divergent `bra.uni`, integer division by
//! zero, and any instruction or modifier it does not implement (the entry refuses to launch;
//! nothing is skipped).
//!
//! Goals: exact IEEE semantics where the ISA specifies them (rounding modes, conversions,
//! `fma`, `min`/`max` with NaN, canonical NaNs), the fragment layouts of `mma` and
//! `ldmatrix`, `cp.async` group semantics, determinism. Anti-goals: timing, occupancy and
//! bank conflicts; the memory model beyond "a race is a fault"; the exact bits of `.approx`
//! functions and of tensor-core accumulation (it returns correctly rounded values, within
//! the ISA's stated error of the hardware's); textures, atomics, `.local` memory, calls.
//!
//! ```
//! use rolloutpipe_ptx_interp::{Arg, Device, LaunchConfig};
//!
//! let ptx = r#"
//! .version 8.0
//! .target sm_80
//! .address_size 64
//! .visible .entry twice(.param .u64 p, .param .u32 n) {
//!     .reg .pred %p1; .reg .b32 %r<4>; .reg .b64 %rd<4>; .reg .f32 %f<2>;
//!     ld.param.u64 %rd1, [p];
//!     ld.param.u32 %r1, [n];
//!     mov.u32 %r2, %tid.x;
//!     setp.ge.u32 %p1, %r2, %r1;
//!     @%p1 bra DONE;
//!     mul.wide.u32 %rd2, %r2, 4;
//!     add.u64 %rd3, %rd1, %rd2;
//!     ld.global.f32 %f1, [%rd3];
//!     add.rn.f32 %f1, %f1, %f1;
//!     st.global.f32 [%rd3], %f1;
//! DONE:
//!     ret;
//! }"#;
//! let dev = Device::new();
//! let m = dev.load_module("twice", ptx)?;
//! let x = dev.upload(&[1.0f32, 2.0, 3.0])?;
//! dev.launch(m, "twice", &LaunchConfig::linear(1, 32), &[Arg::Ptr(x), Arg::U32(3)])?;
//! assert_eq!(dev.download::<f32>(x, 3)?, vec![2.0, 4.0, 6.0]);
//!
//! // Four elements read from a three-element buffer: the fault names it.
//! let e = dev.launch(m, "twice", &LaunchConfig::linear(1, 32), &[Arg::Ptr(x), Arg::U32(4)]).unwrap_err();
//! assert!(e.to_string().contains("out-of-bounds global read"));
//! # Ok::<(), rolloutpipe_ptx_interp::Error>(())
//! ```
#![deny(missing_docs)]

mod decode;
mod device;
mod error;
mod exec;
pub mod float;
mod ir;
mod lex;
mod lower;
mod mem;
mod parse;

pub use device::{Arg, Config, Device, DevicePtr, LaunchConfig, ModuleId};
pub use error::{Access, Error, Fault, FaultKind, Hazard};
pub use exec::LaunchStats;
pub use ir::Param;

impl Device {
    /// Allocates device memory holding a copy of `data`.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<DevicePtr, Error> {
        let p = self.alloc(std::mem::size_of_val(data))?;
        self.copy_htod(p, bytemuck::cast_slice(data))?;
        Ok(p)
    }

    /// Copies `data` to `dst`.
    pub fn write<T: bytemuck::Pod>(&self, dst: DevicePtr, data: &[T]) -> Result<(), Error> {
        self.copy_htod(dst, bytemuck::cast_slice(data))
    }

    /// Reads `n` values of `T` from `src`.
    pub fn download<T: bytemuck::Pod>(&self, src: DevicePtr, n: usize) -> Result<Vec<T>, Error> {
        let mut out = vec![T::zeroed(); n];
        self.copy_dtoh(bytemuck::cast_slice_mut(&mut out), src)?;
        Ok(out)
    }
}
