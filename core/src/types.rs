//! Plain value types shared by events and decisions: ids, time, the per-step plan and its
//! policies. Everything here is `Copy` and validated once, when a step begins.

use core::fmt;

/// A point in time, in caller-defined units (ns, µs, simulator ticks).
///
/// The core never reads a clock: every event and poll takes `now`, and the core only stores it
/// in step summaries and group records.
///
/// ```
/// use rolloutpipe_core::Tick;
/// assert!(Tick(5) < Tick(7));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Tick(pub u64);

/// Identifies one RL step (iteration). Steps must increase from one `begin_step` to the next.
///
/// ```
/// use rolloutpipe_core::StepId;
/// assert_eq!(StepId(3).to_string(), "step 3");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct StepId(pub u64);

/// The policy (weights) version a step's rollout uses. A completion carrying another version is
/// rejected (on-policy guard).
///
/// ```
/// use rolloutpipe_core::PolicyVersion;
/// assert_eq!(PolicyVersion(2).to_string(), "v2");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PolicyVersion(pub u64);

/// A group (one prompt and its samples), numbered in draw order within the step from 0.
///
/// ```
/// use rolloutpipe_core::GroupId;
/// assert_eq!(GroupId(0).to_string(), "g0");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct GroupId(pub u32);

/// A rollout engine, for callers that track which engine runs a request (the core does not).
///
/// ```
/// use rolloutpipe_core::EngineId;
/// assert_eq!(EngineId(1).0, 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct EngineId(pub u16);

/// One generation attempt of one sample of one group in one step.
///
/// The step is part of the id so that a late completion from an earlier step can never be taken
/// for a request of the current one, whatever the policy versions are.
///
/// ```
/// use rolloutpipe_core::{GroupId, RequestId, StepId};
/// let r = RequestId { step: StepId(1), group: GroupId(4), sample: 2, attempt: 0 };
/// assert_eq!(r.to_string(), "step 1/g4/s2/a0");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct RequestId {
    /// The step the request belongs to.
    pub step: StepId,
    /// The group (prompt) it samples.
    pub group: GroupId,
    /// The sample index within the group, `0..target`.
    pub sample: u16,
    /// 0 for the first try, +1 per re-admission after a failure.
    pub attempt: u8,
}

/// A pending request as an admission policy sees it: which sample of which group.
///
/// ```
/// use rolloutpipe_core::{GroupId, RequestRef};
/// let r = RequestRef { group: GroupId(1), sample: 0 };
/// assert_eq!(r.group, GroupId(1));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct RequestRef {
    /// The group.
    pub group: GroupId,
    /// The sample index within the group.
    pub sample: u16,
}

impl fmt::Display for StepId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}", self.0)
    }
}
impl fmt::Display for PolicyVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}
impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}
impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/s{}/a{}",
            self.step, self.group, self.sample, self.attempt
        )
    }
}

/// The order in which the requests of a freshly drawn batch of prompts enter the engine's FIFO
/// waiting queue.
///
/// Slime launches one `generate` coroutine per sample, group by group; SGLang serves its waiting
/// queue first come, first served. What reaches the queue depends on how those coroutines
/// interleave, so the three orders bracket the baseline's behaviour.
///
/// ```
/// use rolloutpipe_core::SubmitOrder;
/// assert_ne!(SubmitOrder::GroupMajor, SubmitOrder::Interleaved);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum SubmitOrder {
    /// All samples of group 0, then all of group 1, … (draw order, then sample order).
    #[default]
    GroupMajor,
    /// Sample-major within each draw batch: sample 0 of every group, then sample 1, …
    Interleaved,
    /// A seeded uniform permutation of each draw batch's requests.
    Shuffled {
        /// Seed of the permutation; mixed with the step id and the batch's first group.
        seed: u64,
    },
}

