//! The tensor-core product `matmul_fwd_coop` through naga on the CPU, for every fragment shape
//! and weight format: it parses, validates only with the capabilities its features grant,
//! keeps `matmul_fwd`'s bindings (the backend launches it in that kernel's place), and
//! translates to SPIR-V at the subgroup sizes adapters use.

use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};
use naga::{AddressSpace, ShaderStage, StorageAccess};
use rolloutpipe_kernels::{
    CoopTile, Kernel, MATMUL_COOP_ENTRY, MATMUL_COOP_SUBGROUPS, WeightFormat, matmul_coop_wgsl,
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

/// The same `Params`-then-storage layout as `matmul_fwd`, with the same access per binding:
/// the host binds the same buffers to either kernel.
#[test]
fn coop_bindings_are_matmul_fwds() {
    let plain = naga::front::wgsl::parse_str(Kernel::MatmulFwd.wgsl()).expect("matmul_fwd");
    let layout = |m: &naga::Module| {
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
    };
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
