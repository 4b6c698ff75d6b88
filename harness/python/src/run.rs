//! Training runs from Python: `train` runs `rolloutpipe train`'s job with its workers either
//! in-process or behind a caller's `send(route, bytes) -> bytes` (the Ray launcher,
//! `rolloutpipe.ray`), and the hosts that answer those messages (`EngineHost`, `TrainerHost`,
//! `VerifierHost`), which a Ray actor (or any other process) holds.
//!
//! The scheduler runs on the calling thread with the GIL released; the proxy threads take the
//! GIL only to call `send`. Hosts release the GIL while they work.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use rolloutpipe_harness::cmd::train::{Args, resolve};
use rolloutpipe_harness::train::remote::{self, Forwarding, Route};
use rolloutpipe_harness::train::{Local, RunOptions, TrainConfig, run_with_transport};

use crate::errors::{RunError, WireError};

fn poisoned() -> PyErr {
    PyRuntimeError::new_err("the host panicked earlier; recreate it")
}

fn wire_err(e: anyhow::Error) -> PyErr {
    WireError::new_err(format!("{e:#}"))
}

/// A rollout engine behind the wire: answers `handle(message, published)` with its reply.
/// `published` is the last weights blob published for the engines (the `engine/i/sync`
/// route's messages need it). Worker failures come back inside the reply; a message it cannot
/// read raises `WireError`.
#[pyclass(module = "rolloutpipe")]
pub struct EngineHost(Mutex<remote::EngineHost>);

#[pymethods]
impl EngineHost {
    #[new]
    fn new() -> Self {
        EngineHost(Mutex::new(remote::EngineHost::new()))
    }

    /// Answers one message (GIL released while the engine works).
    #[pyo3(signature = (message, published = None))]
    fn handle<'py>(
        &self,
        py: Python<'py>,
        message: &[u8],
        published: Option<&[u8]>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let out = py.detach(|| {
            let mut h = self.0.lock().map_err(|_| poisoned())?;
            h.handle(message, published).map_err(wire_err)
        })?;
        Ok(PyBytes::new(py, &out))
    }
}

/// The trainer behind the wire (see `EngineHost`).
#[pyclass(module = "rolloutpipe")]
pub struct TrainerHost(Mutex<remote::TrainerHost>);

#[pymethods]
impl TrainerHost {
    #[new]
    fn new() -> Self {
        TrainerHost(Mutex::new(remote::TrainerHost::new()))
    }

    /// Answers one message (GIL released while the trainer works).
    fn handle<'py>(&self, py: Python<'py>, message: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let out = py.detach(|| {
            let mut h = self.0.lock().map_err(|_| poisoned())?;
            h.handle(message).map_err(wire_err)
        })?;
        Ok(PyBytes::new(py, &out))
    }
}

/// A verifier behind the wire (see `EngineHost`).
#[pyclass(module = "rolloutpipe")]
pub struct VerifierHost(Mutex<remote::VerifierHost>);

#[pymethods]
impl VerifierHost {
    #[new]
    fn new() -> Self {
        VerifierHost(Mutex::new(remote::VerifierHost::new()))
    }

    /// Answers one message (GIL released while it scores).
    fn handle<'py>(&self, py: Python<'py>, message: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let out = py.detach(|| {
            let mut h = self.0.lock().map_err(|_| poisoned())?;
            h.handle(message).map_err(wire_err)
        })?;
        Ok(PyBytes::new(py, &out))
    }
}

fn resolve_args(
    config: Option<PathBuf>,
    out: Option<PathBuf>,
    sets: Vec<String>,
    resume: bool,
    force: bool,
) -> PyResult<TrainConfig> {
    let (out, resume_dir) = if resume { (None, out) } else { (out, None) };
    if resume && resume_dir.is_none() {
        return Err(RunError::new_err("resume needs the run directory (out)"));
    }
    let args = Args {
        config,
        sets,
        backend: None,
        mode: None,
        out,
        resume: resume_dir,
        print_config: false,
        force,
    };
    resolve(&args).map_err(|e| RunError::new_err(format!("{e:#}")))
}