/// Which pending request takes a free rollout slot.
///
/// ```
/// use rolloutpipe_core::{AdmissionPolicy, SubmitOrder};
/// let fgd = AdmissionPolicy::Frontier { width: 2, expected_filter_ppm: 250_000, fallback: SubmitOrder::Interleaved };
/// assert!(matches!(fgd, AdmissionPolicy::Frontier { .. }));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum AdmissionPolicy {
    /// One FIFO queue in submission order (Slime + SGLang). Retries go to the back.
    Fifo {
        /// How a draw batch's requests enter the queue.
        order: SubmitOrder,
    },
    /// Frontier-group dispatch (FGD): a pending request of a frontier group first (earliest group
    /// in draw order, lowest sample index); otherwise the head of the same FIFO queue that `Fifo`
    /// would use, built in `fallback` order.
    ///
    /// The frontier is the fewest incomplete, unfiltered groups in draw order whose completion
    /// fills the trainer's next micro-batch (counting complete-but-undispatched groups), divided by
    /// the expected keep rate `1 - expected_filter_ppm / 1e6` (rounded up), plus `width` groups.
    ///
    /// Why the fallback is the FIFO queue and not "draw order": with a draw-order fallback, the
    /// first pending group in draw order is always a frontier group whenever one has work, so FGD
    /// would degenerate into group-major FIFO whatever the width. Keeping the engine's own queue
    /// for non-frontier work makes FGD an override on top of the baseline's order; with
    /// `fallback: GroupMajor` it is exactly the draw-order rule.
    Frontier {
        /// Extra groups beyond the needed count.
        width: u32,
        /// Expected share of complete groups that get filtered, in parts per million (< 1e6).
        expected_filter_ppm: u32,
        /// Queue order for requests outside the frontier.
        fallback: SubmitOrder,
    },
}

impl AdmissionPolicy {
    /// The order in which drawn requests enter the FIFO queue under this policy.
    ///
    /// ```
    /// use rolloutpipe_core::{AdmissionPolicy, SubmitOrder};
    /// let p = AdmissionPolicy::Fifo { order: SubmitOrder::Interleaved };
    /// assert_eq!(p.submit_order(), SubmitOrder::Interleaved);
    /// ```
    pub const fn submit_order(&self) -> SubmitOrder {
        match *self {
            AdmissionPolicy::Fifo { order } => order,
            AdmissionPolicy::Frontier { fallback, .. } => fallback,
        }
    }
}

/// When complete trainable groups are handed to the trainer.
///
/// ```
/// use rolloutpipe_core::DispatchPolicy;
/// assert_ne!(DispatchPolicy::Pipelined, DispatchPolicy::Sync);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum DispatchPolicy {
    /// Complete-group pipelining (CGP): each trainable group goes to the trainer FIFO the moment
    /// it is materialized; a micro-batch is ready when `micro_batch` groups are queued.
    #[default]
    Pipelined,
    /// The Slime baseline: nothing is released until the batch is final (B trainable groups, or
    /// a short batch once no more prompts can be drawn); then all, in materialization order.
    Sync,
}

/// What `Plan::micro_batch` counts.
///
/// ```
/// use rolloutpipe_core::{MicroBatchUnit, Plan};
/// assert_eq!(Plan::new(4, 4).micro_batch_unit, MicroBatchUnit::Groups);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum MicroBatchUnit {
    /// Groups (`B / k_opt` must be a multiple of `micro_batch`).
    #[default]
    Groups,
    /// Samples: the groups' final sizes (they vary under VIGOR or Pilot-Commit).
    Samples,
    /// Tokens the groups' recorded responses generated.
    Tokens,
}

