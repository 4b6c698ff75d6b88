//! The shared wgpu device of the conformance tests.

use std::sync::{Arc, OnceLock};

use rolloutpipe_backends::wgpu::Gpu;

/// The shared device, or `None` (after printing why) when the machine has no adapter.
/// Panics instead when `ROLLOUTPIPE_REQUIRE_GPU=1`.
pub fn gpu() -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Option<Arc<Gpu>>> = OnceLock::new();
    let g = GPU
        .get_or_init(|| match Gpu::new() {
            Ok(Some(g)) => {
                let i = g.adapter_info();
                eprintln!(
                    "wgpu adapter: {} ({:?}, {})",
                    i.name, i.backend, i.driver_info
                );
                Some(g)
            }
            Ok(None) => None,
            Err(e) => {
                eprintln!("wgpu device creation failed: {e}");
                None
            }
        })
        .clone();
    if g.is_none() {
        if std::env::var("ROLLOUTPIPE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            panic!(
                "no usable wgpu adapter, and ROLLOUTPIPE_REQUIRE_GPU=1 forbids skipping (install mesa-vulkan-drivers for lavapipe)"
            );
        }
        eprintln!(
            "SKIP: no wgpu adapter on this machine; the wgpu conformance tests did not run (set ROLLOUTPIPE_REQUIRE_GPU=1 to make this an error)"
        );
    }
    g
}
