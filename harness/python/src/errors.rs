//! Each core error is its own Python exception class (all subclasses of `RolloutPipeError`),
//! raised with the core's one-line message; `kind` names the variant (`"StaleAttempt"`, …).

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    rolloutpipe,
    RolloutPipeError,
    PyException,
    "Base class of every RolloutPipe error."
);
create_exception!(
    rolloutpipe,
    BeginError,
    RolloutPipeError,
    "`begin_step` refused: a step in progress or a stale step id."
);
create_exception!(
    rolloutpipe,
    PlanError,
    BeginError,
    "The plan is inconsistent or does not fit the storage."
);
create_exception!(
    rolloutpipe,
    DrawError,
    RolloutPipeError,
    "A draw was refused."
);
create_exception!(
    rolloutpipe,
    RequestError,
    RolloutPipeError,
    "A request event was refused (unknown, stale, duplicate, wrong version, other step)."
);
create_exception!(
    rolloutpipe,
    TrainError,
    RolloutPipeError,
    "A trainer event was refused."
);
create_exception!(
    rolloutpipe,
    ExtendError,
    RolloutPipeError,
    "`extend_group` refused."
);
create_exception!(
    rolloutpipe,
    SlotsError,
    RolloutPipeError,
    "`set_slots` refused."
);
create_exception!(
    rolloutpipe,
    AuditError,
    RolloutPipeError,
    "`audit()` found a broken invariant."
);
create_exception!(
    rolloutpipe,
    BackendError,
    RolloutPipeError,
    "A backend refused: a model directory that does not load, a bad request or batch, an unsupported call."
);
create_exception!(
    rolloutpipe,
    AllocParamError,
    RolloutPipeError,
    "An allocation policy's parameters are invalid."
);

create_exception!(
    rolloutpipe,
    WireError,
    RolloutPipeError,
    "A host was sent a message it cannot read (malformed frame or header, missing part, or a command before Init)."
);
create_exception!(
    rolloutpipe,
    RunError,
    RolloutPipeError,
    "A training run (`train`) stopped with an error; the message carries its cause."
);

/// The variant's name from its `Debug` form (`StaleAttempt { .. }` -> `StaleAttempt`).
fn kind_of(debug: &str) -> &str {
    debug
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .unwrap_or(debug)
}

/// Builds exception `E` with the error's message and its `kind` attribute.
pub fn raise<E: pyo3::PyTypeInfo>(
    py: Python<'_>,
    e: impl std::fmt::Display + std::fmt::Debug,
) -> PyErr {
    raise_as::<E>(py, e.to_string(), &format!("{e:?}"))
}

fn raise_as<E: pyo3::PyTypeInfo>(py: Python<'_>, message: String, debug: &str) -> PyErr {
    let err = PyErr::from_type(py.get_type::<E>(), message);
    // Only fails if the exception object refuses attributes, which ours never do.
    let _ = err.value(py).setattr("kind", kind_of(debug));
    err
}

/// A `BeginError`, or its subclass `PlanError` for an invalid plan.
pub fn begin_error(py: Python<'_>, e: rolloutpipe_core::BeginError) -> PyErr {
    match e {
        rolloutpipe_core::BeginError::Plan(p) => {
            raise_as::<PlanError>(py, e.to_string(), &format!("{p:?}"))
        }
        other => raise::<BeginError>(py, other),
    }
}

/// Registers the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RolloutPipeError", py.get_type::<RolloutPipeError>())?;
    m.add("BeginError", py.get_type::<BeginError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("DrawError", py.get_type::<DrawError>())?;
    m.add("RequestError", py.get_type::<RequestError>())?;
    m.add("TrainError", py.get_type::<TrainError>())?;
    m.add("ExtendError", py.get_type::<ExtendError>())?;
    m.add("SlotsError", py.get_type::<SlotsError>())?;
    m.add("AuditError", py.get_type::<AuditError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add("AllocParamError", py.get_type::<AllocParamError>())?;
    m.add("WireError", py.get_type::<WireError>())?;
    m.add("RunError", py.get_type::<RunError>())?;
    Ok(())
}