/// The per-step configuration, validated by `begin_step`.
///
/// ```
/// use rolloutpipe_core::{Plan, PlanError};
/// let mut plan = Plan::new(8, 4);
/// plan.micro_batch = 2;
/// plan.opt_steps = 2;
/// assert_eq!(plan.validate(), Ok(()));
/// plan.micro_batch = 3;
/// assert_eq!(plan.validate(), Err(PlanError::MicroBatchNotDivisor { per_opt_step: 4, micro_batch: 3 }));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Plan {
    /// B: trainable groups the step trains on.
    pub batch_groups: u32,
    /// G: initial samples per group (a group's target can be extended later).
    pub group_size: u16,
    /// m: the trainer micro-batch's size, in `micro_batch_unit`s (groups by default).
    pub micro_batch: u32,
    /// What `micro_batch` counts: groups, samples or tokens. With samples or tokens a
    /// micro-batch is cut after the group (groups are never split) that brings it to at least
    /// `micro_batch`, or that ends an optimizer step's `B / k_opt` groups.
    pub micro_batch_unit: MicroBatchUnit,
    /// k_opt: optimizer steps per rollout. `B % k_opt == 0` and `(B / k_opt) % m == 0`.
    pub opt_steps: u32,
    /// Requests the core may have in flight at once (E × S).
    pub slots: u32,
    /// Tries per request before its group is filtered (`AttemptsExhausted`); at least 1.
    pub max_attempts: u8,
    /// Cap on prompts drawn this step (over-sampling limit); at least B.
    pub max_groups: u32,
    /// Prompts requested per draw decision.
    pub draw_batch: u32,
    /// Groups kept in progress beyond B to pre-empt filtering (0 = draw only to replace).
    pub draw_ahead: u32,
    /// Admission policy.
    pub admission: AdmissionPolicy,
    /// Dispatch policy.
    pub dispatch: DispatchPolicy,
    /// Hold each fully scored group for an allocation decision (`poll_allocation`) instead of
    /// committing it at once. Off: today's fixed-G behaviour, unchanged.
    pub hold_scored: bool,
    /// Most samples the step may create, drawn groups' and extensions' together (0 = no cap
    /// beyond `max_groups × G` and the storage). At least `B × G` when set.
    pub sample_budget: u32,
    /// Samples of `sample_budget` reserved for each drawn group's first extension, until the
    /// group is decided (Pilot-Commit's `n_commit`; 0, the default, reserves nothing). A prompt
    /// drawn beyond the first B is drawn only with its reserve, and neither a draw nor another
    /// group's extension may take a reserve, so a kept prompt's commit is never crowded out by
    /// later pilots. Each of the first B prompts gets its reserve if the budget, less the
    /// batch's pilots still to draw, holds it. Ignored without a `sample_budget`.
    pub commit_reserve: u16,
}

impl Plan {
    /// A plan with B groups of G samples and defaults: m = 1, k_opt = 1, 1024 slots, 3 attempts,
    /// `max_groups = 2B`, `draw_batch = B`, no draw-ahead, group-major FIFO, pipelined dispatch.
    ///
    /// ```
    /// use rolloutpipe_core::Plan;
    /// let p = Plan::new(32, 8);
    /// assert_eq!((p.batch_groups, p.group_size, p.max_groups), (32, 8, 64));
    /// ```
    pub const fn new(batch_groups: u32, group_size: u16) -> Self {
        Plan {
            batch_groups,
            group_size,
            micro_batch: 1,
            micro_batch_unit: MicroBatchUnit::Groups,
            opt_steps: 1,
            slots: 1024,
            max_attempts: 3,
            max_groups: batch_groups.saturating_mul(2),
            draw_batch: batch_groups,
            draw_ahead: 0,
            admission: AdmissionPolicy::Fifo {
                order: SubmitOrder::GroupMajor,
            },
            dispatch: DispatchPolicy::Pipelined,
            hold_scored: false,
            sample_budget: 0,
            commit_reserve: 0,
        }
    }

