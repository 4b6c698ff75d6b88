//! Replays the fuzz corpus (`fuzz/corpus/events/`) through the same driver the cargo-fuzz target
//! uses, plus a few thousand seeded random inputs, so the stable test command covers it.

#[allow(dead_code)]
#[path = "../../fuzz/src/events.rs"]
mod events;

use std::path::Path;

#[test]
fn corpus_replays_without_a_broken_invariant() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/events");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("fuzz/corpus/events exists")
        .map(|e| e.expect("readable corpus entry").path())
        .collect();
    // Smallest first, so that under Miri (~1000x slower) the one input replayed is cheap.
    paths.sort_by_key(|p| (std::fs::metadata(p).map_or(0, |m| m.len()), p.clone()));
    let total = paths.len();
    // One input shows the driver is sound there too.
    paths.truncate(if cfg!(miri) { 1 } else { total });
    let mut n = 0;
    for path in paths {
        let data = std::fs::read(&path).expect("readable corpus file");
        events::run(&data);
        n += 1;
    }
    assert!(total >= 8 && n >= 1, "corpus has only {total} inputs");
}

#[test]
fn seeded_random_inputs_keep_every_invariant() {
    // xorshift64*: deterministic inputs of varied length.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let cases = if cfg!(miri) { 1 } else { 3000 };
    let mut total = events::Stats::default();
    for _ in 0..cases {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let len = (x % if cfg!(miri) { 150 } else { 600 }) as usize;
        let data: Vec<u8> = (0..len)
            .map(|_| {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect();
        let st = events::run(&data);
        total.events += st.events;
        total.errors += st.errors;
        total.steps_done += st.steps_done;
        total.dispatched += st.dispatched;
        total.filtered += st.filtered;
        total.aborted += st.aborted;
        total.failed += st.failed;
    }
    println!("{total:?}");
    if !cfg!(miri) {
        // The driver must reach deep states, not just bounce off errors.
        assert!(
            total.steps_done > 100 && total.dispatched > 1000,
            "{total:?}"
        );
        assert!(
            total.filtered > 100 && total.aborted > 100 && total.failed > 100,
            "{total:?}"
        );
        assert!(
            total.errors > 1000 && total.errors < total.events / 2,
            "{total:?}"
        );
    }
}
