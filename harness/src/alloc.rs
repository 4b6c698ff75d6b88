//! The `[alloc]` config section shared by `train` and `simulate`: which allocation policy
//! decides the samples per prompt (GRPO's fixed G, VIGOR or Pilot-Commit, from
//! `rolloutpipe-core`), its parameters, their validation with one-line errors that name the
//! parameter, and the plan fields the policy needs.
//!
//! A DAPO-style filter is not a policy here: fixed G already filters zero-variance groups, and
//! over-sampling (`rollout.max_groups_factor > 1` in `train`, `scheduler.max_groups_factor` in
//! `simulate`) draws replacements for them; with a factor of 1 the batch is simply short, which is
//! plain GRPO (a zero-variance group has zero advantage, so it adds no gradient).
use anyhow::bail;
use rolloutpipe_core::{
    AllocParamError, Allocate, Allocation, FixedG, GroupId, PilotCommit, Plan, View, Vigor,
};
use serde::{Deserialize, Serialize};

crate::named! {
    /// Which allocation policy decides the samples per prompt (`alloc.policy`).
    pub enum AllocPolicy {
        /// GRPO: every prompt gets G samples.
        Fixed = "fixed",
        /// VIGOR: n0 each, then extra rounds for the highest-variance groups.
        Vigor = "vigor",
        /// Pilot-Commit: a pilot, then a commit, a skip or a deferral per prompt.
        PilotCommit = "pilot_commit",
    }
}

/// `[alloc]`: the allocation policy and its parameters. Every key has a default, so a config
/// without the section (or some of its keys) loads, as fixed G.
///
/// ```
/// use rolloutpipe_harness::alloc::{AllocPolicy, AllocSection};
/// let s = AllocSection { policy: AllocPolicy::Vigor, ..AllocSection::default() };
/// assert!(s.allocator(16, 8).is_ok());
/// let bad = AllocSection { policy: AllocPolicy::Vigor, n0: 1, ..AllocSection::default() };
/// assert_eq!(bad.allocator(16, 8).unwrap_err().to_string(), "alloc.n0 is 1, must be at least 2");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AllocSection {
    /// The policy.
    pub policy: AllocPolicy,
    /// Samples one step may generate, drawn groups' and extensions' together; 0 = B × G, the
    /// fixed-G step's budget (so policies compare at the same rollout budget). VIGOR and
    /// Pilot-Commit only; fixed G keeps its over-sampling limit (`max_groups × G`).
    pub budget: u32,
    /// VIGOR: initial samples per prompt (at least 2).
    pub n0: u16,
    /// VIGOR: extra rounds after the first (0 = plain GRPO with G = n0).
    pub rounds: u16,
    /// VIGOR: samples added to each chosen group per round (at least 1).
    pub increment: u16,
    /// Pilot-Commit: pilot samples per prompt (at least 2).
    pub n_pilot: u16,
    /// Pilot-Commit: samples added to a kept prompt (at least 2).
    pub n_commit: u16,
    /// Pilot-Commit: a prompt whose pilot mean reward is below `lower` is deferred as too hard.
    pub lower: f32,
    /// Pilot-Commit: a prompt whose pilot mean reward is above `1 − upper` is skipped as too easy.
    pub upper: f32,
    /// Pilot-Commit: a prompt whose pilot is all correct (p = 1) is evicted from later epochs.
    pub evict_solved: bool,
}

impl Default for AllocSection {
    fn default() -> Self {
        AllocSection {
            policy: AllocPolicy::Fixed,
            budget: 0,
            n0: 4,
            rounds: 2,
            increment: 4,
            n_pilot: 4,
            n_commit: 4,
            lower: PilotCommit::DEFAULT_LOWER,
            upper: PilotCommit::DEFAULT_UPPER,
            evict_solved: true,
        }
    }
}

/// A configured allocation policy: what `poll_allocation_with` asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Allocator {
    /// GRPO's fixed G.
    Fixed,
    /// VIGOR.
    Vigor(Vigor),
    /// Pilot-Commit.
    PilotCommit(PilotCommit),
}

impl Allocate for Allocator {
    fn decide(&self, view: &View<'_, '_>, group: GroupId) -> Allocation {
        match self {
            Allocator::Fixed => FixedG.decide(view, group),
            Allocator::Vigor(v) => v.decide(view, group),
            Allocator::PilotCommit(p) => p.decide(view, group),
        }
    }
}

impl AllocSection {
    /// The step's sample budget for batches of `batch_groups` groups of `group_size`.
    pub fn budget_for(&self, batch_groups: u32, group_size: u16) -> u32 {
        if self.budget == 0 {
            batch_groups.saturating_mul(u32::from(group_size))
        } else {
            self.budget
        }
    }

