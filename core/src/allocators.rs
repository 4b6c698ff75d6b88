//! Allocation policies on the [`Allocate`] seam: [`Vigor`] (variance-guided extra rounds under
//! a step budget) and [`PilotCommit`] (pilot, then keep, skip or defer). Both are pure functions
//! of the read-only [`View`], allocation-free, and compose with any admission and dispatch
//! policy: a committed group completes, is materialized and dispatched FIFO like any other.
//! [`FixedG`](crate::FixedG) is GRPO's baseline.

use core::fmt;

use crate::allocate::{Allocate, Allocation};
use crate::policy::View;
use crate::state::SkipReason;
use crate::types::{GroupId, Plan};

/// A policy parameter, as named in errors and configs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum Param {
    /// VIGOR's initial samples per prompt.
    N0,
    /// VIGOR's extra samples per group and round.
    Increment,
    /// VIGOR's step budget of samples.
    Budget,
    /// Pilot-Commit's pilot samples per prompt.
    NPilot,
    /// Pilot-Commit's extra samples for a kept prompt.
    NCommit,
    /// Pilot-Commit's lower threshold.
    Lower,
    /// Pilot-Commit's upper threshold.
    Upper,
}

impl fmt::Display for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Param::N0 => "n0",
            Param::Increment => "increment",
            Param::Budget => "budget",
            Param::NPilot => "n_pilot",
            Param::NCommit => "n_commit",
            Param::Lower => "lower",
            Param::Upper => "upper",
        })
    }
}

/// Why a policy's parameters were refused.
///
/// ```
/// use rolloutpipe_core::{AllocParamError, PilotCommit};
/// let e = PilotCommit::new(1, 8, 0.125, 0.25).unwrap_err();
/// assert_eq!(e.to_string(), "n_pilot is 1, must be at least 2");
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
#[non_exhaustive]
pub enum AllocParamError {
    /// A sample count below 2 (no reward variance to measure), or an increment of 0.
    TooSmall {
        /// Which.
        param: Param,
        /// Its value.
        value: u32,
        /// The least allowed.
        min: u32,
    },
    /// The step budget cannot give every prompt of the batch its `n0` samples.
    BudgetBelowBatch {
        /// The budget.
        budget: u32,
        /// `n0 × B`.
        needed: u64,
    },
    /// A threshold outside `[0, 1]` (or NaN).
    OutOfRange {
        /// Which.
        param: Param,
        /// Its value.
        value: f32,
    },
    /// `lower > 1 − upper`: no mean reward would be kept.
    EmptyBand {
        /// The lower threshold.
        lower: f32,
        /// The upper threshold.
        upper: f32,
    },
}

impl fmt::Display for AllocParamError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            AllocParamError::TooSmall { param, value, min } => {
                write!(f, "{param} is {value}, must be at least {min}")
            }
            AllocParamError::BudgetBelowBatch { budget, needed } => write!(
                f,
                "budget {budget} is below n0 × batch_groups = {needed} samples"
            ),
            AllocParamError::OutOfRange { param, value } => {
                write!(f, "{param} is {value}, must be within [0, 1]")
            }
            AllocParamError::EmptyBand { lower, upper } => write!(
                f,
                "lower {lower} is above 1 - upper {upper}: no prompt would be kept"
            ),
        }
    }
}

impl core::error::Error for AllocParamError {}

fn at_least(param: Param, value: u32, min: u32) -> Result<(), AllocParamError> {
    if value < min {
        return Err(AllocParamError::TooSmall { param, value, min });
    }
    Ok(())
}

