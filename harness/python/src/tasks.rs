//! The built-in tasks' problem generators and verifiers (`add`, `mul`, `countdown`): the same
//! code the `rolloutpipe train` verifier workers run, so a Python deployment scores responses
//! exactly as the in-process run does.

use pyo3::create_exception;
use pyo3::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rolloutpipe_harness::tasks::{self, TaskOptions, Verdict};

use crate::errors::RolloutPipeError;

create_exception!(
    rolloutpipe,
    TaskError,
    RolloutPipeError,
    "A task refused: an unknown name, a bad option or a malformed problem."
);

/// One problem: the prompt text, the reference answer, and task metadata (JSON text).
#[pyclass(module = "rolloutpipe", frozen)]
#[derive(Clone)]
pub struct Problem {
    /// The prompt shown to the policy.
    #[pyo3(get)]
    pub prompt: String,
    /// The reference answer.
    #[pyo3(get)]
    pub answer: String,
    /// Task metadata as JSON text (`countdown`: its numbers and target).
    #[pyo3(get)]
    pub meta: String,
}

#[pymethods]
impl Problem {
    #[new]
    #[pyo3(signature = (prompt, answer, meta = "null".to_string()))]
    fn new(prompt: String, answer: String, meta: String) -> Self {
        Problem {
            prompt,
            answer,
            meta,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "Problem(prompt={:?}, answer={:?})",
            self.prompt, self.answer
        )
    }
}

impl Problem {
    fn core(&self) -> PyResult<tasks::Problem> {
        let meta = serde_json::from_str(&self.meta)
            .map_err(|e| TaskError::new_err(format!("Problem.meta is not JSON: {e}")))?;
        Ok(tasks::Problem {
            prompt: self.prompt.clone(),
            answer: self.answer.clone(),
            meta,
        })
    }
}

/// A built-in task by name (`"add"`, `"mul"`, `"countdown"`), with its difficulty options.
#[pyclass(module = "rolloutpipe", frozen)]
pub struct Task(Box<dyn tasks::Task>);

#[pymethods]
impl Task {
    #[new]
    #[pyo3(signature = (name, *, digits = None, numbers = None, format_penalty = None, reverse = None, uniform_operands = None))]
    fn new(
        name: &str,
        digits: Option<u32>,
        numbers: Option<usize>,
        format_penalty: Option<f32>,
        reverse: Option<bool>,
        uniform_operands: Option<bool>,
    ) -> PyResult<Self> {
        let opts = TaskOptions {
            digits,
            numbers,
            format_penalty,
            reverse,
            uniform_operands,
            ..TaskOptions::default()
        };
        tasks::task_by_name(name, &opts)
            .map(Task)
            .map_err(|e| TaskError::new_err(e.to_string()))
    }

    /// The task's name.
    #[getter]
    fn name(&self) -> String {
        self.0.name().to_string()
    }

    /// `n` problems drawn with a seeded generator (the same seed gives the same problems).
    fn sample(&self, seed: u64, n: usize) -> Vec<Problem> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let p = self.0.sample(&mut rng);
                Problem {
                    prompt: p.prompt,
                    answer: p.answer,
                    meta: p.meta.to_string(),
                }
            })
            .collect()
    }

    /// The verdict on a response: `("correct", None)`, `("incorrect", why)` or
    /// `("malformed", why)`.
    fn verify(
        &self,
        problem: &Problem,
        response: &str,
    ) -> PyResult<(&'static str, Option<String>)> {
        Ok(match self.0.verify(&problem.core()?, response) {
            Verdict::Correct => ("correct", None),
            Verdict::Incorrect(why) => ("incorrect", Some(why)),
            Verdict::Malformed(why) => ("malformed", Some(why)),
        })
    }

    /// The reward the training run uses: 1 correct, 0 incorrect, `-format_penalty` malformed.
    fn reward(&self, problem: &Problem, response: &str) -> PyResult<f32> {
        Ok(self.0.reward(&problem.core()?, response))
    }
}
