//! The core's per-step [`Plan`] as `simulate` and `train` derive it from their configs: one
//! rule ([`PlanSpec::plan`]), so that the two cannot drift apart on it.

use rolloutpipe_core::{AdmissionPolicy, Counters, DispatchPolicy, Plan, SubmitOrder};

use super::mode::Mode;

crate::named! {
    /// The baseline FIFO's queue order as configs name it (the core's [`SubmitOrder`] without
    /// the seed, which is the run's).
    pub enum QueueOrder {
        /// All samples of group 0, then group 1, ... (Slime's asyncio order).
        GroupMajor = "group_major",
        /// Sample 0 of every group of a draw batch, then sample 1, ...
        Interleaved = "interleaved",
        /// A seeded permutation within each draw batch.
        Shuffled = "shuffled",
    }
}

impl QueueOrder {
    /// The core's order, a shuffle seeded by `seed`.
    pub fn with_seed(self, seed: u64) -> SubmitOrder {
        match self {
            QueueOrder::GroupMajor => SubmitOrder::GroupMajor,
            QueueOrder::Interleaved => SubmitOrder::Interleaved,
            QueueOrder::Shuffled => SubmitOrder::Shuffled { seed },
        }
    }
}

/// What a step's plan is derived from, whichever config holds it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanSpec {
    /// The core's policies.
    pub mode: Mode,
    /// B: trainable groups per step.
    pub batch: u32,
    /// G: responses per prompt.
    pub group: u16,
    /// m: groups per micro-batch.
    pub micro_batch: u32,
    /// Optimizer steps per rollout.
    pub opt_steps: u32,
    /// Requests that may run at once (engines × slots).
    pub slots: u32,
    /// Attempts per request before its group is filtered.
    pub max_attempts: u8,
    /// Over-sampling cap as a multiple of B ([`max_groups`]).
    pub max_groups_factor: f64,
    /// Prompts drawn per draw decision.
    pub draw_batch: u32,
    /// Groups kept in progress beyond B.
    pub draw_ahead: u32,
    /// FGD: extra frontier groups.
    pub frontier_width: u32,
    /// The baseline queue order (FGD's fallback too).
    pub order: SubmitOrder,
}

impl PlanSpec {
    /// The fixed-G plan of this spec, FGD's frontier widened by `filter`. An allocation
    /// policy then sets its own fields (`alloc::AllocSection::configure`).
    pub fn plan(&self, filter: FilterEstimate) -> Plan {
        let mut p = Plan::new(self.batch, self.group);
        p.micro_batch = self.micro_batch;
        p.opt_steps = self.opt_steps;
        p.slots = self.slots;
        p.max_attempts = self.max_attempts;
        p.max_groups = max_groups(self.batch, self.max_groups_factor);
        p.draw_batch = self.draw_batch;
        p.draw_ahead = self.draw_ahead;
        p.admission = if self.mode.frontier() {
            AdmissionPolicy::Frontier {
                width: self.frontier_width,
                expected_filter_ppm: filter.ppm(),
                fallback: self.order,
            }
        } else {
            AdmissionPolicy::Fifo { order: self.order }
        };
        p.dispatch = if self.mode.pipelined() {
            DispatchPolicy::Pipelined
        } else {
            DispatchPolicy::Sync
        };
        p
    }
}

/// Prompts one step may draw at most, from the batch `batch` (B) and the over-sampling
/// factor: `⌈B · factor⌉`, never below B (a step must be able to draw its batch), saturating
/// at `u32::MAX`. Validation (`factor` finite and ≥ 1) is the configs'; a factor below 1 or
/// a NaN still yields B.
pub fn max_groups(batch: u32, factor: f64) -> u32 {
    let drawn = (f64::from(batch) * factor).ceil();
    // `as` saturates (and maps NaN to 0), so the result is in [B, u32::MAX].
    (drawn as u32).max(batch)
}

