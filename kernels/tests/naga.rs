//! Every WGSL kernel through naga on the CPU: parse, full validation (types, uniformity of
//! barriers, bounds of constant indices), and the binding convention the wgpu backend
//! relies on (see the crate docs). A broken kernel fails here without any GPU.

use naga::valid::{Capabilities, GlobalUse, ValidationFlags, Validator};
use naga::{AddressSpace, ShaderStage, StorageAccess};
use rolloutpipe_kernels::{
    CoopTile, Kernel, MAX_STORAGE_BINDINGS, PARAMS_BYTES, WeightFormat, matmul_bwd_coop_wgsl,
    matmul_coop_wgsl,
};

/// Every compiled source: each kernel in f32, and the 16-bit weight variants of those that
/// read weights (`Kernel::wgsl_as`), so the checks below cover what the backend compiles.
fn sources() -> Vec<(Kernel, WeightFormat, &'static str)> {
    let mut out = Vec::new();
    for &k in Kernel::ALL {
        for f in WeightFormat::ALL {
            if let Some(src) = k.wgsl_as(f) {
                out.push((k, f, src));
            }
        }
    }
    out
}

fn parse_src(k: Kernel, f: WeightFormat, src: &str) -> (naga::Module, naga::valid::ModuleInfo) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{} ({f:?}): {}", k.name(), e.emit_to_string(src)));
    // No capabilities, except that `unpack2x16float` (f16 weights) is naga's
    // SHADER_FLOAT16_IN_FLOAT32: wgpu's downlevel flag SHADER_F16_IN_F32, which every Vulkan,
    // Metal and DX12 adapter has; it is not the `shader-f16` feature. bf16 needs nothing.
    let caps = match f {
        WeightFormat::F16 => Capabilities::SHADER_FLOAT16_IN_FLOAT32,
        _ => Capabilities::empty(),
    };
    let info = Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{} ({f:?}): {}", k.name(), e.emit_to_string(src)));
    (module, info)
}

fn parse(k: Kernel) -> (naga::Module, naga::valid::ModuleInfo) {
    parse_src(k, WeightFormat::F32, k.wgsl())
}

#[test]
fn every_kernel_parses_and_validates() {
    for (k, f, src) in sources() {
        parse_src(k, f, src);
    }
}