/// VIGOR: every prompt starts with `n0` samples; then, in up to `rounds` rounds, the groups
/// with the highest reward variance get `increment` more samples each, until the step's
/// `budget` is spent.
///
/// Each round's share of the extra budget is `(budget − n0 × B) / rounds` samples, so
/// `k = share / increment` groups are extended per round: the top `k` by reward variance
/// (ties by group id, so the choice is deterministic), among the groups that reached that round
/// with non-zero variance. A group waits ([`Allocation::Wait`]) until every group of its round
/// is scored, so the ranking sees the whole round; the greedy order in which the core then
/// decides the held groups picks exactly the round's top `k`. The core also refuses (applies
/// `Commit` for) any extension past `Plan::sample_budget`, which [`Vigor::configure`] sets, so
/// the budget holds even when prompts are over-drawn.
///
/// Cost: a decision scans the drawn groups, O(drawn), so a round costs O(B²); fine for the
/// batch sizes RL steps use (B ≤ a few thousand), not for the 65,536-group benchmark rows.
///
/// ```
/// use rolloutpipe_core::*;
/// let v = Vigor::new(4, 2, 4, 64, 8).unwrap();
/// assert_eq!(v.per_round_groups(), 4); // (64 - 4 × 8) / 2 rounds / 4 samples
/// assert!(matches!(Vigor::new(4, 2, 4, 31, 8), Err(AllocParamError::BudgetBelowBatch { .. })));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Vigor {
    n0: u16,
    rounds: u16,
    increment: u16,
    budget: u32,
    batch_groups: u32,
}

impl Vigor {
    /// VIGOR with `n0` initial samples per prompt, up to `rounds` extra rounds of `increment`
    /// samples per chosen group, and a step `budget` of samples, for batches of `batch_groups`.
    pub fn new(
        n0: u16,
        rounds: u16,
        increment: u16,
        budget: u32,
        batch_groups: u32,
    ) -> Result<Self, AllocParamError> {
        at_least(Param::N0, n0 as u32, 2)?;
        at_least(Param::Increment, increment as u32, 1)?;
        let needed = n0 as u64 * batch_groups as u64;
        if (budget as u64) < needed {
            return Err(AllocParamError::BudgetBelowBatch { budget, needed });
        }
        Ok(Vigor {
            n0,
            rounds,
            increment,
            budget,
            batch_groups,
        })
    }

    /// Sets the plan fields this policy relies on: `group_size = n0`, the sample budget, and
    /// the hold after scoring.
    pub fn configure(&self, plan: &mut Plan) {
        plan.group_size = self.n0;
        plan.sample_budget = self.budget;
        plan.hold_scored = true;
    }

    /// Groups extended per round.
    pub fn per_round_groups(&self) -> u32 {
        if self.rounds == 0 {
            return 0;
        }
        let extra = self.budget as u64 - self.n0 as u64 * self.batch_groups as u64;
        (extra / self.rounds as u64 / self.increment as u64) as u32
    }

    /// The round a group of `target` samples is in (0 while it has its `n0`).
    fn round(&self, target: u16) -> u32 {
        (target.saturating_sub(self.n0) / self.increment) as u32
    }
}

impl Allocate for Vigor {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        let (Some(st), Some(target)) = (v.reward_stats(g), v.group_target(g)) else {
            return Allocation::Commit;
        };
        let r = self.round(target);
        let var = var_key(st.var);
        if r >= self.rounds as u32 || var == 0 {
            return Allocation::Commit;
        }
        let mut rank = 0u32;
        for h in v.incomplete() {
            let Some(ht) = v.group_target(h) else {
                continue;
            };
            let hr = self.round(ht);
            // An earlier round is unfinished, or a group of this round is still generating.
            if hr < r || (hr == r && !v.is_held(h)) {
                return Allocation::Wait;
            }
            if hr == r && h != g {
                let hv = v.reward_stats(h).map_or(0, |s| var_key(s.var));
                if hv > var || (hv == var && h.0 < g.0) {
                    rank += 1;
                }
            }
        }
        // Groups already extended in this round (they are in a later round now).
        let next = self.n0 as u32 + (r + 1) * self.increment as u32;
        let extended = (0..v.counters().drawn)
            .filter(|&h| v.group_target(GroupId(h)).is_some_and(|t| t as u32 >= next))
            .count() as u32;
        if rank < self.per_round_groups().saturating_sub(extended) {
            Allocation::Extend(self.increment)
        } else {
            Allocation::Commit
        }
    }
}

/// A variance as a ranking key, rounded to 1e-9: the running (Welford) variance of the same
/// rewards differs in the last bits with their arrival order, and the ranking, hence the policy,
/// must not depend on that order.
pub(crate) fn var_key(var: f64) -> u64 {
    if var > 0.0 {
        (var * 1e9 + 0.5) as u64
    } else {
        0
    }
}

