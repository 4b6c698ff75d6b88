//! Every WGSL kernel through naga on the CPU: parse, full validation (types, uniformity of
//! barriers, bounds of constant indices), and the binding convention the wgpu backend
//! relies on (see the crate docs). A broken kernel fails here without any GPU.

use naga::valid::{Capabilities, GlobalUse, ValidationFlags, Validator};
use naga::{AddressSpace, ShaderStage, StorageAccess};
use rolloutpipe_kernels::{Kernel, MAX_STORAGE_BINDINGS, PARAMS_BYTES};

fn parse(k: Kernel) -> (naga::Module, naga::valid::ModuleInfo) {
    let module = naga::front::wgsl::parse_str(k.wgsl())
        .unwrap_or_else(|e| panic!("{}: {}", k.name(), e.emit_to_string(k.wgsl())));
    let info = Validator::new(ValidationFlags::all(), Capabilities::empty())
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: {}", k.name(), e.emit_to_string(k.wgsl())));
    (module, info)
}

#[test]
fn every_kernel_parses_and_validates() {
    for &k in Kernel::ALL {
        parse(k);
    }
}

#[test]
fn entry_points_match_the_enum() {
    for &k in Kernel::ALL {
        let (module, _) = parse(k);
        let names: Vec<&str> = module
            .entry_points
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(names, k.entry_points(), "{}", k.name());
        for ep in &module.entry_points {
            assert_eq!(ep.stage, ShaderStage::Compute, "{}", ep.name);
            assert_eq!(ep.workgroup_size, k.workgroup_size(), "{}", ep.name);
        }
    }
}

#[test]
fn bindings_follow_the_convention() {
    for &k in Kernel::ALL {
        let (module, info) = parse(k);
        let mut storage = Vec::new();
        let mut uniform = None;
        for (h, var) in module.global_variables.iter() {
            let Some(b) = &var.binding else { continue };
            assert_eq!(b.group, 0, "{}: {:?}", k.name(), var.name);
            match var.space {
                AddressSpace::Uniform => {
                    assert_eq!(b.binding, 0, "{}: the uniform sits at binding 0", k.name());
                    let size = module.types[var.ty].inner.size(module.to_ctx());
                    assert!(
                        u64::from(size) <= PARAMS_BYTES,
                        "{}: Params is {size} bytes",
                        k.name()
                    );
                    uniform = Some(h);
                }
                AddressSpace::Storage { access } => {
                    assert_eq!(
                        access,
                        StorageAccess::LOAD | StorageAccess::STORE,
                        "{}: {:?} must be read_write (one layout per file)",
                        k.name(),
                        var.name
                    );
                    storage.push((b.binding, h));
                }
                other => panic!("{}: unexpected resource space {other:?}", k.name()),
            }
        }
        let uniform = uniform.unwrap_or_else(|| panic!("{}: no Params uniform", k.name()));
        storage.sort_by_key(|(b, _)| *b);
        let bindings: Vec<u32> = storage.iter().map(|(b, _)| *b).collect();
        let expected: Vec<u32> = (1..=k.storage_bindings()).collect();
        assert_eq!(bindings, expected, "{}: storage bindings", k.name());
        assert!(k.storage_bindings() <= MAX_STORAGE_BINDINGS);
        // Every entry point reads its parameters and touches at least one buffer; every
        // buffer is used by some entry point (an unused binding is a wiring mistake).
        for (i, ep) in module.entry_points.iter().enumerate() {
            let fi = info.get_entry_point(i);
            assert!(
                fi[uniform].contains(GlobalUse::READ),
                "{}: params unused",
                ep.name
            );
            assert!(
                storage
                    .iter()
                    .any(|(_, h)| fi[*h].contains(GlobalUse::WRITE)),
                "{}: writes nothing",
                ep.name
            );
        }
        for (b, h) in &storage {
            let used =
                (0..module.entry_points.len()).any(|i| !info.get_entry_point(i)[*h].is_empty());
            assert!(used, "{}: binding {b} is never used", k.name());
        }
    }
}
