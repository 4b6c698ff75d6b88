//! The shared CUDA context of the CUDA test instances.

use std::sync::{Arc, OnceLock};

use rolloutpipe_backends::cuda::Cuda;

/// The shared context, or `None` (after printing why) when the machine has no usable CUDA
/// driver or device. Panics instead when `ROLLOUTPIPE_REQUIRE_CUDA=1`.
pub fn cuda() -> Option<Arc<Cuda>> {
    static CUDA: OnceLock<Option<Arc<Cuda>>> = OnceLock::new();
    let c = CUDA
        .get_or_init(|| match Cuda::open(0) {
            Ok(c) => {
                eprintln!("CUDA device: {}", c.name());
                Some(c)
            }
            Err(e) => {
                eprintln!("CUDA unavailable: {e}");
                None
            }
        })
        .clone();
    if c.is_none() {
        if std::env::var("ROLLOUTPIPE_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
            panic!("no usable CUDA device, and ROLLOUTPIPE_REQUIRE_CUDA=1 forbids skipping");
        }
        eprintln!(
            "SKIP: no CUDA device on this machine; the CUDA conformance tests did not run (set ROLLOUTPIPE_REQUIRE_CUDA=1 to make this an error)"
        );
    }
    c
}
