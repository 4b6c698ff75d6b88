//! The per-step plan and the policies, as Python classes. Policy enums are strings
//! (`admission="frontier"`, `dispatch="sync"`, …), the same choices as the C header's codes.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rolloutpipe_core as rc;
use rolloutpipe_core::{AdmissionPolicy, DispatchPolicy, MicroBatchUnit, SubmitOrder};

use crate::errors::{AllocParamError, PlanError, raise};

/// A step's plan: B groups of G samples, micro-batch m, k_opt optimizer steps, slots, and the
/// admission (`"fifo"` / `"frontier"`), order (`"group_major"` / `"interleaved"` /
/// `"shuffled"` with `order_seed`) and dispatch (`"pipelined"` / `"sync"`) policies.
/// Unspecified fields take the core's defaults (`max_groups = 2B`, `draw_batch = B`, …).
#[pyclass(module = "rolloutpipe", get_all, set_all)]
#[derive(Clone)]
pub struct Plan {
    /// B: trainable groups the step trains on.
    pub batch_groups: u32,
    /// G: initial samples per group.
    pub group_size: u16,
    /// m: micro-batch size in `micro_batch_unit`s.
    pub micro_batch: u32,
    /// `"groups"`, `"samples"` or `"tokens"`.
    pub micro_batch_unit: String,
    /// k_opt: optimizer steps per rollout.
    pub opt_steps: u32,
    /// Rollout slots (engine capacity).
    pub slots: u32,
    /// Attempts per request before its group is filtered.
    pub max_attempts: u8,
    /// Most prompts the step may draw.
    pub max_groups: u32,
    /// Prompts per draw.
    pub draw_batch: u32,
    /// Extra prompts kept drawn ahead of need.
    pub draw_ahead: u32,
    /// `"fifo"` or `"frontier"`.
    pub admission: String,
    /// FIFO order (or the frontier's fallback): `"group_major"`, `"interleaved"`, `"shuffled"`.
    pub order: String,
    /// Seed of the `"shuffled"` order.
    pub order_seed: u64,
    /// Frontier: extra groups beyond the needed count.
    pub frontier_width: u32,
    /// Frontier: expected filter share, parts per million (< 1e6).
    pub frontier_filter_ppm: u32,
    /// `"pipelined"` or `"sync"`.
    pub dispatch: String,
    /// Hold scored groups for `poll_allocation`.
    pub hold_scored: bool,
    /// Samples the step may create (0: unlimited).
    pub sample_budget: u32,
    /// Budget samples reserved for each drawn group's commit until it is decided
    /// (Pilot-Commit's `n_commit`, set by `PilotCommit.configure`; 0: none).
    pub commit_reserve: u16,
}

#[pymethods]
impl Plan {
    #[new]
    #[pyo3(signature = (batch_groups, group_size, **kwargs))]
    fn py_new(
        batch_groups: u32,
        group_size: u16,
        kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<Self> {
        let mut p: Plan = (&rc::Plan::new(batch_groups, group_size)).into();
        if let Some(kw) = kwargs {
            let py = kw.py();
            let me = Bound::new(py, p)?;
            for (k, v) in kw.iter() {
                let name: String = k.extract()?;
                if !FIELDS.contains(&name.as_str()) {
                    return Err(PyValueError::new_err(format!("Plan has no field {name:?}")));
                }
                me.setattr(name.as_str(), v)?;
            }
            p = me.borrow().clone();
        }
        Ok(p)
    }

    /// Raises `PlanError` (with the core's message) if the plan is inconsistent, or
    /// `ValueError` naming a field whose policy string is unknown.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.to_core()?
            .validate()
            .map_err(|e| raise::<PlanError>(py, e))
    }

