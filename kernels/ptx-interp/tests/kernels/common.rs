//! Shared helpers of the kernel tests: a device with one kernel file loaded, seeded random
//! inputs (never zeros) and comparisons that report the first mismatches.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::{Arg, Device, DevicePtr, Error, LaunchConfig, LaunchStats, ModuleId};

/// A device with one kernel file loaded.
pub struct K {
    pub dev: Device,
    pub m: ModuleId,
}

impl K {
    pub fn new(k: Kernel) -> K {
        let dev = Device::new();
        let m = dev
            .load_module(k.name(), k.ptx().expect("PTX"))
            .unwrap_or_else(|e| panic!("{e}"));
        K { dev, m }
    }

    /// Launches `entry`, returning the error (for tests of faults).
    pub fn try_run(
        &self,
        entry: &str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<LaunchStats, Error> {
        self.dev.launch(self.m, entry, &cfg, args)
    }

    /// Launches `entry`; a fault fails the test with its message.
    pub fn run(&self, entry: &str, cfg: LaunchConfig, args: &[Arg]) -> LaunchStats {
        self.try_run(entry, cfg, args)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn up<T: bytemuck::Pod>(&self, v: &[T]) -> Arg {
        Arg::Ptr(self.dev.upload(v).unwrap_or_else(|e| panic!("{e}")))
    }

    /// An allocation of `n` values of T, uninitialised.
    pub fn out<T: bytemuck::Pod>(&self, n: usize) -> Arg {
        Arg::Ptr(
            self.dev
                .alloc(n * std::mem::size_of::<T>())
                .unwrap_or_else(|e| panic!("{e}")),
        )
    }

    pub fn get<T: bytemuck::Pod>(&self, a: &Arg, n: usize) -> Vec<T> {
        self.dev
            .download(ptr(a), n)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

pub fn ptr(a: &Arg) -> DevicePtr {
    match a {
        Arg::Ptr(p) => *p,
        a => panic!("not a pointer: {a:?}"),
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in `[-scale, scale)`, none exactly zero.
pub fn rand_f32(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            loop {
                let v: f32 = r.random_range(-scale..scale);
                if v != 0.0 {
                    break v;
                }
            }
        })
        .collect()
}

pub fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig::linear(grid, block)
}

pub fn cfg2(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid: (grid.0, grid.1, 1),
        block: (block, 1, 1),
        shared_bytes: 0,
    }
}

/// Bit-identical f32 vectors.
#[track_caller]
pub fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let bad: Vec<String> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .take(5)
        .map(|i| {
            format!(
                "[{i}] got {:e} ({:#010x}) want {:e} ({:#010x})",
                got[i],
                got[i].to_bits(),
                want[i],
                want[i].to_bits()
            )
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} differ; first: {}",
        got.iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count(),
        got.len(),
        bad.join("; ")
    );
}

/// `|got - want| <= atol + rtol |want|` elementwise (llm.c's validator), want in f64.
#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let ok = |i: usize| (got[i] as f64 - want[i]).abs() <= atol + rtol * want[i].abs();
    let bad: Vec<String> = (0..got.len())
        .filter(|&i| !ok(i))
        .take(5)
        .map(|i| format!("[{i}] got {:e} want {:e}", got[i], want[i]))
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} outside atol {atol:e} + rtol {rtol:e}; first: {}",
        (0..got.len()).filter(|&i| !ok(i)).count(),
        got.len(),
        bad.join("; ")
    );
}
