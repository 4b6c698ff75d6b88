//! `rolloutpipe.CpuPolicy`: the CPU reference backend (Qwen3, f32) as an engine and a trainer.
//! One object can play both roles; a deployment usually makes one per engine and one for the
//! trainer and syncs weights through `export_weights` / `import_weights` (safetensors with HF
//! tensor names). The GIL is released around every model call (`Python::detach`), so other
//! Python threads run while a decode step or a backward pass does.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::{PyFileExistsError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rolloutpipe_backends::{
    AdamW, Aggregation, BackendInfo, CpuBackend, FinishReason, GenRequest, ModelConfig, Objective,
    RequestKey, RolloutEngine, SamplingParams, Sequence, TrainBatch, TrainSequence, Trainer,
    Weights, load_model_dir, save_model_dir,
};

use crate::errors::BackendError;

fn backend_err(e: rolloutpipe_backends::BackendError) -> PyErr {
    BackendError::new_err(e.to_string())
}

/// A finished response: the request key, its tokens and their sampling log-probs, and why it
/// stopped (`"stop"` or `"length"`).
#[pyclass(module = "rolloutpipe", frozen)]
pub struct Finished {
    /// The caller's request key.
    #[pyo3(get)]
    pub key: u64,
    /// Generated token ids.
    #[pyo3(get)]
    pub tokens: Vec<u32>,
    /// Log-prob of each generated token under the sampling distribution.
    #[pyo3(get)]
    pub logprobs: Vec<f32>,
    /// `"stop"` or `"length"`.
    #[pyo3(get)]
    pub finish: &'static str,
}

/// The CPU reference policy: loads an HF model directory (config.json + model.safetensors,
/// Qwen3 names) and serves as a continuous-batching engine and a GRPO/AdamW trainer.
#[pyclass(module = "rolloutpipe")]
pub struct CpuPolicy {
    inner: Mutex<CpuBackend>,
    finished: Mutex<Vec<Finished>>,
}

impl CpuPolicy {
    fn with<R>(&self, py: Python<'_>, f: impl FnOnce(&mut CpuBackend) -> R + Send) -> PyResult<R>
    where
        R: Send,
    {
        py.detach(|| {
            let mut b = self.inner.lock().map_err(|_| {
                PyRuntimeError::new_err("the backend panicked earlier; recreate it")
            })?;
            Ok(f(&mut b))
        })
    }
}

#[pymethods]
impl CpuPolicy {
    /// Loads `model_dir` (raises `BackendError` naming what does not load) with a pool of
    /// `threads` CPU threads.
    #[new]
    #[pyo3(signature = (model_dir, threads = 1))]
    fn new(py: Python<'_>, model_dir: PathBuf, threads: usize) -> PyResult<Self> {
        let b = py
            .detach(|| {
                let (cfg, w) = load_model_dir(&model_dir)?;
                CpuBackend::new(&cfg, &w, threads.max(1))
            })
            .map_err(backend_err)?;
        Ok(CpuPolicy {
            inner: Mutex::new(b),
            finished: Mutex::new(Vec::new()),
        })
    }

