//! The launch-and-memory layer: a [`Device`] with the operations a CUDA driver context
//! offers a backend (allocate, free, copy host<->device and device<->device, memset, load a
//! PTX module, launch an entry by name with grid, block, dynamic shared memory and typed
//! arguments). Methods take `&self`; one lock serialises them like a single stream, so an
//! `Arc<Device>` can be shared by engine and trainer threads.

use std::sync::{Mutex, MutexGuard};

use crate::error::Error;
use crate::exec::{self, LaunchSpec, LaunchStats};
use crate::ir::{Entry, Op, Param};
use crate::lower::lower_module;
use crate::mem::Global;
use crate::parse::parse;

/// A device address (what a kernel's `.u64` pointer parameter receives).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null pointer (never an allocation).
    pub const NULL: DevicePtr = DevicePtr(0);

    /// The address.
    pub fn addr(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on (a view into an allocation).
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

/// A loaded module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModuleId(usize);

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Bytes of dynamic shared memory (what `.extern .shared` arrays see).
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch without dynamic shared memory.
    pub fn linear(grid: u32, block: u32) -> LaunchConfig {
        LaunchConfig {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// One kernel argument, matched against the entry's parameter types at launch.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// A `.u32`, `.s32` or `.b32` parameter.
    U32(u32),
    /// A `.s32` (or `.u32`, `.b32`) parameter.
    I32(i32),
    /// A `.u64`, `.s64` or `.b64` parameter.
    U64(u64),
    /// A pointer (a `.u64` / `.b64` parameter).
    Ptr(DevicePtr),
    /// A `.f32` parameter.
    F32(f32),
    /// A `.f64` parameter.
    F64(f64),
    /// Raw bytes for any parameter of exactly this size (structs as `.b8` arrays).
    Bytes(Vec<u8>),
}

/// Interpreter limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Warp instructions one launch may execute before it stops with a fault (an endless
    /// loop is a fault here rather than a hang).
    pub max_warp_steps: u64,
    /// Static plus dynamic shared memory per block (48 KiB: what a launch gets without the
    /// opt-in attribute on sm_80/sm_90).
    pub max_shared_bytes: u32,
}

impl Default for Config {
    fn default() -> Config {
        // 2^28 warp instructions: about a minute and a half here, far above any launch at
        // test sizes (a 128x256x128 GEMM takes 3e5).
        Config {
            max_warp_steps: 1 << 28,
            max_shared_bytes: 48 * 1024,
        }
    }
}

struct Module {
    name: String,
    lines: Vec<String>,
    entries: Vec<Entry>,
}

struct State {
    global: Global,
    modules: Vec<Module>,
    launches: u32,
}

/// The interpreter's device: memory, modules and launches.
pub struct Device {
    state: Mutex<State>,
    config: Config,
}

impl Default for Device {
    fn default() -> Device {
        Device::new()
    }
}

impl Device {
    /// A device with the default [`Config`].
    pub fn new() -> Device {
        Device::with_config(Config::default())
    }

    /// A device with `config`.
    pub fn with_config(config: Config) -> Device {
        Device {
            state: Mutex::new(State {
                global: Global::new(),
                modules: Vec::new(),
                launches: 0,
            }),
            config,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave State half-changed in a way the checks rely on.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Allocates `bytes` of device memory (contents uninitialised: a kernel reading them
    /// before anything writes them faults).
    pub fn alloc(&self, bytes: usize) -> Result<DevicePtr, Error> {
        Ok(DevicePtr(self.lock().global.alloc(bytes)))
    }

    /// Frees an allocation made by [`Device::alloc`].
    pub fn free(&self, ptr: DevicePtr) -> Result<(), Error> {
        self.lock().global.free(ptr.0).map_err(Error::Memory)
    }

    /// Copies host bytes to device memory.
    pub fn copy_htod(&self, dst: DevicePtr, src: &[u8]) -> Result<(), Error> {
        self.lock()
            .global
            .host(dst.0, src.len(), true)
            .map_err(Error::Memory)?
            .copy_from_slice(src);
        Ok(())
    }

    /// Copies device memory to host bytes.
    pub fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> Result<(), Error> {
        dst.copy_from_slice(
            self.lock()
                .global
                .host(src.0, dst.len(), false)
                .map_err(Error::Memory)?,
        );
        Ok(())
    }

    /// Copies `bytes` between device ranges (they may overlap).
    pub fn copy_dtod(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<(), Error> {
        let mut s = self.lock();
        let tmp = s
            .global
            .host(src.0, bytes, false)
            .map_err(Error::Memory)?
            .to_vec();
        s.global
            .host(dst.0, bytes, true)
            .map_err(Error::Memory)?
            .copy_from_slice(&tmp);
        Ok(())
    }

    /// Sets `count` bytes to `value`.
    pub fn memset_d8(&self, dst: DevicePtr, value: u8, count: usize) -> Result<(), Error> {
        self.lock()
            .global
            .host(dst.0, count, true)
            .map_err(Error::Memory)?
            .fill(value);
        Ok(())
    }

    /// Sets `count` 32-bit words to `value`.
    pub fn memset_d32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<(), Error> {
        let mut s = self.lock();
        let buf = s
            .global
            .host(dst.0, count * 4, true)
            .map_err(Error::Memory)?;
        for c in buf.chunks_exact_mut(4) {
            c.copy_from_slice(&value.to_le_bytes());
        }
        Ok(())
    }

    /// Bytes allocated now.
    pub fn memory_used(&self) -> usize {
        self.lock().global.used()
    }

    /// Parses and decodes PTX source; `name` appears in errors.
    pub fn load_module(&self, name: &str, ptx: &str) -> Result<ModuleId, Error> {
        let err = |(line, message): (u32, String)| Error::Parse {
            module: name.to_string(),
            line,
            message,
        };
        let entries = lower_module(&parse(ptx).map_err(err)?).map_err(err)?;
        let mut s = self.lock();
        s.modules.push(Module {
            name: name.to_string(),
            lines: ptx.lines().map(str::to_string).collect(),
            entries,
        });
        Ok(ModuleId(s.modules.len() - 1))
    }

    /// The entry names of a module, in source order.
    pub fn entries(&self, module: ModuleId) -> Vec<String> {
        self.lock().modules.get(module.0).map_or(Vec::new(), |m| {
            m.entries.iter().map(|e| e.name.clone()).collect()
        })
    }

    /// The parameters of `entry`, in order, with their buffer layout.
    pub fn params(&self, module: ModuleId, entry: &str) -> Result<Vec<Param>, Error> {
        let s = self.lock();
        Ok(find_entry(&s, module, entry)?.params.clone())
    }

    /// Runs `entry` of `module` to completion. The first fault stops the launch and is
    /// returned as [`Error::Fault`]; an invalid launch or an entry with an instruction the
    /// interpreter does not implement runs nothing.
    pub fn launch(
        &self,
        module: ModuleId,
        entry: &str,
        cfg: &LaunchConfig,
        args: &[Arg],
    ) -> Result<LaunchStats, Error> {
        let mut guard = self.lock();
        let s = &mut *guard;
        s.launches += 1;
        let stamp = s.launches + 1;
        let m = s.modules.get(module.0).ok_or_else(|| Error::Launch {
            kernel: entry.to_string(),
            reason: "unknown module".into(),
        })?;
        let e = find_entry_in(m, entry)?;
        check_implemented(m, e)?;
        let spec = LaunchSpec {
            entry: e,
            lines: &m.lines,
            params: pack_args(e, args)?,
            grid: [cfg.grid.0, cfg.grid.1, cfg.grid.2],
            block: [cfg.block.0, cfg.block.1, cfg.block.2],
            dyn_shared: cfg.shared_bytes,
            stamp,
            max_steps: self.config.max_warp_steps,
        };
        check_dims(e, &spec, self.config.max_shared_bytes)?;
        exec::run(&spec, &mut s.global).map_err(Error::Fault)
    }
}

fn find_entry<'a>(s: &'a State, module: ModuleId, entry: &str) -> Result<&'a Entry, Error> {
    let m = s.modules.get(module.0).ok_or_else(|| Error::Launch {
        kernel: entry.to_string(),
        reason: "unknown module".into(),
    })?;
    find_entry_in(m, entry)
}

fn find_entry_in<'a>(m: &'a Module, entry: &str) -> Result<&'a Entry, Error> {
    m.entries
        .iter()
        .find(|e| e.name == entry)
        .ok_or_else(|| Error::NoEntry {
            module: m.name.clone(),
            entry: entry.to_string(),
            available: m
                .entries
                .iter()
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

fn check_implemented(m: &Module, e: &Entry) -> Result<(), Error> {
    for i in &e.insts {
        if let Op::Unimplemented(reason) = &i.op {
            return Err(Error::Unimplemented {
                kernel: e.name.clone(),
                line: i.line,
                text: m
                    .lines
                    .get(i.line as usize - 1)
                    .map_or("", |s| s.trim())
                    .to_string(),
                reason: reason.clone(),
            });
        }
    }
    Ok(())
}

fn check_dims(e: &Entry, spec: &LaunchSpec, max_shared: u32) -> Result<(), Error> {
    let bad = |reason: String| {
        Err(Error::Launch {
            kernel: e.name.clone(),
            reason,
        })
    };
    let [bx, by, bz] = spec.block;
    let [gx, gy, gz] = spec.grid;
    let threads = bx as u64 * by as u64 * bz as u64;
    if bx == 0 || by == 0 || bz == 0 || threads > 1024 || bx > 1024 || by > 1024 || bz > 64 {
        return bad(format!(
            "block ({bx},{by},{bz}) is empty or above the limits (1024 threads; x, y <= 1024, z <= 64)"
        ));
    }
    if gx == 0 || gy == 0 || gz == 0 || gx >= 1 << 31 || gy > 65535 || gz > 65535 {
        return bad(format!(
            "grid ({gx},{gy},{gz}) is empty or above the limits (x < 2^31, y, z <= 65535)"
        ));
    }
    let shared = e.shared_static.max(e.shared_dyn_base + spec.dyn_shared);
    if shared > max_shared {
        return bad(format!(
            "{shared} bytes of shared memory ({} static + {} dynamic) exceed {max_shared}",
            e.shared_static, spec.dyn_shared
        ));
    }
    Ok(())
}

/// The parameter buffer of a launch: each argument checked against its parameter.
fn pack_args(e: &Entry, args: &[Arg]) -> Result<Vec<u8>, Error> {
    let bad = |reason: String| Error::Launch {
        kernel: e.name.clone(),
        reason,
    };
    if args.len() != e.params.len() {
        return Err(bad(format!(
            "{} arguments for {} parameters",
            args.len(),
            e.params.len()
        )));
    }
    let mut buf = vec![0u8; e.param_bytes as usize];
    for (p, a) in e.params.iter().zip(args) {
        let bytes: Vec<u8> = match (p.ty.as_str(), a) {
            ("u32" | "s32" | "b32", Arg::U32(v)) => v.to_le_bytes().to_vec(),
            ("u32" | "s32" | "b32", Arg::I32(v)) => v.to_le_bytes().to_vec(),
            ("u64" | "s64" | "b64", Arg::U64(v)) => v.to_le_bytes().to_vec(),
            ("u64" | "s64" | "b64", Arg::Ptr(v)) => v.0.to_le_bytes().to_vec(),
            ("f32", Arg::F32(v)) => v.to_le_bytes().to_vec(),
            ("f64", Arg::F64(v)) => v.to_le_bytes().to_vec(),
            (_, Arg::Bytes(b)) if b.len() == p.size as usize => b.clone(),
            (ty, a) => {
                return Err(bad(format!(
                    "parameter `{}` is `.{ty}` ({} bytes), the argument is {a:?}",
                    p.name, p.size
                )));
            }
        };
        if bytes.len() != p.size as usize {
            return Err(bad(format!(
                "parameter `{}` takes {} bytes, the argument has {}",
                p.name,
                p.size,
                bytes.len()
            )));
        }
        buf[p.offset as usize..(p.offset + p.size) as usize].copy_from_slice(&bytes);
    }
    Ok(buf)
}