    /// Checks the plan's own consistency (storage capacity is checked by `begin_step`).
    ///
    /// ```
    /// use rolloutpipe_core::{Plan, PlanError};
    /// assert_eq!(Plan::new(0, 4).validate(), Err(PlanError::ZeroBatch));
    /// ```
    pub const fn validate(&self) -> Result<(), PlanError> {
        if self.batch_groups == 0 {
            return Err(PlanError::ZeroBatch);
        }
        if self.group_size == 0 {
            return Err(PlanError::ZeroGroupSize);
        }
        if self.micro_batch == 0 {
            return Err(PlanError::ZeroMicroBatch);
        }
        if self.opt_steps == 0 {
            return Err(PlanError::ZeroOptSteps);
        }
        if !self.batch_groups.is_multiple_of(self.opt_steps) {
            return Err(PlanError::OptStepsNotDivisor {
                batch_groups: self.batch_groups,
                opt_steps: self.opt_steps,
            });
        }
        let per_opt_step = self.batch_groups / self.opt_steps;
        if matches!(self.micro_batch_unit, MicroBatchUnit::Groups)
            && !per_opt_step.is_multiple_of(self.micro_batch)
        {
            return Err(PlanError::MicroBatchNotDivisor {
                per_opt_step,
                micro_batch: self.micro_batch,
            });
        }
        if self.slots == 0 {
            return Err(PlanError::ZeroSlots);
        }
        if self.max_attempts == 0 {
            return Err(PlanError::ZeroAttempts);
        }
        if self.max_groups < self.batch_groups {
            return Err(PlanError::MaxGroupsBelowBatch {
                max_groups: self.max_groups,
                batch_groups: self.batch_groups,
            });
        }
        if self.draw_batch == 0 {
            return Err(PlanError::ZeroDrawBatch);
        }
        let batch_samples = self.batch_groups as u64 * self.group_size as u64;
        if self.sample_budget != 0 && (self.sample_budget as u64) < batch_samples {
            return Err(PlanError::SampleBudgetBelowBatch {
                sample_budget: self.sample_budget,
                needed: batch_samples,
            });
        }
        if let AdmissionPolicy::Frontier {
            expected_filter_ppm,
            ..
        } = self.admission
            && expected_filter_ppm >= 1_000_000
        {
            return Err(PlanError::FilterRateTooHigh {
                ppm: expected_filter_ppm,
            });
        }
        Ok(())
    }

    /// Groups per optimizer step, `B / k_opt` (valid plans only; 0 for `opt_steps == 0`).
    ///
    /// ```
    /// use rolloutpipe_core::Plan;
    /// let mut p = Plan::new(8, 2);
    /// p.opt_steps = 4;
    /// assert_eq!(p.groups_per_opt_step(), 2);
    /// ```
    pub const fn groups_per_opt_step(&self) -> u32 {
        match self.batch_groups.checked_div(self.opt_steps) {
            Some(n) => n,
            None => 0,
        }
    }
}

