//! The committed C header is what cbindgen generates from the crate today. A stale header
//! fails the test; `RP_BLESS=1` rewrites it instead.

use std::path::Path;

#[test]
fn committed_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("utf-8 header");
    let path = dir.join("include/rolloutpipe.h");
    if std::env::var_os("RP_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write the header");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: run RP_BLESS=1 cargo test -p rolloutpipe-capi --test header",
        path.display()
    );
    for needed in [
        "RP_ABI_VERSION",
        "rp_scheduler_new",
        "rp_poll_admit_batch",
        "RpCounters",
    ] {
        assert!(generated.contains(needed), "header lacks {needed}");
    }
}
