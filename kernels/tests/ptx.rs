//! The PTX sources without a GPU or `ptxas`: every `.ptx` file in `kernels/ptx/` is listed by
//! the `Kernel` enum; its `.entry` functions are the enum's `ptx_entry_points` (each carrying
//! the op's name); its header comment documents the algorithm, the launch layout, the WGSL
//! twin, the arguments and why it is deterministic; it targets PTX ISA 8.0 / sm_80; no kernel
//! uses atomics; and the committed resource report (`resources.toml`, checked against
//! `ptxas` by `scripts/ci.d/ptx.sh`) covers exactly these entries for both architectures.

use std::collections::BTreeSet;
use std::path::Path;

use rolloutpipe_kernels::Kernel;

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
    let listed: BTreeSet<String> = Kernel::CUDA.iter().map(|k| k.name().to_string()).collect();
    assert_eq!(on_disk, listed, "kernels/ptx/*.ptx vs Kernel::CUDA");
    for &k in Kernel::ALL {
        assert_eq!(
            k.ptx().is_some(),
            Kernel::CUDA.contains(&k),
            "{}: Kernel::CUDA lists exactly the kernels with PTX",
            k.name()
        );
    }
    for (k, src) in ptx_kernels() {
        let path = ptx_dir().join(format!("{}.ptx", k.name()));
        let disk = std::fs::read_to_string(&path).expect("read ptx");
        assert_eq!(disk, src, "{}: embedded source is stale", k.name());
    }
}

#[test]
fn entries_match_the_enum() {
    for (k, src) in ptx_kernels() {
        let found = entries(src);
        assert_eq!(found, k.ptx_entry_points(), "{}", k.name());
        // As for WGSL: a single launch is the op itself; split ops prefix its name.
        if found.len() == 1 {
            assert_eq!(found[0], k.name());
        }
        for e in &found {
            assert!(e.starts_with(k.name()), "{e} in {}", k.name());
        }
    }
}

#[test]
fn headers_document_algorithm_layout_twin_and_arguments() {
    for (k, src) in ptx_kernels() {
        let h = header(src);
        assert!(
            h.starts_with(k.name()),
            "{}: header names the op first",
            k.name()
        );
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
                .unwrap_or_else(|| panic!("{}: no {part}: section", k.name()));
            let after = lines[at].split_once(':').map_or("", |(_, r)| r).trim();
            let next = lines.get(at + 1).copied().unwrap_or("").trim();
            assert!(
                after.len() + next.len() > 20,
                "{}: empty {part}: section",
                k.name()
            );
        }
        let twin = format!("kernels/wgsl/{}.wgsl", k.name());
        assert!(h.contains(&twin), "{}: header must name {twin}", k.name());
    }
}

#[test]
fn every_file_targets_ptx_8_0_for_sm_80() {
    for (k, src) in ptx_kernels() {
        let directives: Vec<&str> = src.lines().filter(|l| l.starts_with('.')).take(3).collect();
        assert_eq!(
            directives,
            [".version 8.0", ".target sm_80", ".address_size 64"],
            "{}",
            k.name()
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
        for &k in Kernel::ALL {
            for e in k.ptx_entry_points() {
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
    for (k, src) in ptx_kernels() {
        for (n, line) in src.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").trim_start();
            // Strip a guard predicate such as `@%p1 `.
            let instr = match code.strip_prefix('@') {
                Some(rest) => rest.split_once(' ').map_or("", |(_, i)| i.trim_start()),
                None => code,
            };
            assert!(
                !(instr.starts_with("atom.") || instr.starts_with("red.")),
                "{}:{}: atomic instruction `{}`",
                k.name(),
                n + 1,
                instr
            );
        }
    }
}
