//! Run directories written by older binaries still resume: `fixtures/checkpoint-format-1` is a
//! one-step-off run whose checkpoint (`state.json` format 1: the pending batch's log-probs and
//! rewards as JSON numbers) holds a rolled-out group not yet trained. Resumed here, it ends with
//! the weights the binary that wrote it ends with.
mod support;

use std::path::Path;

use rolloutpipe_harness::train::{TrainConfig, run};

/// FNV-1a over every tensor's name and little-endian f32 bytes, by name: a fingerprint of the
/// weights' bits.
fn fingerprint(w: &rolloutpipe_backends::Weights) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (name, bits) in support::train::bits(w) {
        let bytes = bits.iter().flat_map(|b| b.to_le_bytes());
        for byte in name.bytes().chain(bytes) {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn a_format_1_checkpoint_resumes_to_the_weights_its_writer_ends_with() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-format-1");
    let dir = support::train::scratch("format", "1");
    copy_dir(&fixture, &dir);
    let text = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    let cfg = TrainConfig::from_toml_str(&text)
        .unwrap()
        .set(&["run.steps=3"])
        .unwrap();
    let o = run(&cfg, &dir, true).unwrap();
    // The pending group (step 1, group 1) is trained first, by the step the checkpoint is at.
    let pending: Vec<_> = (o.trained.iter())
        .filter(|t| t.rollout_step == 1)
        .map(|t| (t.step, t.group, t.sample, t.version))
        .collect();
    assert_eq!(
        pending,
        [(1, 1, 0, 0), (1, 1, 1, 0), (1, 1, 2, 0), (1, 1, 3, 0)]
    );
    // What the binary that wrote the fixture ends with when it resumes it (`rolloutpipe train
    // --resume DIR --set run.steps=3`, its final/model.safetensors fingerprinted the same way).
    assert_eq!(fingerprint(&o.weights), 0x96a7_d686_2814_3510);
    // The checkpoints it writes are format 2.
    let latest = std::fs::read_to_string(dir.join("checkpoints/latest")).unwrap();
    let state = std::fs::read_to_string(
        dir.join("checkpoints")
            .join(latest.trim())
            .join("state.json"),
    )
    .unwrap();
    assert!(state.starts_with("{\"format\":2,"), "{state}");
}