/// Highest share of groups the filter estimate takes for FGD: at 1.0 the frontier would be
/// unbounded, and a step that filtered everything says little about the next.
pub const MAX_FILTER_ESTIMATE: f64 = 0.95;

/// FGD's estimate of the share of a step's groups that the filter drops, which widens the
/// frontier (the core's `expected_filter_ppm`): `prior` for the first step, then the share the
/// previous step filtered among the groups it resolved (filtered, or accepted into the batch;
/// aborted groups resolve neither way), clamped to [`MAX_FILTER_ESTIMATE`]. The previous
/// step is what a live system knows when the next one begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FilterEstimate {
    ppm: u32,
}

impl FilterEstimate {
    /// The estimate before any step was seen (the configs' prior, validated in [0, 1)).
    pub fn prior(share: f64) -> Self {
        Self::of(share)
    }

    fn of(share: f64) -> Self {
        let share = if share.is_finite() { share } else { 0.0 };
        Self {
            // Truncated: the parts per million below the share.
            ppm: (share.clamp(0.0, MAX_FILTER_ESTIMATE) * 1e6) as u32,
        }
    }

    /// Takes the share the step whose final counters are `c` filtered.
    pub fn observe(&mut self, c: &Counters) {
        let (filtered, kept) = (f64::from(c.filtered()), f64::from(c.batch_filled()));
        *self = Self::of(filtered / (filtered + kept).max(1.0));
    }

    /// For the next step's plan, in parts per million.
    pub fn ppm(self) -> u32 {
        self.ppm
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_estimate_is_the_prior_then_the_previous_steps_share() {
        assert_eq!(FilterEstimate::prior(0.3).ppm(), 300_000);
        assert_eq!(FilterEstimate::prior(0.0).ppm(), 0);
        // Out-of-range priors are clamped (validation refuses them before this).
        assert_eq!(FilterEstimate::prior(1.0).ppm(), 950_000);
        assert_eq!(FilterEstimate::prior(f64::NAN).ppm(), 0);
        let mut e = FilterEstimate::prior(0.3);
        // 3 filtered, 8 in the batch (trainable + dispatched + trained), 5 aborted.
        let c = Counters {
            filtered_zero_variance: 2,
            filtered_attempts: 1,
            trainable: 1,
            dispatched: 2,
            trained: 5,
            aborted: 5,
            ..Counters::default()
        };
        e.observe(&c);
        assert_eq!(e.ppm(), 272_727); // 3 / 11, aborted groups not counted
        // Only the previous step counts, not a running mean.
        let c2 = Counters {
            trained: 4,
            ..Counters::default()
        };
        e.observe(&c2);
        assert_eq!(e.ppm(), 0);
        // Everything filtered: clamped.
        let c3 = Counters {
            filtered_zero_variance: 9,
            ..Counters::default()
        };
        e.observe(&c3);
        assert_eq!(e.ppm(), 950_000);
        // A step that resolved nothing (all aborted) reads as 0, not NaN.
        e.observe(&Counters::default());
        assert_eq!(e.ppm(), 0);
    }

    #[test]
    fn max_groups_rounds_up_and_never_below_the_batch() {
        // Integer factors: exact (the default configs: train 8 x 3.0, simulate B x 8.0).
        assert_eq!(max_groups(8, 3.0), 24);
        assert_eq!(max_groups(32, 8.0), 256);
        // Non-integer: up, so a step may draw the fractional prompt.
        assert_eq!(max_groups(8, 1.1), 9);
        assert_eq!(max_groups(3, 1.5), 5);
        assert_eq!(max_groups(10, 1.05), 11);
        // Never below B, whatever the factor.
        assert_eq!(max_groups(8, 1.0), 8);
        assert_eq!(max_groups(8, 0.5), 8);
        assert_eq!(max_groups(8, f64::NAN), 8);
        // Saturates instead of wrapping.
        assert_eq!(max_groups(u32::MAX, 2.0), u32::MAX);
        assert_eq!(max_groups(4, f64::INFINITY), u32::MAX);
    }
}
