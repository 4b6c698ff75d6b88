//! Chrome trace-event JSON (opens in Perfetto and `chrome://tracing`), shared by the simulator
//! and end-to-end runs.
//!
//! Tracks are (process, thread) pairs named once with metadata events. Spans that may overlap on
//! one track (requests sharing an engine) are async spans, which Perfetto lays out on sub-tracks;
//! strictly sequential work (micro-batches) uses complete events. Times are microseconds.
use std::path::Path;

use anyhow::Context;
use serde_json::{Value, json};

/// An in-memory trace; events keep insertion order.
#[derive(Debug, Default, Clone)]
pub struct ChromeTrace {
    events: Vec<Value>,
}

impl ChromeTrace {
    /// An empty trace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Names process `pid` (a group of tracks, e.g. "rollout engines").
    pub fn process(&mut self, pid: u32, name: &str) {
        self.events
            .push(json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}));
    }

    /// Names track `tid` of process `pid`.
    pub fn thread(&mut self, pid: u32, tid: u32, name: &str) {
        self.events
            .push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}));
    }

    /// A span on a sequential track.
    // One argument per field of the trace format's event; a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        &mut self,
        name: &str,
        cat: &str,
        pid: u32,
        tid: u32,
        start_us: f64,
        dur_us: f64,
        args: Value,
    ) {
        self.events.push(json!({
            "name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
            "ts": start_us, "dur": dur_us.max(0.0), "args": args,
        }));
    }

    /// A span that may overlap others on the same track; `id` must be unique within `cat`.
    // One argument per field of the trace format's event; a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub fn async_span(
        &mut self,
        name: &str,
        cat: &str,
        pid: u32,
        tid: u32,
        id: u64,
        start_us: f64,
        end_us: f64,
        args: Value,
    ) {
        self.events.push(json!({
            "name": name, "cat": cat, "ph": "b", "pid": pid, "tid": tid, "id": id, "ts": start_us, "args": args,
        }));
        self.events.push(json!({
            "name": name, "cat": cat, "ph": "e", "pid": pid, "tid": tid, "id": id, "ts": end_us.max(start_us),
        }));
    }

    /// A counter sample (one or more named values) on process `pid`.
    pub fn counter(&mut self, name: &str, pid: u32, ts_us: f64, values: &[(&str, f64)]) {
        let args: serde_json::Map<String, Value> = values
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        self.events
            .push(json!({"name": name, "ph": "C", "pid": pid, "ts": ts_us, "args": args}));
    }

    /// A point event on a track.
    pub fn instant(&mut self, name: &str, cat: &str, pid: u32, tid: u32, ts_us: f64) {
        self.events
            .push(json!({"name": name, "cat": cat, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": ts_us}));
    }

    /// Number of events recorded.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether no event was recorded.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// The trace as a JSON object (`traceEvents` plus display unit).
    pub fn to_json(&self) -> Value {
        json!({"traceEvents": self.events, "displayTimeUnit": "ms"})
    }

    /// Writes the trace to `path`, creating its directory.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let text = serde_json::to_string(&self.to_json()).context("serializing the trace")?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }
}

/// The events of an earlier trace file (empty when there is none or it cannot be read) and the
/// time just after its last event, µs: a resumed run's events are placed after it.
pub fn read_events(path: &Path) -> (Vec<Value>, f64) {
    let events: Vec<Value> = std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("traceEvents")?.as_array().cloned())
        .unwrap_or_default();
    let end = events
        .iter()
        .filter_map(|e| {
            let ts = e.get("ts")?.as_f64()?;
            Some(ts + e.get("dur").and_then(Value::as_f64).unwrap_or(0.0))
        })
        .fold(0.0f64, f64::max);
    let offset = if events.is_empty() { 0.0 } else { end + 1000.0 };
    (events, offset)
}

impl ChromeTrace {
    /// Writes `base` (an earlier invocation's events) followed by these events shifted by
    /// `offset_us`, through a temporary file so a kill mid-write keeps the previous file.
    pub fn write_merged(&self, path: &Path, base: &[Value], offset_us: f64) -> anyhow::Result<()> {
        let mut events = base.to_vec();
        events.extend(self.events.iter().map(|e| {
            let mut e = e.clone();
            if let Some(ts) = e.get("ts").and_then(Value::as_f64) {
                e["ts"] = json!(ts + offset_us);
            }
            e
        }));
        let text = serde_json::to_string(&json!({"traceEvents": events, "displayTimeUnit": "ms"}))
            .context("serializing the trace")?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_resumed_trace_is_appended_after_the_earlier_one() {
        let p = std::env::temp_dir().join(format!("rp-trace-merge-{}.json", std::process::id()));
        let mut a = ChromeTrace::new();
        a.complete("mb", "train", 1, 0, 10.0, 5.0, json!({}));
        a.write(&p).unwrap();
        let (base, off) = read_events(&p);
        assert_eq!((base.len(), off), (1, 1015.0));
        let mut b = ChromeTrace::new();
        b.complete("mb", "train", 1, 0, 0.0, 2.0, json!({}));
        b.write_merged(&p, &base, off).unwrap();
        let (all, _) = read_events(&p);
        let ts: Vec<f64> = all.iter().map(|e| e["ts"].as_f64().unwrap()).collect();
        assert_eq!(ts, [10.0, 1015.0]);
        assert_eq!(read_events(&p.with_extension("missing")).0.len(), 0);
    }

    use super::*;

    #[test]
    fn events_have_chrome_trace_shape() {
        let mut t = ChromeTrace::new();
        t.process(1, "engines");
        t.thread(1, 0, "engine 0");
        t.async_span(
            "g0/s1",
            "request",
            1,
            0,
            42,
            10.0,
            5.0,
            json!({"tokens": 7}),
        );
        t.complete("mb 0", "train", 2, 0, 3.0, 4.0, json!({}));
        t.counter("running", 1, 1.0, &[("engine 0", 3.0)]);
        t.instant("sync", "train", 2, 0, 9.0);
        let v = t.to_json();
        let ev = v["traceEvents"].as_array().unwrap();
        assert_eq!(ev.len(), 7);
        assert_eq!(ev[2]["ph"], "b");
        assert_eq!(ev[3]["ph"], "e");
        // An end before its start is clamped so the span is never negative.
        assert_eq!(ev[3]["ts"], 10.0);
        assert_eq!(ev[4]["dur"], 4.0);
        assert_eq!(ev[5]["args"]["engine 0"], 3.0);
        let path =
            std::env::temp_dir().join(format!("rolloutpipe-trace-{}.json", std::process::id()));
        t.write(&path).unwrap();
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back, v);
    }
}