/// Pilot-Commit: a pilot of `n_pilot` samples per prompt (over-draw prompts with
/// `Plan::max_groups`); a prompt whose mean reward p satisfies `lower ≤ p ≤ 1 − upper` is kept
/// and gets `n_commit` more samples; above the band it is skipped as too easy
/// ([`SkipReason::Solved`] when p = 1, so the caller can evict it from later epochs), below it
/// deferred as too hard ([`SkipReason::TooHard`]). Rewards are taken as success in `[0, 1]`.
///
/// ```
/// use rolloutpipe_core::*;
/// let p = PilotCommit::new(4, 12, 0.125, 0.25).unwrap();
/// let mut plan = Plan::new(8, 16);
/// p.configure(&mut plan);
/// assert_eq!((plan.group_size, plan.hold_scored), (4, true));
/// assert!(matches!(PilotCommit::new(4, 12, 1.5, 0.25), Err(AllocParamError::OutOfRange { param: Param::Lower, .. })));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PilotCommit {
    n_pilot: u16,
    n_commit: u16,
    lower: f32,
    upper: f32,
}

impl PilotCommit {
    /// The public code's 1.5B-model thresholds.
    pub const DEFAULT_LOWER: f32 = 0.125;
    /// See [`DEFAULT_LOWER`](Self::DEFAULT_LOWER).
    pub const DEFAULT_UPPER: f32 = 0.25;

    /// Pilot-Commit with `n_pilot` pilot and `n_commit` commit samples and the keep band
    /// `[lower, 1 − upper]`.
    pub fn new(
        n_pilot: u16,
        n_commit: u16,
        lower: f32,
        upper: f32,
    ) -> Result<Self, AllocParamError> {
        at_least(Param::NPilot, n_pilot as u32, 2)?;
        at_least(Param::NCommit, n_commit as u32, 2)?;
        for (param, value) in [(Param::Lower, lower), (Param::Upper, upper)] {
            if !(0.0..=1.0).contains(&value) {
                return Err(AllocParamError::OutOfRange { param, value });
            }
        }
        if lower > 1.0 - upper {
            return Err(AllocParamError::EmptyBand { lower, upper });
        }
        Ok(PilotCommit {
            n_pilot,
            n_commit,
            lower,
            upper,
        })
    }

    /// Sets the plan fields this policy relies on: `group_size = n_pilot`, the hold after
    /// scoring, and `commit_reserve = n_commit`, so that with a `sample_budget` a kept prompt's
    /// commit is reserved before another pilot is drawn (the public code commits to every kept
    /// prompt of its over-drawn set). Over-drawing (`max_groups`) and the budget are the
    /// caller's choice.
    pub fn configure(&self, plan: &mut Plan) {
        plan.group_size = self.n_pilot;
        plan.hold_scored = true;
        plan.commit_reserve = self.n_commit;
    }

    /// The verdict on a pilot whose mean reward is `p`.
    ///
    /// ```
    /// use rolloutpipe_core::*;
    /// let pc = PilotCommit::new(8, 8, 0.125, 0.25).unwrap();
    /// assert_eq!(pc.verdict(0.5), Allocation::Extend(8));
    /// assert_eq!(pc.verdict(0.75), Allocation::Extend(8)); // 1 − upper, inclusive
    /// assert_eq!(pc.verdict(0.875), Allocation::Skip(SkipReason::TooEasy));
    /// assert_eq!(pc.verdict(1.0), Allocation::Skip(SkipReason::Solved));
    /// assert_eq!(pc.verdict(0.0), Allocation::Skip(SkipReason::TooHard));
    /// ```
    pub fn verdict(&self, p: f64) -> Allocation {
        if p >= 1.0 {
            Allocation::Skip(SkipReason::Solved)
        } else if p > 1.0 - self.upper as f64 {
            Allocation::Skip(SkipReason::TooEasy)
        } else if p < self.lower as f64 {
            Allocation::Skip(SkipReason::TooHard)
        } else {
            Allocation::Extend(self.n_commit)
        }
    }
}

impl Allocate for PilotCommit {
    fn decide(&self, v: &View<'_, '_>, g: GroupId) -> Allocation {
        match (v.reward_stats(g), v.group_target(g)) {
            // Still the pilot: judge it.
            (Some(st), Some(t)) if t <= self.n_pilot => self.verdict(st.mean),
            // Committed samples are in: done.
            _ => Allocation::Commit,
        }
    }
}
