//! Every PTX entry point of `kernels/ptx/` executed by the interpreter against a plain Rust
//! reference on fresh seeded random inputs at several sizes (tails included), one module per
//! kernel file. Tolerances are stated where each comparison is made.

mod attention;
mod cache;
mod common;
mod elementwise;
mod loss;
mod matmul;
mod rows;
mod sample;

use rolloutpipe_kernels::{Kernel, PTX_ONLY};
use rolloutpipe_ptx_interp::{Device, Error};

/// Every kernel loads and every entry decodes to implemented instructions only (a launch
/// would refuse an entry with one that is not).
#[test]
fn every_entry_is_fully_implemented() {
    let dev = Device::new();
    let ops = Kernel::CUDA.iter().map(|k| {
        (
            k.name(),
            k.ptx().expect("CUDA kernels have PTX"),
            k.ptx_entry_points(),
        )
    });
    for (name, src, eps) in ops.chain(PTX_ONLY.iter().map(|p| (p.name, p.ptx, p.entry_points))) {
        let m = dev.load_module(name, src).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dev.entries(m), eps, "{name}");
        for e in dev.entries(m) {
            // Zero arguments: the launch fails on the argument count, after the
            // implementation check, never with `Unimplemented`.
            match dev.launch(
                m,
                &e,
                &rolloutpipe_ptx_interp::LaunchConfig::linear(1, 32),
                &[],
            ) {
                Err(Error::Launch { .. }) => {}
                other => panic!("{e}: {other:?}"),
            }
        }
    }
}
