//! The PTX sources without a GPU or `ptxas`: every `.ptx` file in `kernels/ptx/` is listed by
//! the `Kernel` enum or `PTX_ONLY`; its `.entry` functions are the listed entry points (each
//! carrying the file's name); its header comment documents the algorithm, the launch layout,
//! the WGSL twin (or that it has none), the arguments and why it is deterministic; it targets PTX ISA 8.0 / sm_80; no kernel
//! uses atomics; and the committed resource report (`resources.toml`, checked against
//! `ptxas` by `scripts/ci.d/ptx.sh`) covers exactly these entries for both architectures.

use std::collections::BTreeSet;
use std::path::Path;

use rolloutpipe_kernels::{Kernel, PTX_ONLY};

fn ptx_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ptx")
}

/// `.entry` names in file order (`.visible .entry name(`).
fn entries(src: &str) -> Vec<&str> {
    src.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or("").trim())
        .collect()
}

/// The leading block of `//` comment lines.
fn header(src: &str) -> String {
    src.lines()
        .take_while(|l| l.starts_with("//"))
        .map(|l| l.trim_start_matches('/').trim())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The kernels with a PTX twin and their source.
fn ptx_kernels() -> impl Iterator<Item = (Kernel, &'static str)> {
    Kernel::CUDA
        .iter()
        .filter_map(|&k| k.ptx().map(|src| (k, src)))
}

/// Every PTX file as (name, entry points, source): the ops' and the CUDA-only kernels'.
fn ptx_files() -> impl Iterator<Item = (&'static str, &'static [&'static str], &'static str)> {
    ptx_kernels()
        .map(|(k, src)| (k.name(), k.ptx_entry_points(), src))
        .chain(PTX_ONLY.iter().map(|p| (p.name, p.entry_points, p.ptx)))
}

#[test]
fn every_ptx_file_is_listed_and_every_kernel_has_one() {
    let mut on_disk = BTreeSet::new();
    for e in std::fs::read_dir(ptx_dir()).expect("kernels/ptx") {
        let path = e.expect("dir entry").path();
        if path.extension().is_some_and(|x| x == "ptx") {
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .expect("utf-8 name");
            on_disk.insert(stem.to_string());
        }
    }
    let listed: BTreeSet<String> = ptx_files().map(|(name, _, _)| name.to_string()).collect();
    assert_eq!(
        on_disk, listed,
        "kernels/ptx/*.ptx vs Kernel::CUDA and PTX_ONLY"
    );
    for &k in Kernel::ALL {
        assert_eq!(
            k.ptx().is_some(),
            Kernel::CUDA.contains(&k),
            "{}: Kernel::CUDA lists exactly the kernels with PTX",
            k.name()
        );
    }
    for (name, _, src) in ptx_files() {
        let path = ptx_dir().join(format!("{name}.ptx"));
        let disk = std::fs::read_to_string(&path).expect("read ptx");
        assert_eq!(disk, src, "{name}: embedded source is stale");
    }
}

#[test]
fn entries_match_the_enum() {
    for (name, eps, src) in ptx_files() {
        let found = entries(src);
        assert_eq!(found, eps, "{name}");
        // As for WGSL: a single launch is the op itself; split ops prefix its name.
        if found.len() == 1 {
            assert_eq!(found[0], name);
        }
        for e in &found {
            assert!(e.starts_with(name), "{e} in {name}");
        }
    }
}

#[test]
fn headers_document_algorithm_layout_twin_and_arguments() {
    for (name, _, src) in ptx_files() {
        let h = header(src);
        assert!(h.starts_with(name), "{name}: header names the op first");
        for part in ["Algorithm", "Layout", "Mirrors", "Arguments", "Determinism"] {
            // `Part:` or `Part (which entry):`, followed by text on that or the next line.
            let lines: Vec<&str> = h.lines().collect();
            let at = lines
                .iter()
                .position(|l| {
                    l.strip_prefix(part).is_some_and(|rest| {
                        rest.starts_with(':') || (rest.starts_with(" (") && rest.contains("):"))
                    })
                })
                .unwrap_or_else(|| panic!("{name}: no {part}: section"));
            let after = lines[at].split_once(':').map_or("", |(_, r)| r).trim();
            let next = lines.get(at + 1).copied().unwrap_or("").trim();
            assert!(
                after.len() + next.len() > 20,
                "{name}: empty {part}: section"
            );
        }
        // An op names its WGSL twin; a CUDA-only kernel says it has none.
        let twin = format!("kernels/wgsl/{name}.wgsl");
        let only = PTX_ONLY.iter().any(|p| p.name == name);
        assert!(
            if only {
                h.contains("no WGSL twin")
            } else {
                h.contains(&twin)
            },
            "{name}: header must name {twin} (or, CUDA-only, say it has no WGSL twin)"
        );
    }
}

#[test]
fn every_file_targets_ptx_8_0_for_sm_80() {
    for (name, _, src) in ptx_files() {
        let directives: Vec<&str> = src.lines().filter(|l| l.starts_with('.')).take(3).collect();
        assert_eq!(
            directives,
            [".version 8.0", ".target sm_80", ".address_size 64"],
            "{name}"
        );
    }
}

#[test]
fn resource_report_covers_exactly_the_entries() {
    let report = std::fs::read_to_string(ptx_dir().join("resources.toml")).expect("report");
    let mut in_report = BTreeSet::new();
    for l in report.lines() {
        if let Some(sec) = l.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            in_report.insert(sec.to_string());
        }
    }
    let mut expected = BTreeSet::new();
    for arch in ["sm_80", "sm_90"] {
        for (_, eps, _) in ptx_files() {
            for e in eps {
                expected.insert(format!("{arch}.{e}"));
            }
        }
    }
    assert_eq!(
        in_report, expected,
        "run scripts/ci.d/ptx.sh --write after adding entries"
    );
}

/// Batch-invariant decoding and run-to-run identical training need fixed reduction orders:
/// no kernel may use atomics (`atom.*`) or reduction-to-memory (`red.*`) instructions.
#[test]
fn no_kernel_uses_atomics() {
    for (name, _, src) in ptx_files() {
        for (n, line) in src.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").trim_start();
            // Strip a guard predicate such as `@%p1 `.
            let instr = match code.strip_prefix('@') {
                Some(rest) => rest.split_once(' ').map_or("", |(_, i)| i.trim_start()),
                None => code,
            };
            assert!(
                !(instr.starts_with("atom.") || instr.starts_with("red.")),
                "{name}:{}: atomic instruction `{}`",
                n + 1,
                instr
            );
        }
    }
}