    /// Groups per optimizer step, `B / k_opt`.
    fn groups_per_opt_step(&self) -> PyResult<u32> {
        Ok(self.to_core()?.groups_per_opt_step())
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(batch_groups={}, group_size={}, micro_batch={}, opt_steps={}, slots={}, admission={:?}, dispatch={:?})",
            self.batch_groups,
            self.group_size,
            self.micro_batch,
            self.opt_steps,
            self.slots,
            self.admission,
            self.dispatch
        )
    }
}

const FIELDS: &[&str] = &[
    "batch_groups",
    "group_size",
    "micro_batch",
    "micro_batch_unit",
    "opt_steps",
    "slots",
    "max_attempts",
    "max_groups",
    "draw_batch",
    "draw_ahead",
    "admission",
    "order",
    "order_seed",
    "frontier_width",
    "frontier_filter_ppm",
    "dispatch",
    "hold_scored",
    "sample_budget",
    "commit_reserve",
];

fn bad(field: &str, value: &str, choices: &str) -> PyErr {
    PyValueError::new_err(format!(
        "Plan.{field}: unknown value {value:?} (one of {choices})"
    ))
}

impl Plan {
    /// The core plan; a `ValueError` names a field with an unknown policy string.
    pub fn to_core(&self) -> PyResult<rc::Plan> {
        let order = match self.order.as_str() {
            "group_major" => SubmitOrder::GroupMajor,
            "interleaved" => SubmitOrder::Interleaved,
            "shuffled" => SubmitOrder::Shuffled {
                seed: self.order_seed,
            },
            o => return Err(bad("order", o, "group_major, interleaved, shuffled")),
        };
        let mut p = rc::Plan::new(self.batch_groups, self.group_size);
        p.micro_batch = self.micro_batch;
        p.micro_batch_unit = match self.micro_batch_unit.as_str() {
            "groups" => MicroBatchUnit::Groups,
            "samples" => MicroBatchUnit::Samples,
            "tokens" => MicroBatchUnit::Tokens,
            u => return Err(bad("micro_batch_unit", u, "groups, samples, tokens")),
        };
        p.opt_steps = self.opt_steps;
        p.slots = self.slots;
        p.max_attempts = self.max_attempts;
        p.max_groups = self.max_groups;
        p.draw_batch = self.draw_batch;
        p.draw_ahead = self.draw_ahead;
        p.admission = match self.admission.as_str() {
            "fifo" => AdmissionPolicy::Fifo { order },
            "frontier" => AdmissionPolicy::Frontier {
                width: self.frontier_width,
                expected_filter_ppm: self.frontier_filter_ppm,
                fallback: order,
            },
            a => return Err(bad("admission", a, "fifo, frontier")),
        };
        p.dispatch = match self.dispatch.as_str() {
            "pipelined" => DispatchPolicy::Pipelined,
            "sync" => DispatchPolicy::Sync,
            d => return Err(bad("dispatch", d, "pipelined, sync")),
        };
        p.hold_scored = self.hold_scored;
        p.sample_budget = self.sample_budget;
        p.commit_reserve = self.commit_reserve;
        Ok(p)
    }
}

impl From<&rc::Plan> for Plan {
    fn from(p: &rc::Plan) -> Self {
        let (admission, order, width, ppm) = match p.admission {
            AdmissionPolicy::Frontier {
                width,
                expected_filter_ppm,
                fallback,
            } => ("frontier", fallback, width, expected_filter_ppm),
            AdmissionPolicy::Fifo { order } => ("fifo", order, 0, 0),
            _ => ("fifo", SubmitOrder::GroupMajor, 0, 0),
        };
        let (order, order_seed) = match order {
            SubmitOrder::Interleaved => ("interleaved", 0),
            SubmitOrder::Shuffled { seed } => ("shuffled", seed),
            _ => ("group_major", 0),
        };
        Plan {
            batch_groups: p.batch_groups,
            group_size: p.group_size,
            micro_batch: p.micro_batch,
            micro_batch_unit: match p.micro_batch_unit {
                MicroBatchUnit::Samples => "samples",
                MicroBatchUnit::Tokens => "tokens",
                _ => "groups",
            }
            .into(),
            opt_steps: p.opt_steps,
            slots: p.slots,
            max_attempts: p.max_attempts,
            max_groups: p.max_groups,
            draw_batch: p.draw_batch,
            draw_ahead: p.draw_ahead,
            admission: admission.into(),
            order: order.into(),
            order_seed,
            frontier_width: width,
            frontier_filter_ppm: ppm,
            dispatch: match p.dispatch {
                DispatchPolicy::Sync => "sync",
                _ => "pipelined",
            }
            .into(),
            hold_scored: p.hold_scored,
            sample_budget: p.sample_budget,
            commit_reserve: p.commit_reserve,
        }
    }
}

