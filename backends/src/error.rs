//! The one error type of the policy backends.
//!
//! Every public entry point validates its input and answers with one of these variants instead of
//! panicking; each variant names what was wrong so that a caller (or a user reading a CLI message)
//! can fix it without reading the code.

use std::path::PathBuf;

use crate::seam::{Rejected, RequestKey};

/// Errors of the policy backends.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A tensor, sequence or per-token array has the wrong shape or length.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    Shape {
        /// What was being checked (tensor name, argument).
        what: String,
        /// The expected shape or length.
        expected: String,
        /// The shape or length that was given.
        got: String,
    },
    /// A token id is not below the model's vocabulary size.
    #[error("token id {id} in {what} is out of range for vocab size {vocab}")]
    UnknownToken {
        /// The offending id.
        id: u32,
        /// The vocabulary size of the model.
        vocab: usize,
        /// Where the id was found.
        what: String,
    },
    /// A model configuration field is missing or invalid.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The field of config.json.
        field: String,
        /// Why it is not accepted.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("i/o on {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error, printed in the message (not a `source()`, so that a caller
        /// printing the error chain does not repeat it).
        error: std::io::Error,
    },
    /// A safetensors file could not be parsed or written, or holds an unsupported dtype.
    #[error("safetensors {what}: {reason}")]
    Safetensors {
        /// The file or tensor.
        what: String,
        /// The reason.
        reason: String,
    },
    /// A checkpoint lacks a tensor the configuration requires.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A checkpoint holds a tensor the configuration does not use.
    #[error("unexpected tensor `{0}` (not a parameter of this configuration)")]
    UnexpectedTensor(String),
    /// A value that must be finite (reward, advantage, log-prob, weight, gradient) is NaN or infinite.
    #[error("non-finite value in {what}")]
    NonFinite {
        /// Where the value was found.
        what: String,
    },
    /// A batch, group, prompt or response is empty where at least one element is needed.
    #[error("empty input: {0}")]
    EmptyBatch(String),
    /// A request id that the engine does not know (never added, finished or cancelled).
    #[error("unknown request {0}")]
    UnknownRequest(RequestKey),
    /// A request id that is already active.
    #[error("request {0} is already active")]
    DuplicateRequest(RequestKey),
    /// An argument outside its domain (temperature, top-p, learning rate, normaliser...).
    #[error("invalid argument {what}: {reason}")]
    InvalidArgument {
        /// The argument.
        what: String,
        /// Why it is not accepted.
        reason: String,
    },
    /// The engine is at its limits; the submission is handed back to be retried later
    /// (back-pressure, not a failure).
    #[error("engine full: {reason}")]
    EngineFull {
        /// What did not fit.
        reason: String,
        /// The request or group that was not admitted.
        rejected: Box<Rejected>,
    },
    /// The call needs the engine idle, but a decode step is in flight (poll it first).
    #[error("{0}: a decode step is in flight; poll it first")]
    StepInFlight(&'static str),
    /// A device (GPU) failure.
    #[error("device: {0}")]
    Device(String),
    /// An optional capability this backend does not have (e.g. long-tail migration's
    /// export and resume on the wgpu and CUDA engines).
    #[error("{what} is not supported by the {backend} engine")]
    Unsupported {
        /// The call.
        what: &'static str,
        /// The backend's name.
        backend: &'static str,
    },
}

impl BackendError {
    /// The submission a full engine handed back, if this is [`BackendError::EngineFull`].
    pub fn into_rejected(self) -> std::result::Result<Rejected, Self> {
        match self {
            Self::EngineFull { rejected, .. } => Ok(*rejected),
            e => Err(e),
        }
    }
}

/// Result of the backend crate.
pub type Result<T> = std::result::Result<T, BackendError>;

impl BackendError {
    /// Shorthand for [`BackendError::Shape`].
    pub fn shape(what: impl Into<String>, expected: impl ToString, got: impl ToString) -> Self {
        Self::Shape {
            what: what.into(),
            expected: expected.to_string(),
            got: got.to_string(),
        }
    }

    /// Shorthand for [`BackendError::InvalidArgument`].
    pub fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`BackendError::Config`].
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// Shorthand for [`BackendError::NonFinite`].
    pub fn non_finite(what: impl Into<String>) -> Self {
        Self::NonFinite { what: what.into() }
    }
}