    /// The model's vocabulary size.
    #[getter]
    fn vocab_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |b| b.config().vocab_size)
    }

    /// Adds one request to the continuous batch (raises `BackendError` if it does not fit).
    #[pyo3(signature = (key, prompt, *, max_new_tokens = 16, temperature = 1.0, top_k = 0, top_p = 1.0, seed = 0, stop_tokens = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        py: Python<'_>,
        key: u64,
        prompt: Vec<u32>,
        max_new_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
        stop_tokens: Vec<u32>,
    ) -> PyResult<()> {
        let req = GenRequest {
            id: RequestKey(key),
            prompt,
            params: SamplingParams {
                temperature,
                top_k,
                top_p,
                max_new_tokens,
                stop_tokens,
                seed,
            },
        };
        self.with(py, |b| b.add_request(req))?.map_err(backend_err)
    }

    /// Cancels a request (its partial response is dropped).
    fn cancel_request(&self, py: Python<'_>, key: u64) -> PyResult<()> {
        self.with(py, |b| b.cancel_request(RequestKey(key)))?
            .map_err(backend_err)
    }

    /// Requests admitted and not yet finished or cancelled.
    #[getter]
    fn active_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |b| b.active_requests())
    }

    /// One decode step of every active request (GIL released); returns how many finished.
    fn step(&self, py: Python<'_>) -> PyResult<usize> {
        let outs = self.with(py, |b| b.decode_step())?.map_err(backend_err)?;
        let n = outs.len();
        let mut done = self
            .finished
            .lock()
            .map_err(|_| PyRuntimeError::new_err("poisoned"))?;
        done.extend(outs.into_iter().map(|o| Finished {
            key: o.id.0,
            tokens: o.tokens,
            logprobs: o.logprobs,
            finish: match o.finish {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            },
        }));
        Ok(n)
    }

    /// The responses finished since the last call, in finishing order.
    fn take_finished(&self) -> PyResult<Vec<Finished>> {
        let mut done = self
            .finished
            .lock()
            .map_err(|_| PyRuntimeError::new_err("poisoned"))?;
        Ok(std::mem::take(&mut *done))
    }

    /// Per-token log-probs of each `(prompt, response)` pair under the current weights.
    #[pyo3(signature = (pairs, temperature = 1.0))]
    fn logprobs(
        &self,
        py: Python<'_>,
        pairs: Vec<(Vec<u32>, Vec<u32>)>,
        temperature: f32,
    ) -> PyResult<Vec<Vec<f32>>> {
        let seqs: Vec<Sequence> = pairs
            .into_iter()
            .map(|(prompt, response)| Sequence { prompt, response })
            .collect();
        self.with(py, |b| b.logprobs(&seqs, temperature))?
            .map_err(backend_err)
    }

    /// Clears the gradient sums.
    fn zero_grad(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |b| b.zero_grad())?.map_err(backend_err)
    }

    /// Adds the unnormalised GRPO gradient of a micro-batch of `(prompt, response, advantage)`
    /// (token-mean weights; clip `eps`, no KL) to the sums; returns the summed loss.
    #[pyo3(signature = (sequences, eps = 0.2))]
    fn accumulate(
        &self,
        py: Python<'_>,
        sequences: Vec<(Vec<u32>, Vec<u32>, f64)>,
        eps: f64,
    ) -> PyResult<f64> {
        let batch = TrainBatch {
            sequences: sequences
                .into_iter()
                .map(|(p, r, a)| TrainSequence::new(p, r, a, Aggregation::TokenMean))
                .collect(),
        };
        let obj = Objective::Grpo {
            eps_low: eps,
            eps_high: eps,
            beta: 0.0,
            temperature: 1.0,
        };
        let stats = self
            .with(py, |b| b.accumulate(&batch, &obj))?
            .map_err(backend_err)?;
        Ok(stats.loss_sum)
    }

    /// Divides the sums by `normalizer` (e.g. the optimizer step's response tokens), clips to
    /// `max_grad_norm`, applies AdamW; returns the pre-clip gradient norm.
    #[pyo3(signature = (normalizer, lr = 1e-3, weight_decay = 0.0, max_grad_norm = 1.0))]
    fn optimizer_step(
        &self,
        py: Python<'_>,
        normalizer: f64,
        lr: f64,
        weight_decay: f64,
        max_grad_norm: f64,
    ) -> PyResult<f64> {
        let opt = AdamW {
            lr,
            weight_decay,
            max_grad_norm: Some(max_grad_norm),
            ..AdamW::default()
        };
        opt.validate().map_err(backend_err)?;
        let stats = self
            .with(py, |b| b.optimizer_step(normalizer, &opt))?
            .map_err(backend_err)?;
        Ok(stats.grad_norm)
    }

    /// The f32 weights as safetensors bytes (HF tensor names): what crosses a process boundary
    /// at weight sync.
    fn export_weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .with(py, |b| -> rolloutpipe_backends::Result<Vec<u8>> {
                b.export_weights()?.to_safetensors_bytes()
            })?
            .map_err(backend_err)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Loads safetensors bytes from `export_weights` into both roles (trainer master weights and
    /// engine weights); refused (`BackendError`) while requests are active or when a tensor is
    /// missing or misshaped.
    fn import_weights(&self, py: Python<'_>, data: Vec<u8>) -> PyResult<()> {
        self.with(py, |b| -> rolloutpipe_backends::Result<()> {
            // The CPU backend generates and trains with one set of parameters, so importing
            // the master weights also updates the engine.
            let w = Weights::from_safetensors_bytes(&data, "import_weights bytes")?;
            b.import_weights(&w)
        })?
        .map_err(backend_err)
    }
}

/// Writes a seeded random tiny Qwen3 model (vocab 11) as an HF directory, for tests and
/// examples. Refuses a directory that already holds a config.json unless `overwrite`.
#[pyfunction]
#[pyo3(signature = (path, seed = 0, overwrite = false))]
pub fn write_tiny_model(py: Python<'_>, path: PathBuf, seed: u64, overwrite: bool) -> PyResult<()> {
    if path.join("config.json").exists() && !overwrite {
        return Err(PyFileExistsError::new_err(format!(
            "{} already holds a model; pass overwrite=True to replace it",
            path.display()
        )));
    }
    py.detach(|| {
        let cfg = ModelConfig::tiny();
        let w = Weights::random(&cfg, seed)?;
        save_model_dir(&path, &cfg, &w)
    })
    .map_err(backend_err)
}
