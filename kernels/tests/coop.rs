//! The tensor-core products `matmul_fwd_coop` (every fragment shape and weight format) and
//! `matmul_bwd_coop` (every fragment shape) through naga on the CPU: they parse, validate only
//! with the capabilities their features grant, keep `matmul_fwd`'s and `matmul_bwd`'s bindings
//! (the backend launches them in those kernels' places; the backward adds one), and translate
//! to SPIR-V at the subgroup sizes adapters use.

use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use naga::{AddressSpace, ShaderStage, StorageAccess};
use rolloutpipe_kernels::{
    CoopTile, Kernel, MATMUL_BWD_COOP_ENTRIES, MATMUL_BWD_COOP_STORAGE, MATMUL_COOP_ENTRY,
    MATMUL_COOP_SUBGROUPS, WeightFormat, matmul_bwd_coop_wgsl, matmul_coop_wgsl,
};

/// What `shader-f16` and `wgpu-cooperative-matrix` grant (and the downlevel capability the
/// f16 weight prelude's `unpack2x16float` needs, as in tests/naga.rs).
const CAPS: Capabilities = Capabilities::SHADER_FLOAT16
    .union(Capabilities::COOPERATIVE_MATRIX)
    .union(Capabilities::SHADER_FLOAT16_IN_FLOAT32);

fn sources() -> Vec<(CoopTile, WeightFormat, &'static str)> {
    let mut out = Vec::new();
    for t in CoopTile::ALL {
        for f in WeightFormat::ALL {
            out.push((t, f, matmul_coop_wgsl(t, f)));
        }
    }
    out
}

fn validate(
    src: &str,
    caps: Capabilities,
) -> Result<(naga::Module, naga::valid::ModuleInfo), String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map_err(|e| e.emit_to_string(src))?;
    Ok((module, info))
}

#[test]
fn coop_sources_validate_with_their_features_only() {
    for (t, f, src) in sources() {
        validate(src, CAPS).unwrap_or_else(|e| panic!("{t:?} {f:?}: {e}"));
        // Without cooperative matrices (or without f16) the module is refused: the backend
        // must not compile it for an adapter that lacks the features.
        for missing in [
            Capabilities::COOPERATIVE_MATRIX,
            Capabilities::SHADER_FLOAT16,
        ] {
            assert!(
                validate(src, CAPS.difference(missing)).is_err(),
                "{t:?} {f:?} validates without {missing:?}"
            );
        }
    }
}

#[test]
fn coop_sources_name_their_fragment_shape() {
    for (t, f, src) in sources() {
        let e = t.edge();
        assert!(
            src.contains(&format!("coop_mat{e}x{e}<f16, A>"))
                && src.contains(&format!("coop_mat{e}x{e}<f32, C>"))
                && src.contains(&format!("const CT: u32 = {e}u;")),
            "{t:?} {f:?}"
        );
        assert!(src.contains(&format!("// Prelude `{}`", f.prelude())));
        assert_eq!(t.workgroup_tile(), 4 * e);
    }
}

/// A module's bindings with their access, by binding number.
fn layout(m: &naga::Module) -> Vec<(u32, String)> {
    let mut out: Vec<(u32, String)> = m
        .global_variables
        .iter()
        .filter_map(|(_, g)| {
            let b = g.binding.as_ref()?;
            let access = match g.space {
                AddressSpace::Uniform => "uniform".to_string(),
                AddressSpace::Storage { access } => {
                    if access.contains(StorageAccess::STORE) {
                        "read_write".into()
                    } else {
                        "read".into()
                    }
                }
                _ => "other".into(),
            };
            Some((b.binding, access))
        })
        .collect();
    out.sort();
    out
}

/// The same `Params`-then-storage layout as `matmul_fwd`, with the same access per binding:
/// the host binds the same buffers to either kernel.
#[test]
fn coop_bindings_are_matmul_fwds() {
    let plain = naga::front::wgsl::parse_str(Kernel::MatmulFwd.wgsl()).expect("matmul_fwd");
    for (t, f, src) in sources() {
        let m = naga::front::wgsl::parse_str(src).expect("parse");
        let plain_f32 = layout(&plain);
        let coop = layout(&m);
        // Binding 2 is the weight prelude's, whose element type is the format's; its access
        // (read) is the same.
        assert_eq!(coop, plain_f32, "{t:?} {f:?}");
        let eps: Vec<&str> = m.entry_points.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(eps, [MATMUL_COOP_ENTRY], "{t:?} {f:?}");
        assert_eq!(m.entry_points[0].stage, ShaderStage::Compute);
    }
}