/// GRPO's fixed G: every held group is committed as drawn (the default allocation policy).
#[pyclass(module = "rolloutpipe", frozen)]
#[derive(Clone, Copy)]
pub struct FixedG;

#[pymethods]
impl FixedG {
    #[new]
    fn new() -> Self {
        FixedG
    }
}

/// VIGOR: `n0` initial samples per prompt, up to `rounds` extra rounds of `increment` samples
/// for the highest-variance groups, within a step `budget` of samples.
#[pyclass(module = "rolloutpipe", frozen)]
#[derive(Clone, Copy)]
pub struct Vigor(pub rc::Vigor);

#[pymethods]
impl Vigor {
    #[new]
    fn new(
        py: Python<'_>,
        n0: u16,
        rounds: u16,
        increment: u16,
        budget: u32,
        batch_groups: u32,
    ) -> PyResult<Self> {
        rc::Vigor::new(n0, rounds, increment, budget, batch_groups)
            .map(Vigor)
            .map_err(|e| raise::<AllocParamError>(py, e))
    }
    /// Sets the plan fields the policy relies on (G = n0, the budget, the hold).
    fn configure(&self, plan: &mut Plan) -> PyResult<()> {
        let mut p = plan.to_core()?;
        self.0.configure(&mut p);
        *plan = (&p).into();
        Ok(())
    }
    /// Groups extended per round.
    fn per_round_groups(&self) -> u32 {
        self.0.per_round_groups()
    }
}

/// Pilot-Commit: `n_pilot` pilot samples, then `n_commit` more for a pilot whose mean reward
/// lies in `[lower, 1 - upper]`; skip it as too easy, solved, or too hard otherwise.
#[pyclass(module = "rolloutpipe", frozen)]
#[derive(Clone, Copy)]
pub struct PilotCommit(pub rc::PilotCommit);

#[pymethods]
impl PilotCommit {
    #[new]
    #[pyo3(signature = (n_pilot, n_commit, lower = 0.125, upper = 0.25))]
    fn new(py: Python<'_>, n_pilot: u16, n_commit: u16, lower: f32, upper: f32) -> PyResult<Self> {
        rc::PilotCommit::new(n_pilot, n_commit, lower, upper)
            .map(PilotCommit)
            .map_err(|e| raise::<AllocParamError>(py, e))
    }
    /// Sets the plan fields the policy relies on (G = n_pilot, the hold, the commit reserve).
    fn configure(&self, plan: &mut Plan) -> PyResult<()> {
        let mut p = plan.to_core()?;
        self.0.configure(&mut p);
        *plan = (&p).into();
        Ok(())
    }
    /// The verdict on a pilot with mean reward `p`: `("extend", n)`, `("skip", reason)` or
    /// `("commit", 0)`.
    fn verdict(&self, p: f64) -> (String, String) {
        match self.0.verdict(p) {
            rc::Allocation::Extend(n) => ("extend".into(), n.to_string()),
            rc::Allocation::Skip(r) => ("skip".into(), r.to_string()),
            _ => ("commit".into(), "0".into()),
        }
    }
}
