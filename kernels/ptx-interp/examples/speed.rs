//! Interpreter throughput on RolloutPipe's own kernels: warp instructions per second and
//! wall time for a few launches at the sizes the backend suites use.
//! `cargo run --release -p rolloutpipe-ptx-interp --example speed`

use std::time::Instant;

use rolloutpipe_kernels::Kernel;
use rolloutpipe_ptx_interp::{Arg, Device, LaunchConfig};

fn main() -> Result<(), rolloutpipe_ptx_interp::Error> {
    let dev = Device::new();
    println!("| launch | warp steps | wall ms | M warp steps/s |");
    println!("|---|---:|---:|---:|");
    let mm = dev.load_module("matmul_fwd", Kernel::MatmulFwd.ptx().unwrap_or_default())?;
    for (m, n, k) in [(64usize, 64usize, 64usize), (128, 256, 128)] {
        let a = dev.upload(&vec![0.5f32; m * k])?;
        let b = dev.upload(&vec![0.25f32; k * n])?;
        let c = dev.alloc(4 * m * n)?;
        let cfg = LaunchConfig {
            grid: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        let args = [
            Arg::Ptr(c),
            Arg::Ptr(a),
            Arg::Ptr(b),
            Arg::U32(m as u32),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
            Arg::U32(k as u32),
            Arg::U32(1),
            Arg::U32(1),
            Arg::U32(k as u32),
            Arg::U32(0),
        ];
        time(&format!("matmul_fwd_f32 {m}x{n}x{k}"), || {
            dev.launch(mm, "matmul_fwd_f32", &cfg, &args)
        })?;
        let x = dev.upload(&vec![0x3f80u16; m * k])?;
        let w = dev.upload(&vec![0x3f00u16; n * k])?;
        let cfg = LaunchConfig {
            block: (128, 1, 1),
            ..cfg
        };
        let args = [
            Arg::Ptr(c),
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::U32(m as u32),
            Arg::U32(n as u32),
            Arg::U32(k as u32),
        ];
        time(&format!("matmul_fwd (bf16 mma) {m}x{n}x{k}"), || {
            dev.launch(mm, "matmul_fwd", &cfg, &args)
        })?;
    }
    let el = dev.load_module(
        "residual_fwd",
        Kernel::ResidualFwd.ptx().unwrap_or_default(),
    )?;
    let n = 1 << 20;
    let a = dev.upload(&vec![1.0f32; n])?;
    let o = dev.alloc(4 * n)?;
    time("residual_fwd 1M", || {
        dev.launch(
            el,
            "residual_fwd",
            &LaunchConfig::linear(1024, 256),
            &[Arg::Ptr(o), Arg::Ptr(a), Arg::Ptr(a), Arg::U32(n as u32)],
        )
    })?;
    Ok(())
}

fn time(
    what: &str,
    f: impl Fn() -> Result<rolloutpipe_ptx_interp::LaunchStats, rolloutpipe_ptx_interp::Error>,
) -> Result<(), rolloutpipe_ptx_interp::Error> {
    let t = Instant::now();
    let s = f()?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "| {what} | {} | {ms:.1} | {:.1} |",
        s.warp_steps,
        s.warp_steps as f64 / ms / 1e3
    );
    Ok(())
}