/// The 16-bit variants are the f32 source with only the weight prelude swapped, and exist
/// exactly for the kernels that read weights.
#[test]
fn weight_variants_differ_only_in_the_weight_prelude() {
    let prelude = |f: WeightFormat| {
        let path = format!(
            "{}/wgsl/prelude/{}.wgsl",
            env!("CARGO_MANIFEST_DIR"),
            f.prelude()
        );
        std::fs::read_to_string(path).expect("weight prelude")
    };
    let f32_src = prelude(WeightFormat::F32);
    for &k in Kernel::ALL {
        assert_eq!(k.wgsl_as(WeightFormat::F32), Some(k.wgsl()));
        assert_eq!(
            k.reads_weights(),
            k.preludes().contains(&"weight_f32"),
            "{}",
            k.name()
        );
        for f in [WeightFormat::Bf16, WeightFormat::F16] {
            match k.wgsl_as(f) {
                Some(src) => {
                    assert!(k.reads_weights(), "{}", k.name());
                    assert_eq!(k.wgsl().matches(f32_src.as_str()).count(), 1);
                    let want = k.wgsl().replacen(f32_src.as_str(), &prelude(f), 1);
                    assert_eq!(src, want, "{} {f:?}", k.name());
                }
                None => assert!(!k.reads_weights(), "{} {f:?}", k.name()),
            }
        }
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
    for (k, f, src) in sources() {
        let (module, info) = parse_src(k, f, src);
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
                    let want = if k.read_only_bindings().contains(&b.binding) {
                        StorageAccess::LOAD
                    } else {
                        StorageAccess::LOAD | StorageAccess::STORE
                    };
                    assert_eq!(
                        access,
                        want,
                        "{}: binding {} ({:?}) is declared unlike Kernel::read_only_bindings",
                        k.name(),
                        b.binding,
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
            // A buffer no entry point writes is bound read-only (naga rejects a write to a
            // `read` binding, so the other direction is checked by validation).
            let written = (0..module.entry_points.len())
                .any(|i| info.get_entry_point(i)[*h].contains(GlobalUse::WRITE));
            assert!(
                written || k.read_only_bindings().contains(b),
                "{}: binding {b} is only read; declare it `read` and list it in read_only_bindings",
                k.name()
            );
        }
    }
}

/// Functions the `gemm` prelude calls and each including file defines for its operands, and
/// the hook each `weight_*` prelude defines for its format (one of them is prepended).
const GEMM_HOOKS: [&str; 5] = ["gemm_a", "gemm_b", "gemm_a4", "gemm_b4", "gemm_store"];
const WEIGHT_HOOKS: [&str; 2] = ["weight", "weight4"];

/// A vec4-typed binding's scalar accessor, `fn NAME_at(i: u32) -> f32` whose body is exactly
/// `return NAME[i >> 2u][i & 3u];`: each file names its own bindings, so two files may each
/// define `x_at`, but only as this one line (anything longer is a helper and is checked).
fn is_binding_accessor(name: &str, body: &str) -> bool {
    name.strip_suffix("_at")
        .is_some_and(|b| !b.is_empty() && body.trim() == format!("return {b}[i >> 2u][i & 3u];"))
}

/// No helper is written twice: across every kernel file and prelude, a function name is
/// defined once (the `gemm` prelude's operand hooks excepted), and every prelude file is
/// prepended to at least one kernel.
#[test]
fn helpers_are_written_once_and_preludes_used() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/wgsl");
    let mut files: Vec<std::path::PathBuf> = Vec::new();
    for dir in [root.to_string(), format!("{root}/prelude")] {
        for e in std::fs::read_dir(&dir).expect("wgsl dir") {
            let p = e.expect("entry").path();
            if p.extension().is_some_and(|x| x == "wgsl") {
                files.push(p);
            }
        }
    }
    let mut seen = std::collections::BTreeMap::new();
    for f in &files {
        let src = std::fs::read_to_string(f).expect("read");
        let lines: Vec<&str> = src.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            let Some(rest) = line.strip_prefix("fn ") else {
                continue;
            };
            let name = rest.split('(').next().unwrap_or("").trim().to_string();
            let weight_prelude = f
                .file_stem()
                .and_then(|s| s.to_str())
                .is_some_and(|s| s.starts_with("weight_"));
            let body = lines.get(n + 1).copied().unwrap_or("");
            let closes = lines.get(n + 2).is_some_and(|l| l.trim() == "}");
            if GEMM_HOOKS.contains(&name.as_str())
                || (WEIGHT_HOOKS.contains(&name.as_str()) && weight_prelude)
                || (closes && is_binding_accessor(&name, body))
            {
                continue;
            }
            if let Some(prev) = seen.insert(name.clone(), f.clone()) {
                panic!("fn {name} is written in both {prev:?} and {f:?}");
            }
        }
    }
    for f in std::fs::read_dir(format!("{root}/prelude")).expect("prelude dir") {
        let p = f.expect("entry").path();
        let stem = p
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("")
            .to_string();
        let weight_format = WeightFormat::ALL.iter().any(|f| f.prelude() == stem);
        // The fragment-shape preludes and `coop_tile` are prepended to the tensor-core
        // products (tests/coop.rs).
        let coop = CoopTile::ALL.iter().any(|t| {
            let marker = format!("// Prelude `{stem}`");
            matmul_bwd_coop_wgsl(*t).contains(&marker)
                && WeightFormat::ALL
                    .iter()
                    .all(|f| matmul_coop_wgsl(*t, *f).contains(&marker))
        });
        assert!(
            coop || Kernel::ALL
                .iter()
                .any(|k| k.preludes().contains(&stem.as_str())
                    || (weight_format && k.reads_weights())),
            "prelude {stem} is used by no kernel"
        );
    }
    // The gemm prelude's hooks are what its including files define, and only those do.
    for &k in Kernel::ALL {
        let uses_gemm = k.preludes().contains(&"gemm");
        for hook in GEMM_HOOKS {
            assert_eq!(
                k.wgsl().contains(&format!("fn {hook}(")),
                uses_gemm,
                "{}: fn {hook}",
                k.name()
            );
        }
    }
}