/// The resolved config of `rolloutpipe train --config CONFIG --set ... [--out|--resume] OUT`,
/// as JSON text (every section and key).
#[pyfunction]
#[pyo3(signature = (config = None, out = None, sets = Vec::new(), resume = false))]
pub fn resolve_config(
    config: Option<PathBuf>,
    out: Option<PathBuf>,
    sets: Vec<String>,
    resume: bool,
) -> PyResult<String> {
    let cfg = resolve_args(config, out, sets, resume, false)?;
    serde_json::to_string(&cfg).map_err(|e| RunError::new_err(e.to_string()))
}

/// Runs the training job of `config` (a TOML file over the default, as `rolloutpipe train
/// --config`; `sets` are `--set` overrides) in run directory `out` (or continues it with
/// `resume`). With `send=None` the workers are threads of this process; otherwise each message
/// goes through `send(route: str, message: bytes) -> bytes` (routes `engine/i`,
/// `engine/i/sync`, `verifier/i`, `trainer`, `publish`; see `rolloutpipe.ray`). An engine whose
/// `send` raises is treated as lost: its requests are re-admitted on the others.
///
/// Returns a dict: `steps`, `metrics` (one dict per step, as in metrics.jsonl), `trained`
/// (`(step, rollout_step, group, sample, version)` per trained response), `counters` (the
/// core's per step, as dicts), `weights` (the final weights as safetensors bytes), `dir`, and
/// with `send`, `wire` (messages and bytes that crossed it).
#[pyfunction]
#[pyo3(signature = (config, out, send = None, sets = Vec::new(), resume = false, force = false))]
pub fn train<'py>(
    py: Python<'py>,
    config: Option<PathBuf>,
    out: PathBuf,
    send: Option<Py<PyAny>>,
    sets: Vec<String>,
    resume: bool,
    force: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = resolve_args(config, Some(out.clone()), sets, resume, force)?;
    let opts = RunOptions { resume, force };
    let dir = cfg.run.out.clone();
    let fwd = send.map(|f| {
        Forwarding::new(move |route: &Route, msg: Vec<u8>| {
            Python::attach(|py| -> PyResult<Vec<u8>> {
                let r = f.call1(py, (route.to_string(), PyBytes::new(py, &msg)))?;
                // Borrowed from the reply's bytes object (a weights export is megabytes).
                let b = r.bind(py);
                let bytes: &[u8] = b.extract()?;
                Ok(bytes.to_vec())
            })
            .map_err(|e| anyhow::anyhow!("{e}"))
        })
    });
    let outcome = py.detach(|| match &fwd {
        Some(t) => run_with_transport(&cfg, &dir, opts, t),
        None => run_with_transport(&cfg, &dir, opts, &Local),
    });
    let o = outcome.map_err(|e| RunError::new_err(format!("{e:#}")))?;
    let d = PyDict::new(py);
    let json = py.import("json")?;
    let to_py = |v: String| json.call_method1("loads", (v,));
    d.set_item("steps", o.metrics.len())?;
    d.set_item(
        "metrics",
        to_py(serde_json::to_string(&o.metrics).map_err(|e| RunError::new_err(e.to_string()))?)?,
    )?;
    d.set_item(
        "counters",
        to_py(serde_json::to_string(&o.counters).map_err(|e| RunError::new_err(e.to_string()))?)?,
    )?;
    let trained: Vec<(u64, u64, u32, u16, u64)> = o
        .trained
        .iter()
        .map(|r| (r.step, r.rollout_step, r.group, r.sample, r.version))
        .collect();
    d.set_item("trained", trained)?;
    let w = o
        .weights
        .to_safetensors_bytes()
        .map_err(|e| RunError::new_err(e.to_string()))?;
    d.set_item("weights", PyBytes::new(py, &w))?;
    d.set_item("dir", o.dir.to_string_lossy().into_owned())?;
    if let Some(t) = &fwd {
        let c = t.counts();
        let wire = PyDict::new(py);
        wire.set_item("calls", c.calls)?;
        wire.set_item("bytes_out", c.bytes_out)?;
        wire.set_item("bytes_in", c.bytes_in)?;
        wire.set_item("publishes", c.publishes)?;
        wire.set_item("published_bytes", c.published_bytes)?;
        d.set_item("wire", wire)?;
    }
    Ok(d)
}
