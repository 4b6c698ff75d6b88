//! The `rolloutpipe._core` extension module: RolloutPipe's scheduling core for Python (the
//! package `rolloutpipe` re-exports it). Values are small frozen classes, policies are strings
//! or policy objects, and every core error is its own exception class.

use pyo3::prelude::*;

mod backend;
mod errors;
mod plan;
mod run;
mod sched;
mod tasks;
mod values;

/// The module: classes, exceptions, and `ABI_VERSION` (the C ABI's, for cross-checks).
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<sched::Scheduler>()?;
    m.add_class::<plan::Plan>()?;
    m.add_class::<plan::FixedG>()?;
    m.add_class::<plan::Vigor>()?;
    m.add_class::<plan::PilotCommit>()?;
    m.add_class::<values::RequestId>()?;
    m.add_class::<values::Admission>()?;
    m.add_class::<values::Dispatch>()?;
    m.add_class::<values::MicroBatch>()?;
    m.add_class::<values::Completion>()?;
    m.add_class::<values::Failure>()?;
    m.add_class::<values::Allocated>()?;
    m.add_class::<values::Counters>()?;
    m.add_class::<values::StepSummary>()?;
    m.add_class::<values::GroupInfo>()?;
    m.add_class::<backend::CpuPolicy>()?;
    m.add_class::<backend::Finished>()?;
    m.add_function(wrap_pyfunction!(backend::write_tiny_model, m)?)?;
    m.add_class::<tasks::Task>()?;
    m.add_class::<tasks::Problem>()?;
    m.add("TaskError", m.py().get_type::<tasks::TaskError>())?;
    m.add_class::<run::EngineHost>()?;
    m.add_class::<run::TrainerHost>()?;
    m.add_class::<run::VerifierHost>()?;
    m.add_function(wrap_pyfunction!(run::train, m)?)?;
    m.add_function(wrap_pyfunction!(run::resolve_config, m)?)?;
    errors::register(m)?;
    m.add("ABI_VERSION", rolloutpipe_capi::RP_ABI_VERSION)?;
    Ok(())
}