    /// The policy, with every parameter checked; errors name the parameter
    /// (`alloc.n0 is 1, must be at least 2`).
    ///
    /// Every policy's own parameters are checked whichever policy is selected, so a bad VIGOR
    /// key in a fixed-G config is an error now, not when someone later switches the policy.
    /// What depends on the batch (the budget against `n0 × B` or one pilot) is checked for the
    /// selected policy only. Fixed G refuses a non-zero `budget`: its step spends
    /// `max_groups × G` samples (`rollout.max_groups_factor`), so a budget would be silently
    /// ignored and the run would not be the comparison its config claims.
    pub fn allocator(&self, batch_groups: u32, group_size: u16) -> anyhow::Result<Allocator> {
        let named = |e: AllocParamError| anyhow::anyhow!("alloc.{e}");
        // VIGOR's own parameters: a batch of 0 groups makes the budget check vacuous.
        Vigor::new(self.n0, self.rounds, self.increment, self.budget, 0).map_err(named)?;
        let pilot =
            PilotCommit::new(self.n_pilot, self.n_commit, self.lower, self.upper).map_err(named)?;
        let budget = self.budget_for(batch_groups, group_size);
        Ok(match self.policy {
            AllocPolicy::Vigor => Allocator::Vigor(
                Vigor::new(self.n0, self.rounds, self.increment, budget, batch_groups)
                    .map_err(named)?,
            ),
            AllocPolicy::PilotCommit => {
                if budget < u32::from(self.n_pilot) {
                    bail!(
                        "alloc.budget {budget} is below one pilot of alloc.n_pilot = {} samples",
                        self.n_pilot
                    );
                }
                Allocator::PilotCommit(pilot)
            }
            AllocPolicy::Fixed => {
                if self.budget != 0 {
                    bail!(
                        "alloc.budget is {}, but alloc.policy = \"fixed\" has no step budget (it spends up to max_groups × G samples; over-sample with rollout.max_groups_factor): set alloc.budget = 0 or choose vigor or pilot_commit",
                        self.budget
                    );
                }
                Allocator::Fixed
            }
        })
    }

    /// Sets the plan fields the policy relies on (initial group size, sample budget, hold after
    /// scoring). `plan` comes in as the fixed-G plan of B groups of G. VIGOR draws no
    /// replacements (`max_groups = B`), as in its paper: with over-sampling, replacement draws
    /// of `draw_batch` prompts would spend the budget that the extra rounds are for, and a
    /// group still without variance after its rounds just shortens the batch.
    pub fn configure(&self, allocator: &Allocator, plan: &mut Plan) {
        let budget = self.budget_for(plan.batch_groups, plan.group_size);
        match allocator {
            Allocator::Fixed => {}
            Allocator::Vigor(v) => {
                v.configure(plan);
                plan.max_groups = plan.batch_groups;
            }
            Allocator::PilotCommit(p) => {
                p.configure(plan);
                plan.sample_budget = budget;
            }
        }
    }

    /// Most samples one group can end with under `policy` (sizes the per-group buffers).
    pub fn max_group_samples(&self, allocator: &Allocator, plan: &Plan) -> u16 {
        match allocator {
            Allocator::Fixed => plan.group_size,
            Allocator::Vigor(_) => plan
                .group_size
                .saturating_add(self.rounds.saturating_mul(self.increment)),
            Allocator::PilotCommit(_) => self.n_pilot.saturating_add(self.n_commit),
        }
    }

