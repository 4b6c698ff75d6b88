//! The simulator's Chrome/Perfetto trace of one step.
use std::path::Path;

use anyhow::Context;
use serde_json::json;

use super::super::driver::Recording;
use super::super::engine::Ns;
use super::super::metrics::{RunResult, secs};
use super::{overlaps, window};
use crate::trace::ChromeTrace;

/// Chrome/Perfetto trace of one step of one run: engines (requests as async spans and a
/// running-count counter), trainer (micro-batches, optimizer), weight sync, group completions.
pub fn write_trace(
    path: &Path,
    r: &RunResult,
    rec: &Recording,
    step: u64,
    engines: usize,
) -> anyhow::Result<()> {
    let (lo, hi) = window(r, step).context("trace step not simulated")?;
    let mut t = ChromeTrace::new();
    t.process(1, "rollout engines");
    for e in 0..engines {
        t.thread(1, e as u32, &format!("engine {e}"));
    }
    t.process(2, "trainer");
    t.thread(2, 0, "trainer");
    t.thread(2, 1, "weight sync");
    t.thread(2, 2, "groups");
    engine_events(&mut t, rec, (lo, hi));
    trainer_events(&mut t, rec, step, (lo, hi));
    tail_events(&mut t, rec, (lo, hi));
    t.write(path)
}

/// The engines' requests (async spans) and their held counts.
fn engine_events(t: &mut ChromeTrace, rec: &Recording, (lo, hi): (f64, f64)) {
    let us = |t: Ns| (secs(t) - lo) * 1e6;
    for (i, q) in rec.requests.iter().enumerate() {
        if overlaps(q.start, q.end, lo, hi) {
            let name = format!("s{}/g{}/{}", q.step, q.group, q.sample);
            let args = json!({"tokens": q.tokens, "outcome": if q.finished { "generated" } else { "aborted" }});
            t.async_span(
                &name,
                "request",
                1,
                u32::from(q.engine),
                i as u64,
                us(q.start),
                us(q.end),
                args,
            );
        }
    }
    for &(time, e, held) in &rec.held {
        if secs(time) >= lo && secs(time) <= hi {
            t.counter(
                &format!("held e{e}"),
                1,
                us(time),
                &[("requests", f64::from(held))],
            );
        }
    }
}

/// The trainer's work, the weight syncs and the step's group completions.
fn trainer_events(t: &mut ChromeTrace, rec: &Recording, step: u64, (lo, hi): (f64, f64)) {
    let us = |t: Ns| (secs(t) - lo) * 1e6;
    for (s, label, a, b) in &rec.trainer {
        if overlaps(*a, *b, lo, hi) {
            t.complete(
                label,
                "train",
                2,
                0,
                us(*a),
                us(*b) - us(*a),
                json!({"step": s}),
            );
        }
    }
    for &(a, b) in &rec.syncs {
        if overlaps(a, b, lo, hi) {
            t.complete("weight sync", "sync", 2, 1, us(a), us(b) - us(a), json!({}));
        }
    }
    for &(s, g, time) in &rec.completions {
        if s == step {
            t.instant(&format!("g{g} ready"), "group", 2, 2, us(time));
        }
    }
}

/// The bound-moving policies: log-prob passes run on rollout engines, and request moves.
fn tail_events(t: &mut ChromeTrace, rec: &Recording, (lo, hi): (f64, f64)) {
    let us = |t: Ns| (secs(t) - lo) * 1e6;
    for &(s, e, g, a, b) in &rec.mux {
        if overlaps(a, b, lo, hi) {
            t.complete(
                &format!("log-probs s{s}/g{g}"),
                "multiplexed",
                1,
                u32::from(e),
                us(a),
                us(b) - us(a),
                json!({"step": s, "group": g}),
            );
        }
    }
    for &(s, g, sample, from, to, time, tokens) in &rec.migrations {
        if secs(time) >= lo && secs(time) <= hi {
            t.instant(
                &format!("migrate s{s}/g{g}/{sample} -> e{to} ({tokens} tokens)"),
                "migration",
                1,
                u32::from(from),
                us(time),
            );
        }
    }
}