/// Why a plan was refused.
///
/// ```
/// use rolloutpipe_core::PlanError;
/// assert_eq!(PlanError::ZeroSlots.to_string(), "plan has zero rollout slots");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum PlanError {
    /// `batch_groups` is 0.
    ZeroBatch,
    /// `group_size` is 0.
    ZeroGroupSize,
    /// `micro_batch` is 0.
    ZeroMicroBatch,
    /// `opt_steps` is 0.
    ZeroOptSteps,
    /// `batch_groups % opt_steps != 0`.
    OptStepsNotDivisor {
        /// B.
        batch_groups: u32,
        /// k_opt.
        opt_steps: u32,
    },
    /// `(batch_groups / opt_steps) % micro_batch != 0`.
    MicroBatchNotDivisor {
        /// B / k_opt.
        per_opt_step: u32,
        /// m.
        micro_batch: u32,
    },
    /// `slots` is 0.
    ZeroSlots,
    /// `max_attempts` is 0.
    ZeroAttempts,
    /// `max_groups < batch_groups`.
    MaxGroupsBelowBatch {
        /// The cap.
        max_groups: u32,
        /// B.
        batch_groups: u32,
    },
    /// `draw_batch` is 0.
    ZeroDrawBatch,
    /// `sample_budget` is set but below `batch_groups × group_size`.
    SampleBudgetBelowBatch {
        /// The budget.
        sample_budget: u32,
        /// `batch_groups × group_size`.
        needed: u64,
    },
    /// `expected_filter_ppm >= 1_000_000`: the frontier would be infinite.
    FilterRateTooHigh {
        /// The rate given.
        ppm: u32,
    },
    /// The caller's group storage is smaller than `max_groups`.
    GroupCapacity {
        /// `max_groups`.
        needed: u32,
        /// Group slots available.
        capacity: u32,
    },
    /// The caller's request storage is smaller than `max_groups × group_size`: over-sampling
    /// could then ask for a draw the storage refuses.
    RequestCapacity {
        /// `max_groups × group_size`.
        needed: u64,
        /// Request slots available.
        capacity: u32,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            PlanError::ZeroBatch => f.write_str("plan has zero batch groups"),
            PlanError::ZeroGroupSize => f.write_str("plan has zero samples per group"),
            PlanError::ZeroMicroBatch => f.write_str("plan has a zero micro-batch"),
            PlanError::ZeroOptSteps => f.write_str("plan has zero optimizer steps"),
            PlanError::OptStepsNotDivisor {
                batch_groups,
                opt_steps,
            } => {
                write!(
                    f,
                    "batch of {batch_groups} groups is not divisible into {opt_steps} optimizer steps"
                )
            }
            PlanError::MicroBatchNotDivisor {
                per_opt_step,
                micro_batch,
            } => write!(
                f,
                "{per_opt_step} groups per optimizer step are not divisible into micro-batches of {micro_batch}"
            ),
            PlanError::ZeroSlots => f.write_str("plan has zero rollout slots"),
            PlanError::ZeroAttempts => f.write_str("plan allows zero attempts per request"),
            PlanError::MaxGroupsBelowBatch {
                max_groups,
                batch_groups,
            } => {
                write!(
                    f,
                    "max_groups {max_groups} is below the batch of {batch_groups} groups"
                )
            }
            PlanError::ZeroDrawBatch => f.write_str("plan draws zero prompts at a time"),
            PlanError::SampleBudgetBelowBatch {
                sample_budget,
                needed,
            } => write!(
                f,
                "sample_budget {sample_budget} is below the batch's {needed} samples"
            ),
            PlanError::FilterRateTooHigh { ppm } => {
                write!(f, "expected filter rate {ppm} ppm must be below 1000000")
            }
            PlanError::GroupCapacity { needed, capacity } => {
                write!(
                    f,
                    "max_groups {needed} exceeds the {capacity} group slots provided"
                )
            }
            PlanError::RequestCapacity { needed, capacity } => {
                write!(
                    f,
                    "over-sampling may need {needed} request slots but {capacity} are provided"
                )
            }
        }
    }
}

impl core::error::Error for PlanError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_defaults_validate() {
        assert_eq!(Plan::new(4, 2).validate(), Ok(()));
    }

    #[test]
    fn plan_rejects_each_bad_field() {
        let base = Plan::new(8, 4);
        let mut p = base;
        p.group_size = 0;
        assert_eq!(p.validate(), Err(PlanError::ZeroGroupSize));
        let mut p = base;
        p.opt_steps = 3;
        assert_eq!(
            p.validate(),
            Err(PlanError::OptStepsNotDivisor {
                batch_groups: 8,
                opt_steps: 3
            })
        );
        let mut p = base;
        p.max_groups = 7;
        assert_eq!(
            p.validate(),
            Err(PlanError::MaxGroupsBelowBatch {
                max_groups: 7,
                batch_groups: 8
            })
        );
        let mut p = base;
        p.admission = AdmissionPolicy::Frontier {
            width: 0,
            expected_filter_ppm: 1_000_000,
            fallback: SubmitOrder::GroupMajor,
        };
        assert_eq!(
            p.validate(),
            Err(PlanError::FilterRateTooHigh { ppm: 1_000_000 })
        );
        let mut p = base;
        p.max_attempts = 0;
        assert_eq!(p.validate(), Err(PlanError::ZeroAttempts));
        let mut p = base;
        p.draw_batch = 0;
        assert_eq!(p.validate(), Err(PlanError::ZeroDrawBatch));
    }

    #[test]
    fn ids_display() {
        let r = RequestId {
            step: StepId(2),
            group: GroupId(3),
            sample: 1,
            attempt: 2,
        };
        assert_eq!(alloc_free_fmt(&r), "step 2/g3/s1/a2");
    }

    fn alloc_free_fmt(r: &RequestId) -> heapless::String<64> {
        use core::fmt::Write;
        let mut s = heapless::String::new();
        let _ = write!(s, "{r}");
        s
    }
}