/// With the subgroup size set (8: lavapipe; 32: NVIDIA; 64: AMD wave64), the module becomes
/// SPIR-V, and its workgroup is 4 subgroups.
#[test]
fn coop_sources_translate_to_spirv() {
    for (t, f, src) in sources() {
        let (module, info) = validate(src, CAPS).expect("validates");
        for sg in [8.0, 32.0, 64.0] {
            let mut constants = naga::back::PipelineConstants::default();
            constants.insert("SG".to_string(), sg);
            let (m, i) = naga::back::pipeline_constants::process_overrides(
                &module,
                &info,
                Some((ShaderStage::Compute, MATMUL_COOP_ENTRY)),
                &constants,
            )
            .unwrap_or_else(|e| panic!("{t:?} {f:?} SG={sg}: {e}"));
            let size = m.entry_points[0].workgroup_size;
            assert_eq!(size, [MATMUL_COOP_SUBGROUPS * sg as u32, 1, 1]);
            let words = spv::write_vec(&m, &i, &spv::Options::default(), None)
                .unwrap_or_else(|e| panic!("{t:?} {f:?} SG={sg}: {e}"));
            assert_eq!(words[0], 0x0723_0203, "SPIR-V magic");
        }
    }
}

/// The backward product validates only with both features, has `matmul_bwd`'s bindings with
/// the same access plus a read-write binding [`MATMUL_BWD_COOP_STORAGE`] (the |dy| maxima),
/// its three entry points in launch order, and becomes SPIR-V at subgroup sizes 8, 32 and 64
/// with a workgroup of 4 subgroups for the products (256 lanes for the maxima).
#[test]
fn coop_backward_validates_binds_and_translates() {
    let plain = naga::front::wgsl::parse_str(Kernel::MatmulBwd.wgsl()).expect("matmul_bwd");
    let mut want = layout(&plain);
    want.push((MATMUL_BWD_COOP_STORAGE, "read_write".into()));
    assert_eq!(
        Kernel::MatmulBwd.storage_bindings() + 1,
        MATMUL_BWD_COOP_STORAGE
    );
    for t in CoopTile::ALL {
        let src = matmul_bwd_coop_wgsl(t);
        let (module, info) = validate(src, CAPS).unwrap_or_else(|e| panic!("{t:?}: {e}"));
        for missing in [
            Capabilities::COOPERATIVE_MATRIX,
            Capabilities::SHADER_FLOAT16,
        ] {
            assert!(
                validate(src, CAPS.difference(missing)).is_err(),
                "{t:?} validates without {missing:?}"
            );
        }
        assert_eq!(layout(&module), want, "{t:?}");
        let eps: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(eps, MATMUL_BWD_COOP_ENTRIES, "{t:?}");
        for sg in [8.0, 32.0, 64.0] {
            for (i, ep) in MATMUL_BWD_COOP_ENTRIES.iter().enumerate() {
                let mut constants = naga::back::PipelineConstants::default();
                constants.insert("SG".to_string(), sg);
                let (m, mi) = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((ShaderStage::Compute, ep)),
                    &constants,
                )
                .unwrap_or_else(|e| panic!("{t:?} {ep} SG={sg}: {e}"));
                let size = m.entry_points[0].workgroup_size;
                let lanes = if i == 0 {
                    256
                } else {
                    MATMUL_COOP_SUBGROUPS * sg as u32
                };
                assert_eq!(size, [lanes, 1, 1], "{t:?} {ep} SG={sg}");
                let words = spv::write_vec(&m, &mi, &spv::Options::default(), None)
                    .unwrap_or_else(|e| panic!("{t:?} {ep} SG={sg}: {e}"));
                assert_eq!(words[0], 0x0723_0203, "SPIR-V magic");
            }
        }
    }
}