    /// Request slots the core needs for `plan` under `policy`: every prompt it may draw at its
    /// initial size, plus the extensions the sample budget allows.
    pub fn request_capacity(&self, allocator: &Allocator, plan: &Plan) -> usize {
        let draws = plan.max_groups as usize * plan.group_size as usize;
        match allocator {
            Allocator::Fixed => draws,
            _ => draws + plan.sample_budget as usize,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sec(policy: &str) -> AllocSection {
        AllocSection {
            policy: AllocPolicy::parse(policy).unwrap(),
            ..AllocSection::default()
        }
    }

    #[test]
    fn defaults_build_every_policy() {
        for p in ["fixed", "vigor", "pilot_commit"] {
            sec(p).allocator(16, 8).unwrap();
        }
        assert_eq!(sec("fixed").allocator(16, 8).unwrap(), Allocator::Fixed);
    }

    #[test]
    fn bad_parameters_are_named() {
        let err = |s: AllocSection| s.allocator(16, 8).unwrap_err().to_string();
        // Read from TOML, the key comes first (`alloc.policy "greedy" is not one of ...`).
        assert_eq!(
            AllocPolicy::parse("greedy").unwrap_err(),
            "\"greedy\" is not one of fixed, vigor, pilot_commit"
        );
        assert_eq!(
            err(AllocSection {
                budget: 63,
                ..sec("vigor")
            }),
            "alloc.budget 63 is below n0 × batch_groups = 64 samples"
        );
        assert_eq!(
            err(AllocSection {
                n_pilot: 1,
                ..sec("pilot_commit")
            }),
            "alloc.n_pilot is 1, must be at least 2"
        );
        assert_eq!(
            err(AllocSection {
                n_commit: 0,
                ..sec("pilot_commit")
            }),
            "alloc.n_commit is 0, must be at least 2"
        );
        assert_eq!(
            err(AllocSection {
                lower: -0.1,
                ..sec("pilot_commit")
            }),
            "alloc.lower is -0.1, must be within [0, 1]"
        );
        assert_eq!(
            err(AllocSection {
                upper: f32::NAN,
                ..sec("pilot_commit")
            }),
            "alloc.upper is NaN, must be within [0, 1]"
        );
        assert!(
            err(AllocSection {
                lower: 0.8,
                upper: 0.5,
                ..sec("pilot_commit")
            })
            .starts_with("alloc.lower 0.8 is above 1 - upper 0.5")
        );
    }

    #[test]
    fn every_policys_parameters_are_checked_whatever_the_selected_policy() {
        let err = |s: AllocSection| s.allocator(16, 8).unwrap_err().to_string();
        // A bad key of a policy that is not selected is still refused, naming it.
        for (bad, msg) in [
            (
                AllocSection {
                    n0: 1,
                    ..sec("fixed")
                },
                "alloc.n0 is 1, must be at least 2",
            ),
            (
                AllocSection {
                    increment: 0,
                    ..sec("pilot_commit")
                },
                "alloc.increment is 0, must be at least 1",
            ),
            (
                AllocSection {
                    upper: 1.5,
                    ..sec("fixed")
                },
                "alloc.upper is 1.5, must be within [0, 1]",
            ),
            (
                AllocSection {
                    n_commit: 1,
                    ..sec("vigor")
                },
                "alloc.n_commit is 1, must be at least 2",
            ),
            (
                AllocSection {
                    lower: f32::NAN,
                    ..sec("vigor")
                },
                "alloc.lower is NaN, must be within [0, 1]",
            ),
        ] {
            let e = err(bad);
            assert_eq!(e, msg);
            assert!(!e.contains('\n'), "{e}");
        }
        // The batch-dependent checks are the selected policy's only: fixed G with G = 2 (a
        // B × G of 32, below VIGOR's n0 × B = 64) is fine.
        assert_eq!(sec("fixed").allocator(16, 2).unwrap(), Allocator::Fixed);
        assert!(
            err(AllocSection {
                budget: 63,
                ..sec("vigor")
            })
            .starts_with("alloc.budget 63 is below")
        );
    }

    #[test]
    fn fixed_g_refuses_a_budget_it_would_ignore() {
        let e = AllocSection {
            budget: 256,
            ..sec("fixed")
        }
        .allocator(16, 8)
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("alloc.budget is 256, but alloc.policy = \"fixed\""),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
        // The same budget is what VIGOR and Pilot-Commit are for.
        for p in ["vigor", "pilot_commit"] {
            AllocSection {
                budget: 256,
                ..sec(p)
            }
            .allocator(16, 8)
            .unwrap();
        }
    }

    #[test]
    fn configure_sets_the_plan_the_policy_needs() {
        let s = sec("vigor");
        let p = s.allocator(16, 8).unwrap();
        let mut plan = Plan::new(16, 8);
        s.configure(&p, &mut plan);
        assert_eq!(
            (plan.group_size, plan.sample_budget, plan.hold_scored),
            (4, 128, true)
        );
        assert_eq!(s.max_group_samples(&p, &plan), 12);
        assert_eq!(plan.max_groups, 16);
        assert_eq!(s.request_capacity(&p, &plan), 16 * 4 + 128);
        let s = sec("pilot_commit");
        let p = s.allocator(16, 8).unwrap();
        let mut plan = Plan::new(16, 8);
        s.configure(&p, &mut plan);
        assert_eq!(
            (plan.group_size, plan.sample_budget, plan.hold_scored),
            (4, 128, true)
        );
        assert_eq!(s.max_group_samples(&p, &plan), 8);
        let mut plan = Plan::new(16, 8);
        sec("fixed").configure(&Allocator::Fixed, &mut plan);
        assert_eq!(plan, Plan::new(16, 8));
    }
}
